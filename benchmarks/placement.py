"""Placement benchmark: speed on large swarms, gap to the exact optimum, gain over naive splits.

    python benchmarks/placement.py [--repeats 5]

Prints one JSON object:
    place_ms_50, place_ms_1000   placing an 80-block model (Llama-2 70B shapes) on 50 and 1000
                                 heterogeneous providers (median; targets <= 50 and <= 2000)
    replan_ms_1000               repairing that 1000-provider placement after a provider leaves
                                 (median over several leavers; target <= 20)
    gap_mean, gap_max            relative bottleneck gap to the exact MILP (HiGHS) on 200
                                 seeded instances of <= 6 providers and <= 24 blocks
                                 (target gap_max <= 0.05)
    vs_equal_split, vs_round_robin   throughput of our placement over an even split and over
                                 round-robin blocks, same 50-provider swarm, same run
    vs_petals_greedy             the same over a Petals-style greedy block filler (capacity
                                 model: the weakest block's total throughput)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from broker.core.placement import (
    PlacementConfig,
    PlacementError,
    equal_split,
    petals_greedy_throughput,
    place,
    round_robin_throughput,
)
from broker.core.replan import on_leave
from broker.exact import optimal_bottleneck
from broker.swarms import random_swarm
from dag.cost import Workload
from dag.model import LLAMA2_70B, ModelSpec

WORK = Workload(tokens=8, sequences=8, context=512, kv_tokens=4096)


def _timed(fn: Any, repeats: int) -> tuple[float, Any]:
    samples, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    args = parser.parse_args()
    config = PlacementConfig(work=WORK)
    result: dict[str, Any] = {"model": LLAMA2_70B.name, "blocks": LLAMA2_70B.n_layers}

    swarm50 = random_swarm(50, 1)
    result["place_ms_50"], placed50 = _timed(
        lambda: place(LLAMA2_70B, swarm50, config), args.repeats
    )
    swarm1000 = random_swarm(1000, 2)
    result["place_ms_1000"], placed = _timed(
        lambda: place(LLAMA2_70B, swarm1000, config), args.repeats
    )
    result["replicas_1000"] = len(placed.replicas)

    leavers = [
        rep.stages[len(rep.stages) // 2].provider
        for rep in placed.replicas[:: max(1, len(placed.replicas) // 10)]
    ]
    replan_ms = []
    for gone in leavers:
        alive = {k: v for k, v in swarm1000.items() if k != gone}
        start = time.perf_counter()
        on_leave(placed, gone, LLAMA2_70B, alive, config)
        replan_ms.append((time.perf_counter() - start) * 1e3)
    result["replan_ms_1000"] = round(statistics.median(replan_ms), 3)
    result["replan_ms_1000_max"] = round(max(replan_ms), 3)

    rng = random.Random(20261121)
    gaps = []
    for _ in range(200):
        model = ModelSpec.transformer(
            "m", hidden=rng.choice([1024, 2048, 4096]), layers=rng.randint(2, 24), heads=16
        )
        swarm = random_swarm(rng.randint(1, 6), rng.randrange(10**9))
        single = PlacementConfig(work=WORK, max_replicas=1)
        try:
            ours = place(model, swarm, single).replicas[0].bottleneck
        except PlacementError:
            continue
        gaps.append(ours / optimal_bottleneck(model, swarm, single) - 1)
    result["gap_instances"] = len(gaps)
    result["gap_mean"] = statistics.mean(gaps)
    result["gap_max"] = max(gaps)

    equal = equal_split(LLAMA2_70B, swarm50, config)
    robin = round_robin_throughput(LLAMA2_70B, swarm50, config)
    result["throughput_tokens_s_50"] = round(placed50.throughput, 1)
    result["vs_equal_split"] = round(placed50.throughput / equal.throughput, 2) if equal else None
    result["vs_round_robin"] = round(placed50.throughput / robin, 2) if robin else None
    petals = petals_greedy_throughput(LLAMA2_70B, swarm50, config)
    result["vs_petals_greedy"] = round(placed50.throughput / petals, 2) if petals else None
    for key in ("place_ms_50", "place_ms_1000"):
        result[key] = round(result[key], 2)
    result["targets_met"] = {
        "place_ms_50 <= 50": result["place_ms_50"] <= 50,
        "place_ms_1000 <= 2000": result["place_ms_1000"] <= 2000,
        "replan_ms_1000 <= 20": result["replan_ms_1000"] <= 20,
        "gap_max <= 0.05": result["gap_max"] <= 0.05,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
