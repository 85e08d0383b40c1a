"""Lab scenarios: a swarm small enough to build for real, in one format the simulator
(`fusionai sim --scenario F`) and the home-internet lab's runner (`python -m lab scenario F`)
both run, so their figures can be compared (`fusionai sim --compare`).

A scenario file is a study file (`sim/scenarios/*.toml`) with a `[lab]` table:

    name = "fidelity-latency"
    [lab]
    stages = 4                        # provider stages of the package it serves
    placement = "ours"                # the broker's: "ours", or "even" (one pipeline split
                                      # evenly over every provider, the baseline)
    client = { rate_mbit = 50, delay_ms = 5, nat = "cone" }
    [[lab.provider]]                  # at least one; each in its own home
    name = "a"
    nat = "upnp"                      # its router: cone, symmetric or upnp
    cpu = 0.3                         # cores it may use (a CPU quota; at most 1.2 together)
    threads = 1                       # executor threads
    rate_mbit = 20                    # its access link, each way
    delay_ms = 25                     # and one-way latency
    [lab.workload]
    sessions = 2                      # generations running at once, one client each
    rounds = 3                        # generations each client runs, one after another
    prompt_words = 8                  # words of the demo corpus the prompt takes
    output_tokens = 24
    [[lab.event]]                     # churn at given times (seconds after the load starts)
    at_s = 3.0
    provider = "b"                    # a provider by name, or instead `stage = 1`: the one
    action = "kill"                   # serving that stage (1: the first); kill or freeze

Every figure is validated here, for both sides: nothing else reads the `[lab]` table.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

# the clients' prompt: its first `prompt_words` words (the demo decoder learned this text)
PROMPT = (
    "A broker keeps a pool of providers that join and leave at will, with a backup pool that "
    "takes over when one quits. Models travel as ONNX, so one job can span machines with "
    "different GPUs and runtimes. The client runs the tokenizer, the embedding and the head; "
    "providers run the blocks and keep the cache."
)
MAX_CPU = 1.2  # cores all providers' quotas may take together (the rest: broker, client, links)
# The lab grants a provider its quota in slices of this much CPU (the kernel's least): a burst
# of work runs the first slice at full speed, then at the provider's share (measured here with
# busy loops of 4 to 24 ms at 0.15, 0.3 and 0.45 of a core: within 5 to 25 % of that)
QUOTA_SLICE_S = 0.001

Name = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9-]{0,15}$")]
Mbit = Annotated[float, msgspec.Meta(ge=0.1, le=1000)]
Delay = Annotated[float, msgspec.Meta(ge=0, le=500)]


class Link(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rate_mbit: Mbit = 20.0
    delay_ms: Delay = 25.0
    nat: Literal["cone", "symmetric", "upnp"] = "cone"

    @property
    def bytes_s(self) -> float:
        return self.rate_mbit * 1e6 / 8


class LabProvider(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    cpu: Annotated[float, msgspec.Meta(ge=0.05, le=1.2)] = 0.3
    threads: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1
    rate_mbit: Mbit = 20.0
    delay_ms: Delay = 25.0
    nat: Literal["cone", "symmetric", "upnp"] = "upnp"
    # its provider's `--max-memory` (GiB): what the broker places on it (None: 2, room for
    # every stage of the lab's packages)
    memory_gib: Annotated[float, msgspec.Meta(gt=0, le=1024)] | None = None

    @property
    def link(self) -> Link:
        return Link(self.rate_mbit, self.delay_ms, self.nat)

    @property
    def max_memory_gib(self) -> float:
        """Its provider's `--max-memory`."""
        return 2.0 if self.memory_gib is None else self.memory_gib

    @property
    def memory_bytes(self) -> int:
        return int(self.max_memory_gib * 1024**3)

    @property
    def share(self) -> float:
        """What its quota and threads leave it of the machine's measured compute (the
        profile both the simulator and the lab's providers are given)."""
        return min(self.cpu, float(self.threads))


class LabWorkload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Literal["generate"] = "generate"
    sessions: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    rounds: Annotated[int, msgspec.Meta(ge=1, le=50)] = 1
    prompt_words: Annotated[int, msgspec.Meta(ge=1, le=60)] = 8
    output_tokens: Annotated[int, msgspec.Meta(ge=1, le=200)] = 24
    step_timeout_s: Annotated[float, msgspec.Meta(ge=0.5, le=60)] = 5.0  # a client's deadline


class LabEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    at_s: Annotated[float, msgspec.Meta(ge=0, le=600)]
    action: Literal["kill", "freeze"]  # SIGKILL, or SIGSTOP (it stops answering)
    provider: Name | None = None
    # or the provider serving this stage (1-based, of the package's provider stages): where
    # the placement ties (two alike in either order), a name would hit either role
    stage: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None

    def victim(self, serving: list[str]) -> str:
        """The provider it hits, given who serves each stage (in order)."""
        if self.provider is not None:
            return self.provider
        assert self.stage is not None  # (`check`)
        return serving[self.stage - 1]


class LabSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    provider: list[LabProvider]
    stages: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    client: Link = Link(50.0, 5.0, "cone")
    workload: LabWorkload = LabWorkload()
    event: list[LabEvent] = []
    heartbeat_s: Annotated[float, msgspec.Meta(ge=0.2, le=10)] = 1.0
    batch_window_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 2.0  # the providers' own
    placement: Literal["ours", "even"] = "ours"  # the broker's (`fusionai broker --placement`)
    runs: Annotated[int, msgspec.Meta(ge=1, le=9)] = 3  # lab runs whose median is reported


class LabScenario(msgspec.Struct, frozen=True):
    name: str
    description: str
    lab: LabSpec


def prompt(words: int) -> str:
    return " ".join(PROMPT.split()[:words])


def check(scenario: LabScenario) -> LabScenario:
    """What the types cannot say: unique names, the quota budget, events naming providers."""
    names = [p.name for p in scenario.lab.provider]
    if not names:
        raise ValueError(f"{scenario.name}: a lab scenario needs at least one [[lab.provider]]")
    if len(set(names)) != len(names):
        raise ValueError(f"{scenario.name}: provider names must be unique")
    total = sum(p.cpu for p in scenario.lab.provider)
    if total > MAX_CPU + 1e-9:
        raise ValueError(
            f"{scenario.name}: providers' cpu quotas add up to {total:.2f} cores; at most "
            f"{MAX_CPU} (the broker, the clients and the links need the rest)"
        )
    for e in scenario.lab.event:
        if (e.provider is None) == (e.stage is None):
            raise ValueError(f"{scenario.name}: event at {e.at_s} s needs a provider or a stage")
        if e.provider is not None and e.provider not in names:
            raise ValueError(
                f"{scenario.name}: event at {e.at_s} s names no provider {e.provider!r}"
            )
        if e.stage is not None and e.stage > scenario.lab.stages:
            raise ValueError(
                f"{scenario.name}: event at {e.at_s} s names stage {e.stage} of "
                f"{scenario.lab.stages}"
            )
    return scenario


def is_lab(doc: dict[str, object]) -> bool:
    return "lab" in doc


def parse(doc: dict[str, object], where: str) -> LabScenario:
    try:
        scenario = msgspec.convert(
            {
                "name": doc.get("name", Path(where).stem),
                "description": doc.get("description", ""),
                "lab": doc["lab"],
            },
            LabScenario,
        )
    except msgspec.ValidationError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return check(scenario)


SHIPPED = Path(__file__).parent / "scenarios"


def read(path: Path | str) -> tuple[Path, dict[str, Any]]:
    """A scenario file (a study or a lab scenario) as TOML: (its path, its document); a bare
    name means one shipped in `sim/scenarios/`. A clear `ValueError` otherwise."""
    path = Path(path)
    if not path.exists() and (SHIPPED / f"{path}.toml").exists():
        path = SHIPPED / f"{path}.toml"
    try:
        return path, tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read scenario file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None


def load(path: Path | str) -> LabScenario:
    """A lab scenario file; a bare name means one shipped in `sim/scenarios/`."""
    path, doc = read(path)
    if not is_lab(doc):
        raise ValueError(f"{path} has no [lab] table: it is not a lab scenario")
    return parse(doc, str(path))


# ---- the result both sides write --------------------------------------------------------

# figures of one run, and the headline ones `--compare` bounds
FIGURES = (
    "throughput_tokens_s",
    "ttft_ms_p50",
    "token_ms_p50",
    "token_ms_p90",
    "generation_s_p50",
    "failover_stall_ms",
)
HEADLINE = ("throughput_tokens_s", "token_ms_p50", "ttft_ms_p50", "failover_stall_ms")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(generations: list[dict[str, Any]], sessions: int) -> dict[str, float | None]:
    """One run's figures from its generations (`python -m client.load`'s lines, `sessions`
    clients at once): tokens per second while generating (each client's tokens over its
    generations' time, from the request to the last token, summed over clients), time to
    first token, gaps between tokens (p50, p90: without the gaps failovers fell in), a
    generation's time, and the median failover stall (None without failovers)."""
    if not generations:
        raise ValueError("no generation completed")
    gaps, stalls, ttft, took = [], [], [], []
    for g in generations:
        own = list(g["gaps_s"])
        for f in g["failovers"]:
            if f.get("stall_s") is not None:
                stalls.append(f["stall_s"])
                if f["stall_s"] in own:
                    own.remove(f["stall_s"])
        gaps += own
        ttft.append(g["ttft_s"])
        took.append(g["ttft_s"] + sum(g["gaps_s"]))
    tokens = sum(g["tokens"] for g in generations)
    span = sum(took) / sessions

    def ms(v: float | None) -> float | None:
        return None if v is None else round(1e3 * v, 3)

    return {
        "throughput_tokens_s": round(tokens / span, 3) if span > 0 else None,
        "ttft_ms_p50": ms(percentile(ttft, 0.5)),
        "token_ms_p50": ms(percentile(gaps, 0.5)),
        "token_ms_p90": ms(percentile(gaps, 0.9)),
        "generation_s_p50": round(percentile(took, 0.5) or 0.0, 4),
        "failover_stall_ms": ms(percentile(stalls, 0.5)),
    }


def summarize(runs: list[dict[str, float | None]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the median of each figure over runs, its [min, max]); None where no run had it."""
    median: dict[str, Any] = {}
    spread: dict[str, Any] = {}
    for key in FIGURES:
        values = sorted(v for r in runs if (v := r.get(key)) is not None)
        if not values:
            median[key] = spread[key] = None
            continue
        mid = len(values) // 2
        median[key] = (
            values[mid] if len(values) % 2 else round((values[mid - 1] + values[mid]) / 2, 4)
        )
        spread[key] = [values[0], values[-1]]
    return median, spread
