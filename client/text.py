"""Generated tokens to text, piece by piece, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Turns tokens into text as they come. It holds back an unfinished UTF-8 character and
    any tail that may be the start of a stop string; once a stop string appears, the text ends
    just before it and `stopped` is set."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # all text so far (up to a stop string)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; returns the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # part of a character: wait for the rest
            return ""
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(cut)
        self.text = text
        hold = max((_overlap(text, s) for s in self.stop), default=0)
        return self._take(len(text) - hold)

    def finish(self) -> str:
        """The rest of the text, held back until now."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        piece = self.text[self.sent : max(self.sent, upto)]
        self.sent += len(piece)
        return piece


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
