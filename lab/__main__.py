"""`python -m lab up|run|down|status`: the home-internet lab from the shell (as root).

python -m lab up --kinds cone,symmetric,upnp --rate 20 --delay 25   # prints its layout
python -m lab run h1 -- python -m cli.main provider start --broker ...
python -m lab down            # this lab (the last one brought up); --all: every fl* one
python -m lab scenario fidelity-latency --package DIR --out lab.json   # a lab scenario, run
python -m lab link [--calibration cal.json]   # one access link measured (into the calibration)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lab.net import LabError, missing, namespaces, remove
from lab.topology import KINDS, Lab

STATE = Path("/run/fusionai-lab.json")  # the layout of the lab brought up last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab and leave it up")
    up.add_argument("--kinds", default=",".join(KINDS), help="router kinds, one per home")
    up.add_argument("--rate", type=float, default=20.0, help="access links, Mbit/s each way")
    up.add_argument("--delay", type=float, default=25.0, help="access links, ms one way")
    run = sub.add_parser("run", help="run a command in a lab namespace (a role: h1, r1, broker)")
    run.add_argument("role")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="tear the lab down")
    down.add_argument("--all", action="store_true", help="every fl* namespace, of any run")
    sub.add_parser("status", help="the lab brought up last, and every fl* namespace")
    sc = sub.add_parser("scenario", help="run a lab scenario (sim/scenarios) for real")
    sc.add_argument("scenario", help="a scenario file with a [lab] table, or a shipped name")
    sc.add_argument("--package", required=True, help="the model package it serves")
    sc.add_argument("--runs", type=int, help="runs (default: the scenario's)")
    sc.add_argument(
        "--calibration", help="providers' profiles from this `fusionai sim calibrate` file "
        "(default: measured here once)",
    )  # fmt: skip
    sc.add_argument("--keep", action="store_true", help="keep each run's folder and logs")
    sc.add_argument("--out", help="write the result (JSON) here; default: print it")
    ln = sub.add_parser("link", help="measure one access link: its delay's extra, its rate")
    ln.add_argument(
        "--calibration", help="add the reading to this `fusionai sim calibrate` file "
        "(`link_extra_s`, `link_rate_factor`: the lab's predictions use them)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    lab = Lab(kinds=args.kinds.split(","), rate_mbit=args.rate, delay_ms=args.delay)
    try:
        lab.up()
    except BaseException:
        lab.down()
        raise
    layout = {
        "run": lab.run_id,
        "namespaces": lab.names,
        "broker": {"ns": lab.broker, "ip": "203.0.113.10"},
        "homes": [
            {"kind": h.kind, "router": h.router, "host": h.host, "wan_ip": h.wan_ip,
             "host_ip": h.host_ip}
            for h in lab.homes
        ],
    }  # fmt: skip
    STATE.write_text(json.dumps(layout, indent=1))
    print(json.dumps(layout, indent=1))
    return 0


def _scenario(args: argparse.Namespace) -> int:
    from lab.scenario import run
    from sim.labscenario import load

    try:
        scenario = load(args.scenario)
        manifest = json.loads((Path(args.package) / "manifest.json").read_text())
    except (ValueError, OSError) as exc:
        raise LabError(str(exc)) from None
    stages = sum(1 for st in manifest["stages"] if st.get("placement") == "provider")
    if stages != scenario.lab.stages:
        raise LabError(f"the scenario wants {scenario.lab.stages} stages; the package has {stages}")
    runs = args.runs or scenario.lab.runs
    if not 1 <= runs <= 9:
        raise LabError("--runs is 1 to 9")
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cal = Path(args.calibration) if args.calibration else None
    result = run(scenario, Path(args.package), manifest["name"], runs, say, cal, args.keep)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


def _link(args: argparse.Namespace) -> int:
    from lab.topology import link_reading
    from sim.calibration import load, save, with_link_reading

    cal = None
    if args.calibration:  # (read before the lab is built: a bad file fails at once)
        try:
            cal = load(args.calibration)
        except ValueError as exc:
            raise LabError(str(exc)) from None
    extra, rate = link_reading()
    print(json.dumps({"link_extra_s": extra, "link_rate_factor": rate}))
    if cal is not None:
        save(with_link_reading(cal, extra, rate), args.calibration)
    return 0


def _layout() -> dict[str, object]:
    if not STATE.is_file():
        raise LabError("no lab is up (python -m lab up)")
    layout: dict[str, object] = json.loads(STATE.read_text())
    return layout


def _run(args: argparse.Namespace) -> int:
    layout = _layout()
    ns = f"fl{layout['run']}-{args.role}"
    if ns not in namespaces():
        raise LabError(f"no namespace {ns} (roles: inet, broker, relay, r1, h1, ...)")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise LabError("give a command after the role")
    os.execvp("ip", ["ip", "netns", "exec", ns, *cmd])
    return 127  # (not reached)


def _down(args: argparse.Namespace) -> int:
    layout = {} if args.all else _layout()
    names = namespaces() if args.all else [str(n) for n in layout["namespaces"]]  # type: ignore[attr-defined]
    remove(names)
    STATE.unlink(missing_ok=True)
    print(f"removed {len(names)} namespaces")
    return 0


def _status(args: argparse.Namespace) -> int:
    why = missing()
    print(f"lab: {'cannot run here: ' + why if why else 'can run here'}")
    if STATE.is_file():
        print(STATE.read_text())
    print("namespaces:", " ".join(namespaces()) or "none")
    return 0


COMMANDS = {
    "scenario": _scenario,
    "link": _link,
    "up": _up,
    "run": _run,
    "down": _down,
    "status": _status,
}

if __name__ == "__main__":
    sys.exit(main())
