"""Fidelity benchmark: the simulator's predictions of the lab scenarios against the lab (root).

    python benchmarks/fidelity.py [--runs 3] [--scenario fidelity-latency ...]

Builds the demo decoder in 4 stages, calibrates (`fusionai sim calibrate --package`: round
trips through the p2p stack, this machine's profile, the package's calls timed in-process;
then `python -m lab link --calibration`: one of the lab's links, its delay's extra and rate),
then for each lab scenario runs it in the lab `--runs` times (`python -m lab scenario`) and
predicts its figures (`fusionai sim --scenario`); the compute-bound one from the two
providers' CPU read again before each of its lab runs but the first, which the calibration's
own reading stands for (their medians). Prints one JSON object:
per scenario, each headline figure predicted, measured (median, with its [min, max]) and the
relative error; `max_error` and `median_error` over all of them (targets: <= 0.15 and <=
0.07); the placement contrast (`contrast`: the latency scenario run again with the broker's
`--placement even`, one pipeline split evenly over every provider; the simulator predicts its
throughput at less than half of the decision core's placement, and the lab's ratio must agree
in sign and within 15 %); and the `paper-claim` scenario's throughput ratios with the
calibration and without. Without root the lab cannot run: it says so and skips.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The compute-bound scenario first, nearest the calibration: its figures follow the providers'
# CPU per token, which on a shared machine drifts by tens of percent within minutes (the
# same provider read 3.75 and 2.85 ms a token in two lab runs eleven minutes apart; one
# run's own three lab runs were 23 % apart). So its providers' CPU is read again before each
# of its lab runs, and it is predicted from the median of those readings: both sample the
# same minutes. (Its first run follows the calibration at once: the calibration's own reading
# stands for it.)
SCENARIOS = ("fidelity-compute", "fidelity-latency", "fidelity-bandwidth", "fidelity-churn")
INTERLEAVED = ("fidelity-compute",)
CONTRAST = "fidelity-latency"  # run again with an even split: the placements' ratio
CONTRAST_FIGURE = "throughput_tokens_s"


def paper_ratios(calibration: Path | None) -> dict[str, float]:
    from sim.calibration import load
    from sim.report import study_json
    from sim.scenario import load_study
    from sim.swarm import simulate

    study = load_study("paper-claim")
    runs = study.runs
    if calibration is not None:
        cal = load(calibration)
        runs = [cal.apply(r) for r in runs]
    results = {run.name: simulate(run) for run in runs}
    doc = study_json(study, results)
    return {c["name"]: c["throughput_ratio"] for c in doc["comparisons"]}


def contrast(
    ours: tuple[dict[str, Any], dict[str, Any]],
    package: Path,
    cal_path: Path,
    runs: int | None,
    work: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The contrast scenario with an even split: its figures predicted and measured, and the
    two placements' ratio (ours over even) of `CONTRAST_FIGURE` on both sides. It agrees when
    the simulator predicts a difference of at least 25 %, and the lab's ratio is on the same
    side of 1 and within 15 % of the predicted one."""
    import msgspec

    from cli.sim_lab import compare, prediction, table
    from lab.scenario import run
    from sim.labscenario import load

    s = load(CONTRAST)
    even = msgspec.structs.replace(s, lab=msgspec.structs.replace(s.lab, placement="even"))
    sim = prediction(even, package, cal_path)
    lab = run(even, package, "story-llama", runs or s.lab.runs, say, cal_path)
    (work / f"{CONTRAST}-even.lab.json").write_text(json.dumps(lab, indent=1))
    c = compare(sim, lab)
    say(table(c).replace(CONTRAST, f"{CONTRAST} (even split)", 1))
    key = CONTRAST_FIGURE
    predicted = ours[0]["figures"][key] / sim["figures"][key]
    measured = ours[1]["figures"][key] / lab["figures"][key]
    off = measured / predicted - 1
    agrees = abs(predicted - 1) >= 0.25 and (predicted > 1) == (measured > 1) and abs(off) <= 0.15
    say(
        f"{CONTRAST}: {key} ours over an even split: predicted {predicted:.3f}, measured "
        f"{measured:.3f} ({100 * off:+.1f} %): {'agrees' if agrees else 'DOES NOT AGREE'}"
    )
    return {
        "scenario": CONTRAST,
        "figure": key,
        "predicted_ratio": round(predicted, 4),
        "measured_ratio": round(measured, 4),
        "ratio_error": round(off, 4),
        "agrees": agrees,
        "even": c,
    }


def rereader(
    package: Path, readings: list[dict[str, Any]], first: dict[str, Any] | None = None
) -> Callable[[int], object]:
    """Called before each lab run: the two providers' CPU read again into `readings`
    (`split_costs`, as `fusionai sim calibrate --package` reads them); before the first,
    `first` instead where given (the calibration's own reading, just taken)."""
    from cli.calibrate_providers import split_costs
    from lab.scenario import _machine_profile

    profile = _machine_profile().encode()

    def read(i: int) -> None:
        readings.append(
            first if i == 0 and first is not None else split_costs(package, profile, "ort")
        )

    return read


def interleaved(calibration: Path, readings: list[dict[str, Any]], out: Path) -> Path:
    """`calibration` with its two providers' CPU the median of `readings` (read between a
    scenario's lab runs: `sim.calibration.with_split_readings`), saved at `out`;
    `calibration` itself where there are none."""
    from sim.calibration import load, save, with_split_readings

    cal = load(calibration)
    merged = with_split_readings(cal, readings)
    if merged is cal:  # (nothing read)
        return calibration
    save(merged, out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="lab runs (default: each's)")
    parser.add_argument("--scenario", action="append", help="only these (repeatable)")
    parser.add_argument("--work", help="keep the package, calibration and results here")
    args = parser.parse_args()
    from lab.net import LabError, missing

    why = missing()
    if why:
        print(json.dumps({"skipped": f"the lab cannot run here: {why}"}))
        return 0
    import msgspec

    from cli.demo_models import build_decoder
    from cli.sim_calibrate import calibrate
    from cli.sim_lab import compare, prediction, table
    from lab.scenario import run
    from lab.topology import link_reading
    from sim.calibration import Calibration, save, split_reading, with_link_reading
    from sim.labscenario import load

    work = Path(args.work or tempfile.mkdtemp(prefix="fusionai-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    package = build_decoder(work / "story-llama-4", 4)
    cal_path = work / "calibration.json"
    measured = calibrate(400, 4, "ort", package)
    assert isinstance(measured, Calibration)
    cal = with_link_reading(measured, *link_reading())
    save(cal, cal_path)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    out: dict[str, object] = {"calibration": msgspec.to_builtins(cal)}
    errors: list[float] = []
    rows = {}
    ours: tuple[dict[str, Any], dict[str, Any]] | None = None  # the contrast's, as placed
    order = args.scenario or SCENARIOS
    own = split_reading(cal)
    for name in order:
        s = load(name)
        readings: list[dict[str, Any]] = []
        # (the first scenario's first run follows the calibration: its reading stands)
        first = own if name == order[0] else None
        before = rereader(package, readings, first) if name in INTERLEAVED else None
        t = time.monotonic()
        try:
            lab = run(s, package, "story-llama", args.runs or s.lab.runs, say, cal_path,
                      before=before)  # fmt: skip
        except LabError as exc:  # (the others still run; the targets are then not met)
            say(f"{name}: the lab run failed: {exc}")
            rows[name] = {"error": str(exc)}
            errors.append(float("inf"))
            continue
        used = interleaved(cal_path, readings, work / f"calibration-{name}.json")
        sim = prediction(s, package, used)
        (work / f"{name}.lab.json").write_text(json.dumps(lab, indent=1))
        c = compare(sim, lab)
        say(table(c))
        c["lab_s"] = round(time.monotonic() - t, 1)
        rows[name] = c
        errors += [abs(r["error"]) for r in c["rows"] if r["error"] is not None]
        if name == CONTRAST:
            ours = (sim, lab)
    errors.sort()
    out["scenarios"] = rows
    if ours is not None:
        try:
            out["contrast"] = contrast(ours, package, cal_path, args.runs, work, say)
        except LabError as exc:
            say(f"{CONTRAST} with an even split: the lab run failed: {exc}")
            out["contrast"] = {"error": str(exc), "agrees": False}
    whole = bool(errors) and errors[-1] != float("inf")  # (a scenario that failed: none)
    out["max_error"] = round(errors[-1], 4) if whole else None
    out["median_error"] = round(errors[len(errors) // 2], 4) if whole else None
    out["targets_met"] = {
        "max_error <= 0.15": bool(errors) and errors[-1] <= 0.15,
        "median_error <= 0.07": bool(errors) and errors[len(errors) // 2] <= 0.07,
    }
    if "contrast" in out:
        out["targets_met"]["placement ratio agrees"] = bool(out["contrast"]["agrees"])  # type: ignore[index]
    out["paper_ratios_uncalibrated"] = paper_ratios(None)
    out["paper_ratios_calibrated"] = paper_ratios(cal_path)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
