"""Where the broker puts a lab scenario's model (`sim.fidelity` predicts the rest from it):
the decision core told of each provider joining, with the profile the broker would see (the
calibrated machine's FLOP/s times the provider's CPU share, its memory limit, its access
link, the round trip it would measure), then of the model; and how sure that placement is
against what the broker's measurements vary by from run to run (`stability`)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.core import CoreConfig
from broker.core.actions import AssignStage
from broker.core.events import ModelAdded, ProviderJoined
from dag.cost import HardwareProfile
from dag.model import ModelSpec
from sim.calibration import Calibration, quota_factor
from sim.driver import Driver
from sim.labscenario import QUOTA_SLICE_S, LabProvider, LabScenario

# How much what the lab's broker measures of a provider varies from run to run (its `seen`:
# uplinks at 100 Mbit/s read 108 to 122, at 50 read 51 to 53; round trips 8.4 to 14.5 ms
# against 8 to 14 predicted): the spread `stability` tries placements over.
UPLINK_NOISE, RTT_NOISE = 0.06, 0.2
STABILITY_TRIALS = 100


@dataclass(frozen=True)
class Placed:
    stage: int  # manifest index
    provider: str
    backup: str | None


def paced(work: float, share: float) -> float:
    """The wall time of `work` CPU seconds run at once under a quota of `share` cores: the
    first slice at full speed, the rest at the share."""
    if share >= 1 or work <= QUOTA_SLICE_S:
        return work
    return QUOTA_SLICE_S + (work - QUOTA_SLICE_S) / share


def hardware(p: LabProvider, cal: Calibration) -> HardwareProfile:
    """What the broker sees of `p`: the calibrated executor at `p`'s CPU share, its memory
    limit, and the round trip `p` measures to the broker (a ping: the link's delay both
    ways, the broker's two message ends, and `p`'s two at its quota's pace)."""
    share, cpu = p.share, min(p.cpu, 1.0)
    costs = cal.provider_costs()
    end = cal.call_s if costs is None else costs[1] * quota_factor(costs[2], cpu)
    own = paced(2 * end, cpu)
    return HardwareProfile(
        name=p.name,
        flops={k: v * share for k, v in cal.profile.flops.items()},
        memory_bytes=float(p.memory_bytes),
        mem_bandwidth=cal.profile.mem_bandwidth * share,
        net_bandwidth=p.link.bytes_s,
        rtt=2 * p.delay_ms / 1e3 + 2 * cal.call_s + own,  # (the broker's link: no delay)
    )


def place(
    s: LabScenario, model: str, spec: ModelSpec, indices: Sequence[int], cal: Calibration,
    core: CoreConfig, seen: Mapping[str, HardwareProfile] | None = None,
) -> list[Placed]:  # fmt: skip
    """The decision core's placement of the model on the scenario's providers (`seen`: the
    profiles the broker sees of them, in the order it hears of them, if not `hardware`'s in
    the scenario's order)."""
    driver = Driver(core)
    if seen is None:
        seen = {p.name: hardware(p, cal) for p in s.lab.provider}
    for name, profile in seen.items():
        memory = int(profile.memory_bytes)
        driver.handle(ProviderJoined(name, profile, 0.0, executor="ort", memory_bytes=memory))
    keys = tuple(f"{model}/{i}" for i in indices)
    actions = driver.handle(ModelAdded(model, spec, keys, 0.0))
    active: dict[int, str] = {}
    backup: dict[int, str] = {}
    for a in actions:
        if isinstance(a, AssignStage):
            (active if a.role == "active" else backup).setdefault(a.pos, a.peer_id)
    if len(active) != len(keys):
        raise ValueError(f"the decision core placed {len(active)} of {len(keys)} stages")
    return [Placed(indices[i], active[i], backup.get(i)) for i in range(len(keys))]


def route(placed: Sequence[Placed]) -> tuple[str, ...]:
    """The providers a chained step passes, in order (a provider's stages in a row once)."""
    return tuple(x for x, _ in split(placed))


def split(placed: Sequence[Placed]) -> tuple[tuple[str, int], ...]:
    """The route with how many stages each provider on it runs in a row."""
    return tuple((x, len(list(g))) for x, g in itertools.groupby(p.provider for p in placed))


def stability(
    s: LabScenario, model: str, spec: ModelSpec, indices: Sequence[int], cal: Calibration,
    core: CoreConfig, placed: list[Placed] | None = None, trials: int = STABILITY_TRIALS,
) -> float:  # fmt: skip
    """How sure the placement is: the share of `trials` placements, each on the profiles
    the broker would see with every provider's uplink and round trip off by up to what the
    lab's broker measured of them varies from run to run (`UPLINK_NOISE`, `RTT_NOISE`,
    uniformly), heard of in a random order (ties go by it: the lab's peer ids are random),
    whose route and split of the stages over it (`split`: the first token's star steps and
    each provider's load depend on it), and where the scenario stops a provider its stages'
    backups, are the nominal placement's; seeded. Below about 0.9 the lab's broker may well choose
    another placement than the prediction's: the scenario then measures the decision's
    noise, not the simulator. `placed`: the nominal placement, if already made."""

    def key(placed: list[Placed]) -> tuple[tuple[tuple[str, int], ...], tuple[str | None, ...]]:
        return split(placed), tuple(p.backup for p in placed) if s.lab.event else ()

    nominal = key(placed or place(s, model, spec, indices, cal, core))
    rng = random.Random(0)
    base = [(p.name, hardware(p, cal)) for p in s.lab.provider]
    same = 0
    for _ in range(trials):
        rng.shuffle(base)
        seen = {
            name: dataclasses.replace(
                h,
                net_bandwidth=h.net_bandwidth * (1 + rng.uniform(-UPLINK_NOISE, UPLINK_NOISE)),
                rtt=h.rtt * (1 + rng.uniform(-RTT_NOISE, RTT_NOISE)),
            )
            for name, h in base
        }
        same += key(place(s, model, spec, indices, cal, core, seen)) == nominal
    return same / trials
