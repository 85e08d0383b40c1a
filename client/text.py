"""Generated tokens to text, piece by piece, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

PREFIX_TOKENS = 4  # prompt tokens decoded ahead of the answer (see TextStream)
HOLD_TOKENS = 4  # tokens a piece waits at most for the rest of a character (UTF-8: 4 bytes)


class TextStream:
    """Turns tokens into text as they come. It holds back an unfinished UTF-8 character and
    any tail that may be the start of a stop string; once a stop string appears, the text ends
    just before it and `stopped` is set.

    The tokenizers library's `DecodeStream` decodes each token in a short window after the
    tokens before it, whose text it cuts off again (a token's text can depend on its
    neighbours: SentencePiece's decoder drops a text's leading space), starting after the
    last few prompt tokens (`prefix`). Decoding everything so far at each token, as this
    class once did, cost a long answer time in proportion to its length at every token
    (2,000 tokens: 1.3 ms a token here). A piece whose text ends in an unfinished character
    waits for the next token, at most `HOLD_TOKENS` of them: a character's bytes end within
    4 tokens even of one byte each, so past that they are not valid UTF-8 and go out
    replaced, as decoding everything would have replaced them."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), prefix: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self._recent: list[int] = list(prefix)[-PREFIX_TOKENS:]  # the last tokens
        self._stream = DecodeStream(list(self._recent), skip_special_tokens=True)
        self._held = 0  # the last tokens, whose text has not come out yet
        self.text = ""  # all text so far (up to a stop string)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; returns the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self._recent.append(token)
        del self._recent[: -(PREFIX_TOKENS + HOLD_TOKENS)]
        try:
            piece = self._stream.step(self.tokenizer, token)
        except Exception:  # (the library refuses a window that decodes otherwise than the
            self._held += 1  # one before it did: this token's text as it is, then afresh)
            piece = self._release()
        if piece is None:
            self._held += 1
            if self._held < HOLD_TOKENS:
                return ""
            piece = self._release()
        self._held = 0
        return self._update(piece, final=False)

    def finish(self) -> str:
        """The rest of the text, held back until now."""
        if self.stopped:
            return ""
        return self._update(self._release() if self._held else "", final=True)

    def _release(self) -> str:
        """The held tokens' text as it is (its unfinished character replaced); the stream
        starts again after them."""
        held = self._recent[-self._held :]
        before = self._recent[: -self._held][-PREFIX_TOKENS:]
        seen = self._decode(before)
        window = self._decode(before + held)
        self._stream = DecodeStream(self._recent[-PREFIX_TOKENS:], skip_special_tokens=True)
        self._held = 0
        return window[len(seen) :] if window.startswith(seen) else self._decode(held)

    def _decode(self, tokens: list[int]) -> str:
        text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text

    def _update(self, piece: str, final: bool) -> str:
        before = len(self.text)
        self.text += piece
        since = max(0, before - self._longest + 1)  # (a stop string may end in the new piece)
        cut = min((i for i in (self.text.find(s, since) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._take(cut)
        hold = 0 if final else max((_overlap(self.text, s) for s in self.stop), default=0)
        return self._take(len(self.text) - hold)

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
