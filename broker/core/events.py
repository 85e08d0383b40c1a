"""What the decision core hears: events, past tense, each stamped with the time it happened.

Every input to `broker.core.Core.handle` is one of `Input`; the service builds them from what
providers, clients and its own clock tell it, the simulator from its virtual world. They are
frozen, tagged msgspec structs, so a run's inputs can be written to a trace file and replayed
(`broker.core.trace`). `at` is seconds on the caller's monotonic clock (virtual in the
simulator); the core never reads a clock of its own.

`StageAssigned`, `StageReady`, `StageTimeObserved` and `DrainStarted` are the pool's own
events: the core applies them to its membership state as consequences of other inputs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dag.cost import HardwareProfile, Workload
from dag.model import ModelSpec


class _Event(msgspec.Struct, frozen=True, tag=True):
    pass


# ---- providers ------------------------------------------------------------------------------


class ProviderJoined(_Event, frozen=True):
    peer_id: str
    profile: HardwareProfile  # as measured by the provider (the core corrects it by observation)
    at: float
    loaded: frozenset[str] = frozenset()  # unit keys it still has loaded (after a restart)
    executor: str = ""  # the runtime it runs stages with (shown in the event log)
    memory_bytes: int = 0  # its memory limit for stages; bytes (shown in the event log)
    boot: str = ""  # its process's random id: the same again is a re-join, not a restart


class HeartbeatReceived(_Event, frozen=True):
    peer_id: str
    at: float
    loaded: frozenset[str] | None = None  # unit keys it reports loaded (None: not reported)
    draining: bool = False  # it is finishing its work before leaving


class HeartbeatsMissed(_Event, frozen=True):
    """`peer_id` stopped answering: its heartbeats stopped (what `ClockTicked` finds by itself),
    a request to it failed and it did not answer a ping, or an assignment could not reach it."""

    peer_id: str
    at: float


class ProviderLeft(_Event, frozen=True):
    """`peer_id` left on purpose (or was quarantined: its answers are not trusted)."""

    peer_id: str
    at: float


class ClockTicked(_Event, frozen=True):
    """Time passed: silence becomes death, restore grace periods end."""

    at: float


class StageTimed(_Event, frozen=True):
    """A stage of `model` on `peer_id` took `seconds` on a microbatch of `work`."""

    peer_id: str
    model: str
    work: Workload
    seconds: float
    at: float


# ---- models and their stages ----------------------------------------------------------------


class ModelAdded(_Event, frozen=True):
    """A model (or a new version of it) to serve: `keys` are its provider stages' unit keys in
    pipeline order; `restored` a placement the broker had before it restarted (its JSON form,
    `broker.core.plans.placement_to_json`), which the core checks before trusting."""

    model: str
    spec: ModelSpec
    keys: tuple[str, ...]
    at: float
    restored: dict[str, Any] | None = None


class StageReported(_Event, frozen=True):
    """A provider reports units it was assigned: loaded (`ready`) in `role`, or failed."""

    peer_id: str
    keys: tuple[str, ...]  # one per status message from a provider; a whole load's in the sim
    role: str  # "active" or "backup"
    ready: bool
    at: float
    reason: str = ""
    load_s: float = 0.0  # seconds the load took (shown in the event log)


class AssignAnswered(_Event, frozen=True):
    """A provider answered an assign, promote or unassign message."""

    peer_id: str
    key: str
    kind: str  # "assign", "promote" or "unassign"
    accepted: bool
    at: float
    reason: str = ""


class RebalanceCheck(_Event, frozen=True):
    """Time to consider placing idle models afresh (every `CoreConfig.rebalance_every_s`)."""

    at: float


# ---- work on the models ---------------------------------------------------------------------


class ModelUsed(_Event, frozen=True):
    """An interactive request or generation session started (+1) or ended (-1) on `model`."""

    model: str
    delta: int
    at: float


class JobQueued(_Event, frozen=True):
    job: str
    model: str
    created: float  # when it was submitted (orders arrivals); seconds
    estimate_s: float  # its size, for shortest-job-first (a ranking, not a prediction)
    at: float


class JobProgressed(_Event, frozen=True):
    job: str
    done: float  # share of its work finished, 0..1
    at: float


class JobEnded(_Event, frozen=True):
    """A job stopped running or left the queue (succeeded, failed or cancelled)."""

    job: str
    at: float


# ---- the pool's own (applied by the core, never given to it) --------------------------------


class DrainStarted(_Event, frozen=True):
    peer_id: str
    at: float


class StageAssigned(_Event, frozen=True):
    """Placement decided: `peer_id` serves `stage` (active) or keeps it warm (backup)."""

    peer_id: str
    stage: str | None
    active: bool
    at: float


class StageReady(_Event, frozen=True):
    peer_id: str
    stage: str
    at: float


class StageTimeObserved(_Event, frozen=True):
    peer_id: str
    predicted: float  # seconds the cost model expected
    observed: float  # seconds it took
    at: float


Input = (
    ProviderJoined
    | HeartbeatReceived
    | HeartbeatsMissed
    | ProviderLeft
    | ClockTicked
    | StageTimed
    | ModelAdded
    | StageReported
    | AssignAnswered
    | RebalanceCheck
    | ModelUsed
    | JobQueued
    | JobProgressed
    | JobEnded
)
