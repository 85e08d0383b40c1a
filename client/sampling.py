"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]
FIRST_CUT = 1 / 16  # the nucleus is looked for first among tokens this likely against the
NEXT_CUT = 1 / 4  # likeliest, then each time among tokens this much less likely


class Sampler:
    """`temperature` 0 (or below 1e-4) is greedy (argmax), and so is `top_p` 0; otherwise
    softmax(logits / temperature), cut to the smallest set of tokens whose probability reaches
    `top_p`. A `seed` makes it repeatable."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None):
        if not 0.0 <= temperature <= 100.0:
            raise ValueError("temperature must be from 0 to 100")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError("top_p must be from 0 to 1")
        self.temperature = temperature
        self.top_p = top_p
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        """Whether it picks the likeliest token (an argmax: microseconds, whatever the
        vocabulary)."""
        return self.temperature < 1e-4 or self.top_p == 0.0

    def pick(self, logits: Array) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        z = np.asarray(logits, dtype=np.float64) / self.temperature
        with np.errstate(invalid="ignore"):  # (inf - inf: NaN, refused below)
            p = np.exp(z - z.max())
        total = p.sum()
        if not np.isfinite(total):
            raise ValueError("the logits hold NaN or infinity: no token can be sampled")
        p /= total
        if self.top_p < 1.0:  # (drawn among the nucleus only: the rest have no chance)
            kept = nucleus(p, self.top_p)
            q = p[kept]
            return int(kept[self.rng.choice(len(kept), p=q / q.sum())])
        return int(self.rng.choice(len(p), p=p))


def nucleus(p: Array, top_p: float) -> Array:
    """The smallest set of tokens whose probabilities `p` reach `top_p`, likeliest first (ties
    in token order): the head of a stable sort of the whole vocabulary, without sorting it
    (13.6 ms at 151,936 tokens here). The tokens at least as likely as some bound are a head
    of that order, ties included, so sorting only them gives its first sums to the last bit;
    the bound starts at a sixteenth of the likeliest token's probability and falls until the
    head's sums reach `top_p`."""
    cut, likely = p.max() * FIRST_CUT, np.count_nonzero(p)
    while True:
        head = np.flatnonzero(p >= cut) if cut > 0 else np.flatnonzero(p)
        whole = len(head) == likely  # (every token that has a chance: the others add nothing)
        if whole or p[head].sum() >= top_p:
            order = head[np.argsort(-p[head], kind="stable")]
            sums = np.cumsum(p[order])
            if whole or sums[-1] >= top_p:  # (the sorted sums decide, to the last bit)
                return order[: int(np.searchsorted(sums, top_p)) + 1]
        cut *= NEXT_CUT
