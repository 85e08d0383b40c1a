"""Queueing study: FIFO against SJF-BSBF on a seeded trace of jobs sharing a GPU cluster.

Runs the broker's own `broker.core.queue` policies and schedule (no second implementation).
"""

from __future__ import annotations

import random
from typing import Any

from broker.core.queue import Fifo, Job, SjfBsbf, mean_completion, schedule


def trace(n: int, gpus: int, seed: int) -> list[Job]:
    """Jobs arriving as a Poisson process, with heavy-tailed durations (a few long ones)."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1 / 60.0)  # a job a minute on average
        duration = min(8 * 3600.0, rng.lognormvariate(6.5, 1.3))  # median ~11 min
        need = rng.choice([g for g in (1, 2, 4, 8) if g <= gpus])
        jobs.append(Job(f"j{i}", t, need, duration, share_slowdown=rng.uniform(1.3, 1.9)))
    return jobs


def run(n: int = 200, gpus: int = 16, seed: int = 0) -> dict[str, Any]:
    jobs = trace(n, gpus, seed)
    result: dict[str, Any] = {"jobs": n, "gpus": gpus, "seed": seed}
    for policy in (Fifo(), SjfBsbf()):
        done = schedule(jobs, gpus, policy)
        result[f"{policy.name}_mean_completion_s"] = round(mean_completion(jobs, done), 1)
    result["sjf_bsbf_over_fifo"] = round(
        result["sjf-bsbf_mean_completion_s"] / result["fifo_mean_completion_s"], 3
    )
    return result
