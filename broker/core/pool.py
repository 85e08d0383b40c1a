"""Pool membership, a pure state machine: `apply(state, event) -> (state, actions)`.

Providers join into the backup pool; placement assigns them stages (active) or a stage to keep
pre-loaded (backup). Heartbeats keep them alive; missing `missed_heartbeats` in a row, or
leaving, makes them dead (`ProviderLost`); who takes over what they served is the planner's
decision (`broker.core.planner`), which asks `promotion_order` for the candidates: warm ones
first, providers that come and go often ("flapping") last, then the fastest. Time enters only
with events, so the simulator drives this same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from broker.core.actions import AskToRejoin, ProviderLost, Welcome
from broker.core.events import (
    ClockTicked,
    DrainStarted,
    HeartbeatReceived,
    HeartbeatsMissed,
    ProviderJoined,
    ProviderLeft,
    StageAssigned,
    StageReady,
    StageTimeObserved,
)
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

    @property
    def silence_limit(self) -> float:
        """Seconds without a heartbeat after which a provider is dead."""
        return self.heartbeat_interval * self.missed_heartbeats

    @property
    def tick_every(self) -> float:
        """Seconds between the service's clock ticks (four per heartbeat interval)."""
        return max(0.05, self.heartbeat_interval / 4)

    @property
    def detection_s(self) -> float:
        """Seconds from a crash to its detection, on average: silence counts from the last
        heartbeat, which came half an interval before the crash on average, and is found at
        the next tick (half a tick later on average)."""
        return self.silence_limit - self.heartbeat_interval / 2 + self.tick_every / 2


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
    boot: str = ""  # its process's id, when it sends one

    def rejoins(self, event: ProviderJoined) -> bool:
        """`event` is this live provider's own process joining again (after a heartbeat that
        did not get through), not a restart."""
        return self.status is not Status.DEAD and bool(event.boot) and event.boot == self.boot

    def flapping(self, now: float, config: PoolConfig) -> bool:
        recent = [t for t in self.departures if now - t <= config.flap_window]
        return len(recent) >= config.flap_threshold


@dataclass(frozen=True)
class PoolState:
    providers: dict[str, Provider] = field(default_factory=dict)
    now: float = 0.0
    config: PoolConfig = field(default_factory=PoolConfig)

    def alive(self, peer: str) -> bool:
        p = self.providers.get(peer)
        return p is not None and p.status is not Status.DEAD


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
Action = Welcome | AskToRejoin | ProviderLost


def _put(state: PoolState, provider: Provider, now: float | None = None) -> PoolState:
    providers = dict(state.providers)
    providers[provider.peer_id] = provider
    return replace(
        state, providers=providers, now=max(state.now, now if now is not None else state.now)
    )


def promotion_order(state: PoolState, stage: str, among: list[str]) -> list[str]:
    """Of the live providers `among` (in the caller's order of preference), who should take
    over `stage` first: warm ones (it is loaded), then those not flapping; otherwise the
    caller's order stands."""

    def key(peer: str) -> tuple[bool, bool]:
        p = state.providers[peer]
        return (stage not in p.ready, p.flapping(state.now, state.config))

    return sorted((p for p in among if state.alive(p)), key=key)


def _lose(
    state: PoolState, provider: Provider, at: float, graceful: bool
) -> tuple[PoolState, list[Action]]:
    was_active = provider.status is Status.ACTIVE or (
        provider.status is Status.DRAINING and provider.stage is not None
    )
    stage = provider.stage if was_active else None
    recent = [t for t in provider.departures if at - t <= state.config.flap_window]
    dead = replace(
        provider, status=Status.DEAD, stage=None, ready=frozenset(), departures=(*recent, at)
    )
    return _put(state, dead, at), [ProviderLost(provider.peer_id, stage, graceful)]


def apply(state: PoolState, event: Event) -> tuple[PoolState, list[Action]]:
    """The next state and the actions it calls for. Pure: no clock, no I/O."""
    now = max(state.now, event.at)
    if isinstance(event, ProviderJoined):
        known = state.providers.get(event.peer_id)
        if known is not None and known.rejoins(event):  # alive all along: it keeps its place
            back = replace(known, last_seen=max(known.last_seen, event.at), profile=event.profile)
            return _put(state, back, now), [Welcome(event.peer_id)]
        departures = known.departures if known else ()
        lost: list[Action] = []
        if known is not None and known.status is not Status.DEAD:
            state, lost = _lose(state, known, event.at, graceful=False)  # restarted unnoticed
            departures = state.providers[event.peer_id].departures
        joined = Provider(
            event.peer_id,
            event.profile,
            Status.BACKUP,
            event.at,
            event.at,
            departures=departures,
            boot=event.boot,
        )
        return _put(state, joined, now), [*lost, Welcome(event.peer_id)]
    if isinstance(event, ClockTicked):
        actions: list[Action] = []
        state = replace(state, now=now)
        limit = state.config.silence_limit
        for peer_id in sorted(state.providers):
            p = state.providers[peer_id]
            silent = p.status in (Status.ACTIVE, Status.BACKUP) and now - p.last_seen > limit
            overdue = (
                p.status is Status.DRAINING
                and p.drain_started is not None
                and now - p.drain_started > state.config.drain_timeout
            )
            if silent or overdue:
                state, more = _lose(state, p, now, graceful=False)
                actions += more
        return state, actions
    provider = state.providers.get(event.peer_id)
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
        # It holds one stage at a time: what it had loaded of another is dropped.
        ready = provider.ready & {event.stage} if event.stage is not None else frozenset()
        updated = replace(provider, status=status, stage=event.stage, ready=ready, last_seen=seen)
        return _put(state, updated, now), []
    if isinstance(event, StageReady):
        updated = replace(provider, ready=provider.ready | {event.stage}, last_seen=seen)
        return _put(state, updated, now), []
    if isinstance(event, StageTimeObserved):
        correction = provider.correction.observe(event.predicted, event.observed)
        return _put(state, replace(provider, correction=correction), now), []
    raise TypeError(f"unknown event {event!r}")
