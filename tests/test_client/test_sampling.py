"""Sampling the next token: the nucleus without sorting the vocabulary, the draw, and the
picks of concurrent sessions made together off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import client.stepmux
from client.sampling import Sampler, nucleus
from client.stepmux import StepMux

Array = np.ndarray[Any, Any]


def _softmax(logits: Array, temperature: float) -> Array:
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def _sorted_head(p: Array, top_p: float) -> Array:
    """The nucleus as a stable sort of the whole vocabulary gives it (the reference)."""
    order = np.argsort(-p, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]


def test_the_nucleus_is_the_head_of_a_sort_of_the_whole_vocabulary() -> None:
    """Peaked, flat, tied (rounded logits, all equal) and partly impossible (probabilities
    that underflow to 0) distributions: the same tokens in the same order, to the last bit
    of their sums, for nuclei from one token to nearly all."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        vocab = int(rng.choice([2, 7, 100, 5000]))
        kind = trial % 4
        if kind == 0:
            logits = rng.standard_normal(vocab) * rng.uniform(0.1, 10)
        elif kind == 1:
            logits = np.round(rng.standard_normal(vocab) * 2)
        elif kind == 2:
            logits = np.zeros(vocab)
        else:
            logits = np.where(rng.random(vocab) < 0.5, -1e4, rng.standard_normal(vocab))
        p = _softmax(logits, rng.uniform(0.05, 2.0))
        for top_p in (0.01, 0.5, 0.9, 0.999, 1 - 1e-12):
            got, want = nucleus(p, top_p), _sorted_head(p, top_p)
            want = want[p[want] > 0]  # (impossible tokens add nothing; none is drawn)
            assert np.array_equal(got, want), (trial, top_p, len(got), len(want))


def test_tokens_are_drawn_from_the_nucleus_at_its_probabilities_and_repeat_with_a_seed() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.06, 0.04]))
    sampler = Sampler(1.0, 0.85, seed=3)  # the nucleus: the first three tokens (0.9)
    draws = np.bincount([sampler.pick(logits) for _ in range(20_000)], minlength=5)
    assert draws[3] == draws[4] == 0
    expected = np.array([0.5, 0.25, 0.15]) / 0.9
    assert np.abs(draws[:3] / draws.sum() - expected).max() < 0.015, draws
    again = [Sampler(0.7, 0.9, seed=11) for _ in range(2)]
    big = np.random.default_rng(1).standard_normal(32_000) * 4
    assert [again[0].pick(big) for _ in range(20)] == [again[1].pick(big) for _ in range(20)]
    assert Sampler(0.0).pick(big) == Sampler(0.5, 0.0).pick(big) == int(np.argmax(big))
    masked = np.array([0.0, -np.inf, 1.0, -np.inf])  # (tokens ruled out: never drawn)
    assert {Sampler(1.0, 0.99, seed=s).pick(masked) for s in range(50)} == {0, 2}
    for bad in (np.array([1.0, np.nan, 0.0]), np.array([1.0, np.inf, 0.0])):
        with pytest.raises(ValueError, match="NaN or infinity"):
            Sampler(1.0, 0.9, seed=0).pick(bad)


async def test_concurrent_sessions_picks_run_together_each_as_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Picks asked for in one turn of the event loop run as one batch, in a worker thread
    (or on the loop once a run is known to be quick); each session's token is what its own
    sampler gives alone, a row whose logits cannot be sampled fails alone, and a greedy pick
    is made at once."""
    mux = StepMux(None)  # type: ignore[arg-type]  # (no steps sent: no host needed)
    rng = np.random.default_rng(5)
    logits = [rng.standard_normal(50_000) * 3 for _ in range(6)]
    seeds = list(range(6))

    def samplers() -> list[Sampler]:
        return [Sampler(0.8, 0.95, seed=s) for s in seeds]

    alone = samplers()
    want = [[s.pick(x) for _ in range(3)] for s, x in zip(alone, logits, strict=True)]
    together = samplers()
    runs = 0
    real_picks = client.stepmux._picks

    def counted(rows: Any) -> list[Any]:
        nonlocal runs
        runs += 1
        return real_picks(rows)

    monkeypatch.setattr(client.stepmux, "_picks", counted)
    monkeypatch.setattr(client.stepmux, "INLINE_S", 0.0)  # (no run is short enough)
    got: list[list[int]] = [[] for _ in seeds]
    for _ in range(3):
        tokens = await asyncio.gather(
            *(mux.sample(s, x) for s, x in zip(together, logits, strict=True))
        )
        for row, token in zip(got, tokens, strict=True):
            row.append(token)
    assert got == want
    assert runs == 3 and mux.inline == 0  # a run a turn, each in a thread

    nan = np.full(50_000, np.nan)
    results = await asyncio.gather(
        mux.sample(Sampler(0.8, 0.95, seed=0), nan),
        mux.sample(Sampler(0.8, 0.95, seed=0), logits[0]),
        return_exceptions=True,
    )
    assert isinstance(results[0], ValueError) and results[1] == want[0][0]
    assert runs == 4
    assert await mux.sample(Sampler(0.0), logits[2]) == int(np.argmax(logits[2]))
    assert runs == 4  # (greedy: no run)
    monkeypatch.setattr(client.stepmux, "INLINE_S", 10.0)  # (every timed run is short)
    assert await mux.sample(Sampler(0.8, 0.95, seed=1), logits[1]) == want[1][0]
    assert mux.inline == 1
