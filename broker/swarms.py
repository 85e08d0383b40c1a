"""Seeded generators of heterogeneous provider swarms, for tests, benchmarks and the simulator.

Figures are rounded published specs (dense fp16 tensor FLOP/s without sparsity, memory size and
bandwidth) of consumer GPUs and one CPU-only machine, with home upload links.
"""

from __future__ import annotations

import random

from dag.cost import HardwareProfile

# name: (fp16 FLOP/s, memory bytes, memory bandwidth bytes/s)
CONSUMER = {
    "rtx3060": (51e12, 12e9, 360e9),
    "rtx3080": (119e12, 10e9, 760e9),
    "rtx3090": (142e12, 24e9, 936e9),
    "rtx4090": (330e12, 24e9, 1008e9),
    "cpu-32gb": (1.5e12, 32e9, 50e9),
}
UPLINKS = (12.5e6, 25e6, 50e6, 125e6)  # 100 Mbit/s to 1 Gbit/s, in bytes/s


def random_swarm(
    n: int, seed: int, kinds: dict[str, tuple[float, float, float]] | None = None
) -> dict[str, HardwareProfile]:
    """`n` providers drawn from `kinds` (default: CONSUMER), in join order."""
    rng = random.Random(seed)
    kinds = kinds or CONSUMER
    swarm = {}
    for i in range(n):
        name = rng.choice(sorted(kinds))
        flops, memory, bandwidth = kinds[name]
        swarm[f"{name}-{i}"] = HardwareProfile(
            name,
            {"float16": flops},
            memory,
            bandwidth,
            rng.choice(UPLINKS),
            rtt=rng.uniform(0.01, 0.1),
        )
    return swarm
