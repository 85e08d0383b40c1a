"""Pool membership: a scripted sequence of events gives the expected states and actions.
(Who takes over a lost stage is the planner's decision: `test_core.py`.)"""

from __future__ import annotations

import pytest

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
from broker.core.pool import PoolConfig, PoolState, Status, apply, promotion_order
from dag.cost import HardwareProfile

FAST = HardwareProfile("rtx4090", {"float16": 165e12}, 24e9, 1.0e12, 12.5e6)
SLOW = HardwareProfile("rtx3060", {"float16": 25e12}, 12e9, 0.36e12, 12.5e6)


def run(state: PoolState, *events: object) -> tuple[PoolState, list[object]]:
    actions: list[object] = []
    for event in events:
        state, more = apply(state, event)  # type: ignore[arg-type]
        actions += more
    return state, actions


def statuses(state: PoolState) -> dict[str, str]:
    return {p: str(v.status) for p, v in sorted(state.providers.items())}


def test_scripted_joins_flapping_missed_heartbeats_and_a_leave() -> None:
    state = PoolState(
        config=PoolConfig(
            heartbeat_interval=5, missed_heartbeats=3, flap_window=600, flap_threshold=2
        )
    )
    # Three providers join: all start in the backup pool and are welcomed.
    state, actions = run(
        state,
        ProviderJoined("a", FAST, at=0),
        ProviderJoined("b", FAST, at=1),
        ProviderJoined("c", SLOW, at=2),
    )
    assert actions == [Welcome("a"), Welcome("b"), Welcome("c")]
    assert statuses(state) == {"a": "backup", "b": "backup", "c": "backup"}

    # Placement: a serves stage s0; b and c keep s0 warm; b finishes loading it.
    state, actions = run(
        state,
        StageAssigned("a", "s0", active=True, at=3),
        StageAssigned("b", "s0", active=False, at=3),
        StageAssigned("c", "s0", active=False, at=3),
        StageReady("a", "s0", at=4),
        StageReady("b", "s0", at=5),
        StageReady("c", "s0", at=5),
    )
    assert actions == [] and statuses(state)["a"] == "active"

    # c flaps: it dies twice within the window (missed heartbeats, then a restart).
    state, actions = run(
        state, HeartbeatReceived("a", 10), HeartbeatReceived("b", 10), ClockTicked(at=21)
    )
    assert actions == [ProviderLost("c", None, graceful=False)]
    state, actions = run(state, ProviderJoined("c", SLOW, at=22), ProviderJoined("c", SLOW, at=23))
    assert actions == [Welcome("c"), ProviderLost("c", None, graceful=False), Welcome("c")]
    assert state.providers["c"].flapping(state.now, state.config)
    assert not state.providers["b"].flapping(state.now, state.config)
    state, _ = run(state, StageReady("c", "s0", at=24))
    # b is warm and steady; c is warm but flapping: b comes first, whatever order they are
    # offered in; a provider that is not warm comes after both.
    assert promotion_order(state, "s0", ["c", "b"]) == ["b", "c"]
    state, _ = run(state, ProviderJoined("d", FAST, at=24))
    assert promotion_order(state, "s0", ["d", "c", "b"]) == ["b", "c", "d"]

    # a leaves gracefully: drain, then leave; its stage is reported lost.
    state, actions = run(
        state,
        HeartbeatReceived("b", 25),
        HeartbeatReceived("c", 25),
        HeartbeatReceived("d", 25),
        DrainStarted("a", at=26),
        ProviderLeft("a", at=27),
    )
    assert actions == [ProviderLost("a", "s0", graceful=True)]
    assert statuses(state)["a"] == "dead"

    # b stops sending heartbeats: after 3 missed intervals it is dead, and no longer offered.
    state, actions = run(
        state, HeartbeatReceived("c", 40), HeartbeatReceived("d", 40), ClockTicked(at=41)
    )
    assert actions == [ProviderLost("b", None, graceful=False)]
    assert promotion_order(state, "s0", ["b", "c", "d"]) == ["c", "d"]

    # A heartbeat from a dead provider asks it to join again.
    state, actions = run(state, HeartbeatReceived("a", 42))
    assert actions == [AskToRejoin("a")]

    # Assigned another stage, c no longer has s0 loaded.
    state, _ = run(state, StageAssigned("c", "s1", True, 43))
    assert state.providers["c"].ready == frozenset()


def test_missed_heartbeats_reported_by_the_service_lose_the_provider() -> None:
    state, _ = run(
        PoolState(),
        ProviderJoined("a", FAST, 0),
        ProviderJoined("b", FAST, 0),
        StageAssigned("a", "s0", True, 1),
        StageAssigned("b", "s0", False, 1),
        StageReady("b", "s0", 2),
    )
    state, actions = run(state, HeartbeatsMissed("a", 20))
    assert actions == [ProviderLost("a", "s0", graceful=False)]
    assert statuses(state) == {"a": "dead", "b": "backup"}


def test_a_draining_provider_that_overstays_is_dead() -> None:
    state = PoolState(config=PoolConfig(drain_timeout=30))
    state, _ = run(
        state, ProviderJoined("a", FAST, 0), StageAssigned("a", "s1", True, 1), DrainStarted("a", 2)
    )
    state, actions = run(state, HeartbeatReceived("a", 10), ClockTicked(20))
    assert actions == [] and state.providers["a"].status is Status.DRAINING
    state, actions = run(state, ClockTicked(33))
    assert actions[0] == ProviderLost("a", "s1", graceful=False)


def test_observed_stage_times_correct_the_profile() -> None:
    state, _ = run(PoolState(), ProviderJoined("a", FAST, 0))
    state, _ = run(
        state, *(StageTimeObserved("a", predicted=1.0, observed=2.0, at=t) for t in range(1, 6))
    )
    correction = state.providers["a"].correction
    assert correction.samples == 5 and abs(correction.factor - 2.0) < 1e-9
    slowed = correction.apply(FAST)
    assert slowed.slowdown == correction.factor


def test_a_late_heartbeat_does_not_move_time_back_and_draining_stays_draining() -> None:
    state, _ = run(PoolState(), ProviderJoined("a", FAST, 0), HeartbeatReceived("a", 20))
    state, _ = run(state, HeartbeatReceived("a", 1))  # delivered late
    assert state.providers["a"].last_seen == 20
    state, actions = run(state, ClockTicked(21))
    assert actions == []
    state, _ = run(state, DrainStarted("a", 22), StageAssigned("a", "s0", True, 23))
    assert state.providers["a"].status is Status.DRAINING


def test_the_mean_detection_time_is_what_the_pool_does_with_heartbeats_and_ticks() -> None:
    """`PoolConfig.detection_s` (what the simulator waits before a crash is noticed) equals the
    pool's own delay, averaged over crashes at random moments between heartbeats and ticks."""
    import random
    import statistics

    config = PoolConfig(heartbeat_interval=5, missed_heartbeats=3)
    rng = random.Random(1)
    delays = []
    for _ in range(400):
        state, _ = run(PoolState(config=config), ProviderJoined("a", FAST, 0))
        beat, crash = rng.uniform(0, 5), 100 + rng.uniform(0, 5)
        while beat < crash:
            state, _ = run(state, HeartbeatReceived("a", beat))
            beat += 5
        tick = rng.uniform(0, config.tick_every)
        while tick < crash:
            tick += config.tick_every
        while True:
            state, actions = run(state, ClockTicked(tick))
            if actions:
                break
            tick += config.tick_every
        delays.append(tick - crash)
    assert statistics.mean(delays) == pytest.approx(config.detection_s, abs=0.25)
