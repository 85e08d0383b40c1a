"""Generated tokens to text, piece by piece, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PREFIX_TOKENS = 4  # prompt tokens decoded ahead of the answer (see TextStream)


class TextStream:
    """Turns tokens into text as they come. It holds back an unfinished UTF-8 character and
    any tail that may be the start of a stop string; once a stop string appears, the text ends
    just before it and `stopped` is set.

    The answer is decoded after the last few prompt tokens (`prefix`), and their text is cut
    off again: decoders such as SentencePiece's drop a leading space at the start of a text,
    which would glue the answer's first word to the prompt."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), prefix: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.prefix = list(prefix)[-PREFIX_TOKENS:]
        self.prefix_text = self._decode(self.prefix) if self.prefix else ""
        self.tokens: list[int] = []
        self.text = ""  # all text so far (up to a stop string)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text

    def _answer(self) -> str:
        if not self.prefix:
            return self._decode(self.tokens)
        full = self._decode(self.prefix + self.tokens)
        if full.startswith(self.prefix_text):
            return full[len(self.prefix_text) :]
        return self._decode(self.tokens)

    def push(self, token: int) -> str:
        """Add a token; returns the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        return self._update(final=False)

    def finish(self) -> str:
        """The rest of the text, held back until now."""
        if self.stopped:
            return ""
        return self._update(final=True)

    def _update(self, final: bool) -> str:
        text = self._answer()
        if text.endswith("\ufffd") and not final:  # part of a character: wait for the rest
            return ""
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(cut)
        self.text = text
        hold = 0 if final else max((_overlap(text, s) for s in self.stop), default=0)
        return self._take(len(text) - hold)

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
