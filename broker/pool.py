"""Pool membership, a pure state machine: `apply(state, event) -> (state, actions)`.

Providers join into the backup pool; placement assigns them stages (active) or a stage to keep
pre-loaded (backup). Heartbeats keep them alive; missing `missed_heartbeats` in a row, or
leaving, makes them dead, and the stage they served is taken over by a warm backup if one is
ready (else the placement must re-plan). Providers that come and go often are "flapping" and
are promoted last. Time enters only with events, so the simulator drives this same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from dag.cost import Correction, HardwareProfile


class Status(StrEnum):
    ACTIVE = "active"  # serves a stage
    BACKUP = "backup"  # in the backup pool (maybe pre-loading a stage)
    DRAINING = "draining"  # finishing in-flight work before leaving
    DEAD = "dead"  # left, or stopped answering


@dataclass(frozen=True)
class PoolConfig:
    heartbeat_interval: float = 5.0  # seconds between a provider's heartbeats
    missed_heartbeats: int = 3  # heartbeats missed in a row before a provider is dead
    flap_window: float = 600.0  # seconds over which departures count towards flapping
    flap_threshold: int = 3  # departures within the window that make a provider flapping
    drain_timeout: float = 60.0  # seconds a draining provider may take before it is dead


@dataclass(frozen=True)
class Provider:
    peer_id: str
    profile: HardwareProfile
    status: Status
    joined_at: float
    last_seen: float
    stage: str | None = None  # the stage it serves (active) or keeps warm (backup)
    ready: frozenset[str] = frozenset()  # stages it has loaded and can serve at once
    departures: tuple[float, ...] = ()  # when it left or died, within the flap window
    drain_started: float | None = None
    correction: Correction = field(default_factory=Correction)

    def flapping(self, now: float, config: PoolConfig) -> bool:
        recent = [t for t in self.departures if now - t <= config.flap_window]
        return len(recent) >= config.flap_threshold


@dataclass(frozen=True)
class PoolState:
    providers: dict[str, Provider] = field(default_factory=dict)
    now: float = 0.0
    config: PoolConfig = field(default_factory=PoolConfig)

    def by_status(self, status: Status) -> list[Provider]:
        return [p for p in self.providers.values() if p.status is status]

    def serving(self, stage: str) -> list[Provider]:
        return [
            p for p in self.providers.values() if p.status is Status.ACTIVE and p.stage == stage
        ]


# ---- events (what happened) ---------------------------------------------------------------


@dataclass(frozen=True)
class ProviderJoined:
    peer_id: str
    profile: HardwareProfile
    at: float


@dataclass(frozen=True)
class HeartbeatReceived:
    peer_id: str
    at: float


@dataclass(frozen=True)
class ClockTicked:
    at: float


@dataclass(frozen=True)
class HeartbeatsMissed:
    """The service saw `peer_id`'s heartbeats stop (what `ClockTicked` finds by itself)."""

    peer_id: str
    at: float


@dataclass(frozen=True)
class DrainStarted:
    peer_id: str
    at: float


@dataclass(frozen=True)
class ProviderLeft:
    peer_id: str
    at: float


@dataclass(frozen=True)
class StageAssigned:
    """Placement decided: `peer_id` serves `stage` (active) or keeps it warm (backup)."""

    peer_id: str
    stage: str | None
    active: bool
    at: float


@dataclass(frozen=True)
class StageReady:
    peer_id: str
    stage: str
    at: float


@dataclass(frozen=True)
class StageTimeObserved:
    peer_id: str
    predicted: float  # seconds the cost model expected
    observed: float  # seconds it took
    at: float


Event = (
    ProviderJoined
    | HeartbeatReceived
    | HeartbeatsMissed
    | ClockTicked
    | DrainStarted
    | ProviderLeft
    | StageAssigned
    | StageReady
    | StageTimeObserved
)


# ---- actions (what the service must do) ---------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    peer_id: str  # answer the join: you are in the backup pool


@dataclass(frozen=True)
class AskToRejoin:
    peer_id: str  # a heartbeat from a provider we consider dead or never met


@dataclass(frozen=True)
class ProviderLost:
    peer_id: str
    stage: str | None  # what it served, if it was active
    graceful: bool


@dataclass(frozen=True)
class PromoteBackup:
    peer_id: str  # a backup with the stage loaded now serves it
    stage: str
    replacing: str


@dataclass(frozen=True)
class Replan:
    reason: str  # no warm backup could take over; placement must decide


Action = Welcome | AskToRejoin | ProviderLost | PromoteBackup | Replan


def _put(state: PoolState, provider: Provider, now: float | None = None) -> PoolState:
    providers = dict(state.providers)
    providers[provider.peer_id] = provider
    return replace(
        state, providers=providers, now=max(state.now, now if now is not None else state.now)
    )


def promotion_order(state: PoolState, stage: str) -> list[Provider]:
    """Backups that could take over `stage`: warm ones first, flapping ones last, then the
    fastest (by fp16 FLOP/s corrected for observed slowness)."""
    candidates = [p for p in state.providers.values() if p.status is Status.BACKUP]

    def key(p: Provider) -> tuple[bool, bool, float]:
        speed = p.profile.flops_for("float16") / p.correction.factor
        return (p.flapping(state.now, state.config), stage not in p.ready, -speed)

    return sorted(candidates, key=key)


def _lose(
    state: PoolState, provider: Provider, at: float, graceful: bool, promote: bool = True
) -> tuple[PoolState, list[Action]]:
    was_active = provider.status is Status.ACTIVE or (
        provider.status is Status.DRAINING and provider.stage is not None
    )
    stage = provider.stage if was_active else None
    recent = [t for t in provider.departures if at - t <= state.config.flap_window]
    departures = (*recent, at)
    dead = replace(
        provider, status=Status.DEAD, stage=None, ready=frozenset(), departures=departures
    )
    state = _put(state, dead, at)
    actions: list[Action] = [ProviderLost(provider.peer_id, stage, graceful)]
    if promote and stage is not None:
        state, more = _take_over(state, stage, provider.peer_id, at)
        actions += more
    return state, actions


def _take_over(
    state: PoolState, stage: str, lost: str, at: float
) -> tuple[PoolState, list[Action]]:
    """Give `stage` (served by `lost` until now) to a warm backup, or ask for a re-plan."""
    if state.serving(stage):
        return state, []
    warm = [p for p in promotion_order(state, stage) if stage in p.ready]
    if warm:
        chosen = warm[0]
        state = _put(state, replace(chosen, status=Status.ACTIVE, stage=stage), at)
        return state, [PromoteBackup(chosen.peer_id, stage, lost)]
    return state, [Replan(f"{lost} served {stage} and no backup has it loaded")]


def apply(state: PoolState, event: Event) -> tuple[PoolState, list[Action]]:
    """The next state and the actions it calls for. Pure: no clock, no I/O."""
    now = max(state.now, event.at)
    if isinstance(event, ProviderJoined):
        known = state.providers.get(event.peer_id)
        departures = known.departures if known else ()
        if known is not None and known.status is not Status.DEAD:
            state, lost = _lose(state, known, event.at, graceful=False)  # restarted without leaving
            departures = state.providers[event.peer_id].departures
        else:
            lost = []
        joined = Provider(
            event.peer_id, event.profile, Status.BACKUP, event.at, event.at, departures=departures
        )
        return _put(state, joined, now), [*lost, Welcome(event.peer_id)]

    provider = state.providers.get(getattr(event, "peer_id", ""))
    if isinstance(event, ClockTicked):
        actions: list[Action] = []
        state = replace(state, now=now)
        limit = state.config.heartbeat_interval * state.config.missed_heartbeats
        lost_stages: list[tuple[str, str]] = []
        for peer_id in sorted(state.providers):
            p = state.providers[peer_id]
            silent = p.status in (Status.ACTIVE, Status.BACKUP) and now - p.last_seen > limit
            overdue = (
                p.status is Status.DRAINING
                and p.drain_started is not None
                and now - p.drain_started > state.config.drain_timeout
            )
            if silent or overdue:
                # Everyone silent is marked dead first, so no dead backup gets promoted.
                state, more = _lose(state, p, now, graceful=False, promote=False)
                actions += more
                if p.stage is not None and p.status is not Status.BACKUP:
                    lost_stages.append((p.stage, peer_id))
        for stage, peer_id in lost_stages:
            state, more = _take_over(state, stage, peer_id, now)
            actions += more
        return state, actions
    if provider is None or provider.status is Status.DEAD:
        if isinstance(event, HeartbeatReceived):
            return replace(state, now=now), [AskToRejoin(event.peer_id)]
        return replace(state, now=now), []
    seen = max(provider.last_seen, event.at)  # a late message never moves time back
    if isinstance(event, HeartbeatReceived):
        return _put(state, replace(provider, last_seen=seen), now), []
    if isinstance(event, DrainStarted):
        return _put(
            state, replace(provider, status=Status.DRAINING, drain_started=event.at), now
        ), []
    if isinstance(event, ProviderLeft):
        return _lose(state, provider, event.at, graceful=True)
    if isinstance(event, HeartbeatsMissed):
        return _lose(state, provider, event.at, graceful=False)
    if isinstance(event, StageAssigned):
        status = Status.ACTIVE if event.active else Status.BACKUP
        if provider.status is Status.DRAINING:
            status = Status.DRAINING  # leaving: its drain goes on whatever it is assigned
        updated = replace(provider, status=status, stage=event.stage, last_seen=seen)
        return _put(state, updated, now), []
    if isinstance(event, StageReady):
        updated = replace(provider, ready=provider.ready | {event.stage}, last_seen=seen)
        return _put(state, updated, now), []
    if isinstance(event, StageTimeObserved):
        correction = provider.correction.observe(event.predicted, event.observed)
        return _put(state, replace(provider, correction=correction), now), []
    raise TypeError(f"unknown event {event!r}")
