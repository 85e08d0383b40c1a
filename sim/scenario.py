"""Scenario files (TOML): repeatable studies of one or more runs and comparisons between them.

name = "paper-claim"
[defaults]                      # applied to every run
hours = 1
[[run]]
name = "swarm/inference"
peers = 50
gpus = { rtx3080 = 1 }
network = "home-broadband"
workload = "llama2-7b-inference"
churn = "none"                  # a preset name, or a mean session in minutes
[[compare]]
name = "inference"
numerator = "swarm/inference"
denominator = "datacenter/inference"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sim.catalog import CHURN, Churn, churn_with_mean
from sim.swarm import Scenario

SHIPPED = Path(__file__).parent / "scenarios"


@dataclass(frozen=True)
class Comparison:
    name: str
    numerator: str
    denominator: str
    note: str = ""


@dataclass(frozen=True)
class Study:
    name: str
    description: str
    runs: list[Scenario]
    comparisons: list[Comparison]


def churn_of(value: Any) -> Churn:
    if isinstance(value, str):
        if value not in CHURN:
            raise ValueError(f"unknown churn preset {value!r}; known: {sorted(CHURN)}")
        return CHURN[value]
    if isinstance(value, int | float) and value > 0:
        return churn_with_mean(float(value))
    raise ValueError(f"churn must be a preset name or a mean session in minutes, got {value!r}")


def scenario_from(values: dict[str, Any]) -> Scenario:
    allowed = {f.name for f in fields(Scenario)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"unknown scenario keys {unknown}; allowed: {sorted(allowed)}")
    values = dict(values)
    if "churn" in values:
        values["churn"] = churn_of(values["churn"])
    if "gpus" in values:
        values["gpus"] = {str(k): float(v) for k, v in values["gpus"].items()}
    return Scenario(**values)


def load_study(path: Path | str) -> Study:
    """Read a scenario file; a bare name means one shipped in `sim/scenarios/`."""
    path = Path(path)
    if not path.exists() and (SHIPPED / f"{path}.toml").exists():
        path = SHIPPED / f"{path}.toml"
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read scenario file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    defaults = doc.get("defaults", {})
    runs = []
    for i, run in enumerate(doc.get("run", [])):
        try:
            runs.append(scenario_from({**defaults, **run}))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: run {i + 1} ({run.get('name', 'unnamed')}): {exc}") from None
    names = {r.name for r in runs}
    if len(names) != len(runs):
        raise ValueError(f"{path}: run names must be unique")
    comparisons = []
    for c in doc.get("compare", []):
        comparison = Comparison(c["name"], c["numerator"], c["denominator"], c.get("note", ""))
        missing = {comparison.numerator, comparison.denominator} - names
        if missing:
            raise ValueError(
                f"{path}: comparison {comparison.name} names unknown runs {sorted(missing)}"
            )
        comparisons.append(comparison)
    if not runs:
        raise ValueError(f"{path} defines no [[run]]")
    return Study(doc.get("name", path.stem), doc.get("description", ""), runs, comparisons)


def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.toml"))
