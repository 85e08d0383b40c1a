"""Results of simulation runs as JSON, a short text report, and PNG plots (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.catalog import GPUS, NETWORKS
from sim.result import SimResult
from sim.scenario import Scenario, Study
from sim.workloads import LOW_RANK, WEIGHT_BYTES, WorkloadSpec


def assumptions(scenario: Scenario) -> dict[str, Any]:
    """The figures that drive a run's result, as the report states them."""
    w = scenario.spec
    gpus = {
        name: {
            "fp16_tflops": GPUS[name].fp16_tensor / 1e12,
            "memory_gb": GPUS[name].memory / 1e9,
            "mem_bandwidth_gb_s": GPUS[name].mem_bandwidth / 1e9,
            "source": GPUS[name].source,
        }
        for name in scenario.gpus
    }
    net = NETWORKS[scenario.network]
    return {
        "gpus": gpus,
        "network": {
            "name": net.name,
            "upload_mbit_s_median": net.up_median * 8 / 1e6,
            "download_mbit_s_median": net.down_median * 8 / 1e6,
            "rtt_ms": net.rtt * 1e3,
            "source": net.source,
            # the software's time at each end of a hop (`--calibration`; 0: not charged)
            "hop_end_ms": scenario.call_s * 1e3 if net.p2p else 0.0,
            "hop_end_ns_per_byte": scenario.wire_s_per_byte * 1e9 if net.p2p else 0.0,
            "stage_call_ms": scenario.stage_call_s * 1e3 if net.p2p else 0.0,
        },
        "workload": {
            "name": w.name,
            "tokens_per_microbatch": w.work.tokens,
            "sequences_per_microbatch": w.work.sequences,
            "context": w.work.context,
            "prompt_tokens": w.prompt_tokens,
            "microbatches_per_job": w.microbatches,
            "weights": scenario.weights,
            "bytes_per_weight": WEIGHT_BYTES[scenario.weights],
            "block_weight_gb": w.model.layer_param_bytes / 1e9,
            "wire": scenario.wire,
            "steps": scenario.steps,
            "hidden_bytes_per_token": w.model.hidden_bytes_per_token,
            "compute_dtype": "fp16 (weights de-quantized in the kernel; KV cache fp16)",
            **(_exchange(w) if w.kind == "pretrain" else {}),
        },
        "churn": {
            "name": scenario.churn.name,
            "mean_session_min": scenario.churn.mean_session / 60,
            "mean_offline_min": scenario.churn.mean_offline / 60,
            "departure_fraction": scenario.churn.departure_fraction,
            "arrivals_per_peer_hour": scenario.churn.arrivals_per_peer_hour,
        },
    }


def _exchange(w: WorkloadSpec) -> dict[str, Any]:
    """Pre-training's gradient exchange, per replica and optimizer step."""
    return {
        "compress": w.compress,
        "rank": w.rank if w.compress in LOW_RANK else None,
        "outer_every": w.outer_every,
        "exchange_gb_per_step": w.allreduce_bytes_per_block() * w.model.n_layers / 1e9,
        "compress_tflop_per_step": w.compress_flops_per_block() * w.model.n_layers / 1e12,
        "token_cost": w.token_cost,
    }


def study_json(study: Study, results: dict[str, SimResult]) -> dict[str, Any]:
    runs = {
        name: {**r.summary(), "assumptions": assumptions(r.scenario)} for name, r in results.items()
    }
    comparisons = []
    for c in study.comparisons:
        a, b = results[c.numerator], results[c.denominator]
        ratio = (
            a.throughput_tokens_s / b.throughput_tokens_s if b.throughput_tokens_s else float("inf")
        )
        comparisons.append(
            {
                "name": c.name,
                "numerator": c.numerator,
                "denominator": c.denominator,
                "throughput_ratio": round(ratio, 4),
                "comparable": ratio >= 0.5,
                "note": c.note,
            }
        )
    return {
        "study": study.name,
        "description": study.description.strip(),
        "runs": runs,
        "comparisons": comparisons,
    }


def _num(value: float | None, spec: str) -> str:
    """A figure, or a dash of the same width where it is undefined."""
    if value is None:
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 1)
        return "-".rjust(width)
    return format(value, spec)


def text_report(doc: dict[str, Any]) -> str:
    lines = [f"# {doc['study']}", ""]
    if doc.get("description"):
        lines += [doc["description"], ""]
    lines.append(
        f"{'run':32} {'tokens/s':>11} {'ttft s':>7} {'util':>6} {'lost':>6} {'quits':>5} "
        f"{'$/Mtok':>8}"
    )
    for name, r in doc["runs"].items():
        lines.append(
            f"{name:32} {_num(r['throughput_tokens_s'], '11.1f')} "
            f"{_num(r['ttft_ms_p50'] and r['ttft_ms_p50'] / 1e3, '7.2f')} "
            f"{_num(r['utilization'], '6.2f')} "
            f"{_num(r['time_lost_to_churn'], '6.2%')} {r['quits']:5d} "
            f"{_num(r['cost_per_mtok_usd'], '8.3f')}"
        )
    if doc["comparisons"]:
        lines += ["", "Throughput ratios ('comparable' here means at least half):"]
        for c in doc["comparisons"]:
            verdict = "comparable" if c["comparable"] else "not comparable"
            lines.append(f"  {c['name']:58} {c['throughput_ratio']:8.3f}  {verdict}")
    lines += ["", "Assumptions that drive these figures (every run's are in the JSON):"]
    seen: set[str] = set()
    for r in doc["runs"].values():
        a = r["assumptions"]
        for name, g in a["gpus"].items():
            if name not in seen:
                seen.add(name)
                lines.append(
                    f"  {name}: {g['fp16_tflops']:.1f} TFLOP/s fp16, {g['memory_gb']:.0f} GB at "
                    f"{g['mem_bandwidth_gb_s']:.0f} GB/s ({g['source']})"
                )
        net = a["network"]
        if net["name"] not in seen:
            seen.add(net["name"])
            lines.append(
                f"  {net['name']}: upload {net['upload_mbit_s_median']:.0f} Mbit/s, download "
                f"{net['download_mbit_s_median']:.0f} Mbit/s, RTT {net['rtt_ms']:.2f} ms "
                f"({net['source']})"
            )
        w = a["workload"]
        if w["name"] not in seen:
            seen.add(w["name"])
            lines.append(
                f"  {w['name']}: {w['sequences_per_microbatch']} sequences x "
                f"{w['tokens_per_microbatch'] // max(1, w['sequences_per_microbatch'])} tokens per "
                f"microbatch, context {w['context']}"
                + (f", prompts of {w['prompt_tokens']} tokens" if w["prompt_tokens"] else "")
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, SimResult], path: Path) -> None:
    """Throughput and serving replicas over time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, r in results.items():
        times = [t / 3600 for t, _, _, _ in r.timeline]
        top.plot(times, [rate for _, rate, _, _ in r.timeline], label=name)
        bottom.plot(times, [n for _, _, n, _ in r.timeline], label=name)
    top.set_ylabel("tokens / s")
    top.set_yscale("log")
    bottom.set_ylabel("serving replicas")
    bottom.set_xlabel("hours")
    top.legend(fontsize=7, loc="lower right")
    top.grid(True, alpha=0.3)
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, study: Study, results: dict[str, SimResult]) -> dict[str, Any]:
    """Write result.json, report.txt and timeline.png into `out`; returns the JSON document."""
    out.mkdir(parents=True, exist_ok=True)
    doc = study_json(study, results)
    (out / "result.json").write_text(json.dumps(doc, indent=2))
    (out / "report.txt").write_text(text_report(doc))
    plot(results, out / "timeline.png")
    return doc
