"""How much work the HTTP API takes on at once, counted three ways.

Counting requests alone lets one request of 60 MB, or one asking for two million tokens, cost
what a thousand ordinary ones do. So the broker also counts the bytes of request bodies being
read and decoded, and the tokens of interactive work in progress (an upper bound known before
any text is tokenized: see `tokens_of_texts`). A request that would pass any of the three
limits is answered 429 with `Retry-After` at once, before the broker reads or tokenizes it;
work already admitted is never cut short.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from broker.errors import TooBusy


@dataclass(frozen=True)
class Limits:
    requests: int = 64  # interactive requests (embeddings, completions, chat) at once
    body_bytes: int = 256 * 1024**2  # bytes of JSON bodies being read and decoded at once
    tokens: int = 2_000_000  # tokens of interactive work at once (inputs and answers)
    largest_body: int = 64 * 1024**2  # one body without a Content-Length counts this; bytes


def tokens_of_texts(texts: Sequence[str], cap: int) -> int:
    """An upper bound on the tokens `texts` become, cut at `cap` tokens each, known before
    tokenizing: a token covers at least one character, plus two special tokens per text."""
    return sum(min(cap, len(t) + 2) for t in texts)


class Admission:
    """Requests, body bytes and tokens in progress, each under its limit."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.requests = 0
        self.body_bytes = 0
        self.tokens = 0

    @contextlib.contextmanager
    def reading(self, size: int) -> Iterator[None]:
        """While a body of `size` bytes is read and decoded."""
        if self.body_bytes and self.body_bytes + size > self.limits.body_bytes:
            raise TooBusy(
                f"{self.body_bytes} bytes of requests are being read (limit "
                f"{self.limits.body_bytes}); try again shortly"
            )
        self.body_bytes += size
        try:
            yield
        finally:
            self.body_bytes -= size

    @contextlib.contextmanager
    def working(self, tokens: int) -> Iterator[None]:
        """While an interactive request of at most `tokens` tokens of work runs. A request
        larger than the whole token limit runs only when nothing else does."""
        if self.requests >= self.limits.requests:
            raise TooBusy(
                f"{self.requests} embedding and completion requests are in progress "
                f"(limit {self.limits.requests}); try again shortly"
            )
        if self.tokens and self.tokens + tokens > self.limits.tokens:
            raise TooBusy(
                f"{self.tokens} tokens of work are in progress (limit {self.limits.tokens}); "
                f"try again shortly"
            )
        self.requests += 1
        self.tokens += tokens
        try:
            yield
        finally:
            self.requests -= 1
            self.tokens -= tokens
