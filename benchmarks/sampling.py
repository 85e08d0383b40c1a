"""Sampling benchmark: picking a token with a temperature and nucleus (top-p) cut over real
vocabulary sizes, against sorting the whole vocabulary (how the cut was made before); and how
long sixteen sessions' picks hold the event loop, one by one on it against together in a
worker thread (`client.stepmux.StepMux.sample`). Same run, alternated.

    python benchmarks/sampling.py [--picks 40] [--rounds 3]

Logits are random normal times 3 (flatter than a trained model's, so nuclei are larger:
hundreds to tens of thousands of tokens). Prints one JSON object:
    cases            a list of {vocab, temperature, top_p, ms_pick, ms_full_sort, ratio} (the
                     median pick's milliseconds over `--rounds` rounds; ratio = pick over full
                     sort: below 1 is faster)
    loop_ms_16       sixteen sessions' picks (151,936 tokens, temperature 0.7, top-p 0.9): the
                     event loop's longest stretch without a turn, with the same picks made on
                     the loop one by one (as before: each session picked its own) and through
                     `StepMux.sample` (in a worker thread, which still holds the interpreter
                     between numpy's calls)
    ratio_151936     the 151,936-token, temperature 0.7, top-p 0.9 case's ratio (target <= 0.3)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from client.sampling import Sampler  # noqa: E402
from client.stepmux import StepMux  # noqa: E402

Array = np.ndarray[Any, Any]
CASES = [(32_000, 0.7, 0.9), (32_000, 1.0, 0.95), (151_936, 0.7, 0.9), (151_936, 1.0, 0.95)]


def full_sort_pick(sampler: Sampler, logits: Array) -> int:
    """The pick as it was made before: the whole vocabulary sorted for the nucleus."""
    z = np.asarray(logits, dtype=np.float64) / sampler.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order]), sampler.top_p)) + 1
    cut = np.zeros_like(p)
    cut[order[:keep]] = p[order[:keep]]
    return int(sampler.rng.choice(len(p), p=cut / cut.sum()))


def timed(pick: Any, sampler: Sampler, logits: Array, picks: int) -> float:
    times = []
    for _ in range(picks):
        start = time.perf_counter()
        pick(sampler, logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def longest_stall(sixteen: list[Array], together: bool, steps: int) -> float:
    """The longest the event loop went without a turn while sixteen sessions picked `steps`
    tokens each, milliseconds."""
    loop = asyncio.get_running_loop()
    mux = StepMux(None)  # type: ignore[arg-type]  # (no steps sent: no host needed)
    samplers = [Sampler(0.7, 0.9, seed=i) for i in range(len(sixteen))]
    longest, last, done = 0.0, loop.time(), False

    async def ticker() -> None:
        nonlocal longest, last
        while not done:
            await asyncio.sleep(0)
            now = loop.time()
            longest, last = max(longest, now - last), now

    async def session(sampler: Sampler, logits: Array) -> None:
        for _ in range(steps):
            if together:
                await mux.sample(sampler, logits)
            else:
                sampler.pick(logits)
                await asyncio.sleep(0)  # (a step's network wait)

    tick = asyncio.ensure_future(ticker())
    await asyncio.gather(*(session(s, x) for s, x in zip(samplers, sixteen, strict=True)))
    done = True
    await tick
    return longest * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--picks", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = []
    for vocab, temperature, top_p in CASES:
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        new, old = [], []
        for r in range(args.rounds):  # (alternated, either first in turn)
            order = [(Sampler.pick, new), (full_sort_pick, old)]
            for pick, out in order if r % 2 == 0 else order[::-1]:
                sampler = Sampler(temperature, top_p, seed=r)
                out.append(timed(pick, sampler, logits, args.picks))
        ms_pick, ms_full = statistics.median(new), statistics.median(old)
        cases.append(
            {
                "vocab": vocab, "temperature": temperature, "top_p": top_p,
                "ms_pick": round(ms_pick, 3), "ms_full_sort": round(ms_full, 3),
                "ratio": round(ms_pick / ms_full, 3),
            }
        )  # fmt: skip
    sixteen = [(rng.standard_normal(151_936) * 3).astype(np.float32) for _ in range(16)]
    stalls: dict[str, list[float]] = {"one_by_one_on_the_loop": [], "together_in_a_thread": []}
    for r in range(args.rounds):
        for together in (False, True) if r % 2 == 0 else (True, False):
            key = "together_in_a_thread" if together else "one_by_one_on_the_loop"
            stalls[key].append(asyncio.run(longest_stall(sixteen, together, 4)))
    out = {
        "cases": cases,
        "loop_ms_16": {k: round(statistics.median(v), 2) for k, v in stalls.items()},
        "ratio_151936": next(c["ratio"] for c in cases if c["vocab"] == 151_936),
    }
    out["targets_met"] = {"ratio_151936 <= 0.3": out["ratio_151936"] <= 0.3}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
