"""Scenarios: one simulated run (`Scenario`), and scenario files (TOML): repeatable studies
of one or more runs and comparisons between them.

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

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from broker.core import CoreConfig
from broker.core.placement import PlacementConfig
from sim.catalog import CHURN, GPUS, NETWORKS, Churn, churn_with_mean
from sim.labscenario import SHIPPED, is_lab, read
from sim.workloads import WorkloadSpec, quantized, served, trained, workload

PLACEMENTS = ("ours", "equal", "petals")
QUEUE_POLICIES = ("fifo", "sjf-bsbf")


@dataclass(frozen=True)
class Scenario:
    name: str = "custom"
    peers: int = 50
    gpus: dict[str, float] = field(default_factory=lambda: {"rtx3080": 1.0})  # mix by weight
    network: str = "home-broadband"
    workload: str = "llama2-7b-inference"
    weights: str = "fp16"  # "fp16", or weight-only "int8"/"int4" blocks (inference)
    wire: str = "fp16"  # hidden states between stages: "fp16" or "int8" (per-token scales)
    # inference: decode steps "chained" (client -> stage 1 -> ... -> client) or "star" (to
    # each stage and back), and the sequences a step decodes together (None: the workload's)
    steps: str = "chained"
    batch: int | None = None
    # pre-training: the gradient exchange ("none" fp32, "fp16", "powersgd", "acp") at `rank`,
    # every `outer_every` local steps (DiLoCo when > 1), and the tokens the variant needs for
    # a synchronous token's progress: an assumption the study states (`sim.workloads.trained`)
    compress: str = "fp16"
    rank: int = 4
    outer_every: int = 1
    token_cost: float = 1.0
    hours: float = 1.0
    churn: Churn = field(default_factory=lambda: CHURN["none"])
    seed: int = 0
    # "ours" (the broker's decision core), "equal" (an even split over everyone, one
    # pipeline) or "petals" (servers pick their own blocks, Petals-style; inference only)
    placement: str = "ours"
    backup_fraction: float = 0.1  # share of providers kept as backups when possible
    crash_fraction: float = 0.5  # quits that are crashes (found by missed heartbeats)
    failover_s: float = 5.0  # seconds for a warm backup to start serving
    load_s: float = 10.0  # seconds to load a stage once its weights are local
    rebalance_every_s: float = 600.0  # how often the broker considers a full re-placement
    queue_policy: str = "fifo"  # the broker's job queue: "fifo" or "sjf-bsbf"
    energy_usd_per_kwh: float = 0.15  # electricity price
    rent_usd_per_gpu_hour: float = 0.0  # rental price (0 for contributed machines)
    sample_every_s: float = 60.0  # spacing of the time series in the result
    # the software's time at each end of a hop, and per byte (`fusionai sim calibrate`
    # measures them; `fusionai sim --calibration FILE` sets them): 0 leaves software free
    call_s: float = 0.0
    wire_s_per_byte: float = 0.0
    stage_call_s: float = 0.0  # one executor call's fixed time (measured on this machine)

    def __post_init__(self) -> None:
        unknown = [g for g in self.gpus if g not in GPUS]
        if unknown:
            raise ValueError(f"unknown GPUs {unknown}; known: {sorted(GPUS)}")
        if self.network not in NETWORKS:
            raise ValueError(f"unknown network {self.network!r}; known: {sorted(NETWORKS)}")
        if not (0 <= self.call_s < 1 and 0 <= self.stage_call_s < 1):
            raise ValueError("call_s and stage_call_s are 0 to 1 s")
        if not 0 <= self.wire_s_per_byte < 1e-3:
            raise ValueError("wire_s_per_byte is 0 to 1e-3 s")
        if self.peers < 1 or self.hours <= 0:
            raise ValueError("a scenario needs at least one peer and a positive duration")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}")
        kind = workload(self.workload).kind  # raises on an unknown workload
        _ = self.spec  # raises on a bad choice of weights, wire, steps, batch or compression
        if self.placement == "petals" and kind != "inference":
            raise ValueError("the Petals-style baseline serves inference workloads only")

    @property
    def spec(self) -> WorkloadSpec:
        """The workload as this run serves it (its weights' and wire's bytes, its steps' legs
        and batch, its gradient exchange)."""
        spec = quantized(workload(self.workload), self.weights, self.wire)
        spec = trained(spec, self.compress, self.rank, self.outer_every, self.token_cost)
        return served(spec, self.steps, self.batch)

    def core_config(self, work: PlacementConfig) -> CoreConfig:
        """The broker's settings for this scenario (the pool keeps the broker's defaults)."""
        return CoreConfig(
            placement=work,
            queue_policy=self.queue_policy,
            rebalance_every_s=self.rebalance_every_s,
        )


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
    path, doc = read(path)
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


def shipped(lab: bool = False) -> list[str]:
    """The shipped study files (`lab`: the lab scenarios, `sim.labscenario`, instead)."""
    return sorted(p.stem for p in SHIPPED.glob("*.toml") if is_lab(read(p)[1]) == lab)
