"""Simulator benchmark: wall time to simulate swarms, and the paper's headline ratio.

    python benchmarks/simulator.py

Prints one JSON object:
    sim_s_50     wall seconds to simulate 1 hour of 50 mixed consumer GPUs with churn
                 (one-hour mean sessions), Llama-2 13B inference (target <= 5)
    sim_s_1000   the same with 1000 peers (target <= 60)
    paper_ratio  simulated throughput of 50 x RTX 3080 over 4 x H100 in the shipped
                 `paper-claim` scenario (its first comparison: 7B inference, home broadband);
                 `paper_ratios` lists every comparison of that scenario
"""

from __future__ import annotations

import json
import time
from typing import Any

from sim.catalog import CHURN
from sim.report import study_json
from sim.scenario import Scenario, load_study
from sim.swarm import simulate

MIX = {"rtx3060": 1.0, "rtx3080": 1.0, "rtx3090": 1.0, "rtx4090": 1.0}


def timed(scenario: Scenario) -> tuple[float, Any]:
    start = time.perf_counter()
    result = simulate(scenario)
    return time.perf_counter() - start, result


def main() -> int:
    out: dict[str, Any] = {}
    for peers in (50, 1000):
        scenario = Scenario(
            name=f"bench-{peers}",
            peers=peers,
            gpus=MIX,
            workload="llama2-13b-inference",
            churn=CHURN["volunteer"],
            hours=1.0,
            seed=1,
        )
        seconds, result = timed(scenario)
        out[f"sim_s_{peers}"] = round(seconds, 3)
        out[f"events_{peers}"] = result.events_run
        out[f"quits_{peers}"] = result.quits
        out[f"throughput_tokens_s_{peers}"] = round(result.throughput_tokens_s, 1)
    study = load_study("paper-claim")
    results = {run.name: simulate(run) for run in study.runs}
    doc = study_json(study, results)
    out["paper_ratios"] = {c["name"]: c["throughput_ratio"] for c in doc["comparisons"]}
    out["paper_ratio"] = doc["comparisons"][0]["throughput_ratio"]
    out["targets_met"] = {
        "sim_s_50 <= 5": out["sim_s_50"] <= 5,
        "sim_s_1000 <= 60": out["sim_s_1000"] <= 60,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
