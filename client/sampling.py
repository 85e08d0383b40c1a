"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


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

    def pick(self, logits: Array) -> int:
        if self.temperature < 1e-4 or self.top_p == 0.0:
            return int(np.argmax(logits))
        z = np.asarray(logits, dtype=np.float64) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")  # (a full sort: vocabularies are ~1e5)
            keep = int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1
            cut = np.zeros_like(p)
            cut[order[:keep]] = p[order[:keep]]
            p = cut / cut.sum()
        return int(self.rng.choice(len(p), p=p))
