"""`fusionai sim`: simulate a swarm, or run a scenario file, and write a report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(sub: Any, dispatch: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a swarm on a virtual clock (or run a scenario file)",
        description="Simulate a swarm of providers on a virtual clock with the broker's own "
        "placement, pool and re-plan code. Give --scenario for a study file (or the name of "
        "a shipped one: see --list), or describe one run with the options below.",
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=["calibrate"],
        help="calibrate: measure the simulator's constants on this machine (round trips "
        "through the p2p stack, the hardware profile) into --out (default calibration.json)",
    )
    p.add_argument("--scenario", help="a TOML scenario file, or a shipped scenario's name")
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="use the software's costs per hop measured by `fusionai sim calibrate`",
    )
    p.add_argument("--count", type=int, default=400, help="calibrate: small round trips")
    p.add_argument("--mib", type=int, default=4, help="calibrate: the large payload, MiB")
    p.add_argument("--executor", choices=["ort", "torch"], help="calibrate: profile this one")
    p.add_argument(
        "--package",
        metavar="DIR",
        help="calibrate: also time this package's calls; a lab scenario: the package it serves",
    )
    p.add_argument(
        "--compare",
        metavar="LAB_JSON",
        help="a lab scenario: compare the prediction with the lab's result (`python -m lab "
        "scenario`), print each figure's relative error and write --plot",
    )
    p.add_argument("--plot", metavar="PNG", help="with --compare: the plot (default: beside it)")
    p.add_argument("--list", action="store_true", help="list the shipped scenarios and exit")
    p.add_argument(
        "--queue-study",
        action="store_true",
        help="compare FIFO and SJF-BSBF queueing on a seeded job trace and exit",
    )
    p.add_argument(
        "--replay",
        metavar="TRACE",
        help="replay a broker's recorded decisions (`fusionai broker start --trace`, .gz too) "
        "through the simulator's driver; exit 1 if any decision differs",
    )
    p.add_argument("--peers", type=int, default=50, help="providers (default 50)")
    p.add_argument(
        "--gpu",
        action="append",
        default=None,
        help="GPU type, repeatable, NAME or NAME:WEIGHT for a mix (default rtx3080)",
    )
    p.add_argument(
        "--network", default="home-broadband", help="network preset (default home-broadband)"
    )
    p.add_argument(
        "--workload", default="llama2-7b-inference", help="<model>-<inference|finetune|pretrain>"
    )
    p.add_argument("--hours", type=float, default=1.0, help="simulated hours (default 1)")
    p.add_argument(
        "--churn",
        default="none",
        help="mean session in minutes, or a preset (none, volunteer, gaming-evening); default none",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--placement", choices=["ours", "equal", "petals"], default="ours", help="placement policy"
    )
    p.add_argument("--backup-fraction", type=float, default=0.1, help="share kept as backups")
    p.add_argument(
        "--queue", choices=["fifo", "sjf-bsbf"], default="fifo", help="the broker's job queue"
    )
    p.add_argument("--out", help="folder for result.json, report.txt and timeline.png")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.set_defaults(func=dispatch)


def _single(args: argparse.Namespace) -> Any:
    from sim.scenario import Study, churn_of, scenario_from

    churn: Any = args.churn
    try:
        churn = float(churn)
    except ValueError:
        pass
    gpus: dict[str, float] = {}
    for item in args.gpu or ["rtx3080"]:
        name, _, weight = item.partition(":")
        gpus[name] = float(weight) if weight else 1.0
    churn_of(churn)  # validate early, with its own message
    scenario = scenario_from(
        {
            "name": f"{args.peers}x{'+'.join(gpus)}/{args.workload}",
            "peers": args.peers,
            "gpus": gpus,
            "network": args.network,
            "workload": args.workload,
            "hours": args.hours,
            "churn": churn,
            "seed": args.seed,
            "placement": args.placement,
            "backup_fraction": args.backup_fraction,
            "queue_policy": args.queue,
        }
    )
    return Study(scenario.name, "", [scenario], [])


def run(args: argparse.Namespace) -> int:
    from sim import report
    from sim.scenario import load_study, shipped
    from sim.swarm import simulate

    if args.action == "calibrate":
        from cli import sim_calibrate

        if args.out is None:
            args.out = "calibration.json"
        return sim_calibrate.run(args)
    if args.list:
        for name in shipped():
            print(name)
        for name in shipped(lab=True):
            print(f"{name}  (a lab scenario: --package, --calibration, --compare)")
        return 0
    if args.queue_study:
        from sim import queue_study

        print(json.dumps(queue_study.run(seed=args.seed), indent=2))
        return 0
    if args.replay:
        from sim.driver import replay_file

        try:
            result = replay_file(Path(args.replay))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(result.summary(), indent=2))
        return 1 if result.mismatches else 0
    if args.scenario:
        from cli import sim_lab

        if sim_lab.is_lab_scenario(args.scenario):
            return sim_lab.run(args)
    try:
        study = load_study(args.scenario) if args.scenario else _single(args)
        if args.calibration:
            from sim.calibration import load

            calibration = load(args.calibration)
            study.runs[:] = [calibration.apply(r) for r in study.runs]
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = {}
    tty = sys.stderr.isatty()
    for i, scenario in enumerate(study.runs):
        label = f"[{i + 1}/{len(study.runs)}] {scenario.name}"

        logged = [0]  # quarters of this run already logged

        def progress(fraction: float, label: str = label, logged: list[int] = logged) -> None:
            if not tty:  # a log, not a terminal: a line every quarter of the run
                quarter = int(fraction * 4)
                if quarter > logged[0] and fraction < 1.0:
                    logged[0] = quarter
                    sys.stderr.write(f"{label}: {quarter * 25}%\n")
                return
            filled = int(fraction * 30)
            sys.stderr.write(f"\r{label:48} [{'#' * filled}{'.' * (30 - filled)}] {fraction:4.0%}")
            sys.stderr.flush()

        started = time.monotonic()
        results[scenario.name] = simulate(scenario, progress)
        progress(1.0)
        if tty:
            sys.stderr.write("\n")
        else:
            sys.stderr.write(f"{label}: 100% in {time.monotonic() - started:.1f} s\n")
    if args.out:
        doc = report.write(Path(args.out), study, results)
    else:
        doc = report.study_json(study, results)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(report.text_report(doc), end="")
        if args.out:
            print(f"\nwrote {Path(args.out) / 'result.json'}, report.txt and timeline.png")
    return 0
