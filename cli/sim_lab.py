"""`fusionai sim --scenario F` on a lab scenario (a file with a `[lab]` table): the
simulator's prediction of what `python -m lab scenario F` measures, and with `--compare
LAB_JSON` both side by side with each figure's relative error, and a plot.

    fusionai sim calibrate --package DIR --out cal.json
    fusionai sim --scenario fidelity-latency --package DIR --calibration cal.json --out sim.json
    fusionai sim --scenario fidelity-latency --package DIR --calibration cal.json \\
        --compare lab.json [--plot cmp.png]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from sim.labscenario import HEADLINE, LabScenario


def is_lab_scenario(name: str) -> bool:
    from sim.labscenario import is_lab, read

    try:
        return is_lab(read(name)[1])
    except ValueError:
        return False  # the study loader says what is wrong


def prediction(s: LabScenario, package: Path, calibration: Path) -> dict[str, Any]:
    from broker.config import BrokerConfig
    from broker.models import model_spec
    from ir.manifest import ModelManifest
    from sim.calibration import load
    from sim.labpredict import predict
    from sim.labscenario import prompt

    try:
        manifest = ModelManifest.from_json((package / "manifest.json").read_bytes())
    except OSError as exc:
        raise ValueError(f"{package} is not a model package: {exc.strerror}") from None
    indices = [st.index for st in manifest.stages if st.placement == "provider"]
    if len(indices) != s.lab.stages:
        raise ValueError(f"{s.name} wants {s.lab.stages} stages; {package} has {len(indices)}")
    cal = load(calibration)
    if cal.package is not None and cal.package.model != manifest.name:
        raise ValueError(f"{calibration} timed {cal.package.model}, not {manifest.name}")
    # (as the lab's broker runs: it trusts the providers' profiles, `lab.scenario`)
    core = BrokerConfig(
        data_dir=Path("."),
        heartbeat_s=s.lab.heartbeat_s,
        trust_claims=True,
        placement=s.lab.placement,
    ).core
    ids, generated = _lengths(
        package, prompt(s.lab.workload.prompt_words), s.lab.workload.output_tokens
    )
    return predict(s, manifest.name, model_spec(manifest), indices, cal, core, ids, generated)


def _lengths(package: Path, text: str, most: int) -> tuple[int, int]:
    """(the prompt's tokens, the tokens a greedy generation of at most `most` gives: it ends
    at the model's end of sequence), from the package run here."""
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    stages = ClientStages(package)
    ids = stages.tokenizer.encode(text).ids
    pkg = load_package(package)
    executors = [OrtExecutor(pkg.models[st.index]) for st in pkg.manifest.stages]
    tokens = LocalPipeline(pkg.manifest, executors).generate_greedy(ids, most)  # (new ones)
    if stages.eos in tokens:
        tokens = tokens[: tokens.index(stages.eos) + 1]
    return len(ids), len(tokens)


def error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def compare(sim: dict[str, Any], lab: dict[str, Any]) -> dict[str, Any]:
    """Each headline figure: predicted, measured (median, [min, max]) and relative error;
    the largest and the median absolute error over the figures both have."""
    rows = []
    for key in HEADLINE:
        p, m = sim["figures"].get(key), lab["figures"].get(key)
        rows.append(
            {"figure": key, "predicted": p, "measured": m, "spread": lab["spread"].get(key),
             "error": None if (e := error(p, m)) is None else round(e, 4)}
        )  # fmt: skip
    errors = sorted(abs(r["error"]) for r in rows if r["error"] is not None)
    return {
        "scenario": sim["scenario"],
        "rows": rows,
        "max_error": round(errors[-1], 4) if errors else None,
        "median_error": round(errors[len(errors) // 2], 4) if errors else None,
        "placement_same": sim["placement"] == lab["placement"],
        "placement_stability": sim.get("placement_stability"),
        "placement": {"sim": sim["placement"], "lab": lab["placement"]},
    }


def table(c: dict[str, Any]) -> str:
    lines = [f"{c['scenario']}: predicted against measured (median of the lab's runs)"]
    lines.append(f"{'figure':22} {'predicted':>11} {'measured':>11} {'spread':>21} {'error':>8}")
    for r in c["rows"]:
        spread = "" if not r["spread"] else f"{r['spread'][0]:g} .. {r['spread'][1]:g}"
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
        lines.append(
            f"{r['figure']:22} {fmt(r['predicted']):>11} {fmt(r['measured']):>11} "
            f"{spread:>21} {err:>8}"
        )
    lines.append(f"max_error {c['max_error']}  median_error {c['median_error']}  placement "
                 f"{'the same' if c['placement_same'] else 'differs'}")  # fmt: skip
    if (stable := c.get("placement_stability")) is not None:
        doubt = "" if stable >= 0.9 else ": the lab's broker may choose another"
        lines.append(f"the predicted route and split hold in {100 * stable:.0f} % of placements on "
                     f"profiles off by the lab's measurement noise{doubt}")  # fmt: skip
    return "\n".join(lines)


def plot(c: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in c["rows"] if r["predicted"] is not None and r["measured"] is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["predicted"] for r in rows], 0.4, label="simulator")
    measured = [r["measured"] for r in rows]
    low = [m - r["spread"][0] if r["spread"] else 0 for m, r in zip(measured, rows, strict=True)]
    high = [r["spread"][1] - m if r["spread"] else 0 for m, r in zip(measured, rows, strict=True)]
    ax.bar([x + 0.2 for x in xs], measured, 0.4, yerr=[low, high], label="lab (median, range)")
    ax.set_xticks(list(xs), [r["figure"] for r in rows], rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_title(f"{c['scenario']}: max error {100 * (c['max_error'] or 0):.1f}%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from sim.labscenario import load

    if not args.package or not args.calibration:
        print("error: a lab scenario needs --package DIR and --calibration FILE (`fusionai sim "
              "calibrate --package DIR`)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        s = load(args.scenario)
        sim = prediction(s, Path(args.package), Path(args.calibration))
        lab = None
        if args.compare:
            lab = json.loads(Path(args.compare).read_text())
            if not isinstance(lab, dict) or lab.get("scenario") != s.name or "figures" not in lab:
                raise ValueError(f"{args.compare} is not a lab result of {s.name}")
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if lab is None:
        text = json.dumps(sim, indent=1)
        if args.out:
            Path(args.out).write_text(text + "\n")
        else:
            print(text)
        return 0
    c = compare(sim, lab)
    print(table(c))
    png = Path(args.plot) if args.plot else Path(args.compare).with_suffix(".png")
    plot(c, png)
    print(f"plot: {png}")
    if args.out:
        Path(args.out).write_text(json.dumps(c, indent=1) + "\n")
    return 0 if all(r["error"] is None or math.isfinite(r["error"]) for r in c["rows"]) else 1
