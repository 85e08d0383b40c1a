"""The dashboard's samples (`broker.history`) on a virtual clock: rates from providers'
heartbeat counters and gateways' reports, per model and per provider, failovers and checks,
counters that restart, and an hour kept."""

from __future__ import annotations

import pytest

from broker.history import History, Rates, Swarm
from broker.schema import EventRow
from proto.api.keys import GatewayReport, ModelTraffic
from proto.heartbeat import StageWork


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def work(key: str, tokens: int, busy: float = 0.0, runs: int = 0, requests: int = 0) -> StageWork:
    return StageWork(
        key, requests=requests, tokens=tokens, positions=tokens, runs=runs, busy_s=busy
    )


def test_rates_use_report_arrival_times_and_restart_with_their_source() -> None:
    rates = Rates(window_s=2.0)
    assert rates.rates(0.0) == {}
    # 10 tokens/s, reported at uneven times: the rate is exact all the same
    for at in (0.0, 0.4, 1.5, 1.7, 3.1):
        rates.add(at, {("m/1", "tokens"): 10 * at})
    assert [t for t, _ in rates.readings] == [0.4, 1.5, 1.7, 3.1]  # 0.0 was before the window
    assert rates.rates(3.1)[("m/1", "tokens")] == pytest.approx(10.0)
    assert rates.readings[0][0] <= 3.1 - 2.0  # the baseline is a reading a window back
    # a counter that goes down: its source restarted, readings start again
    rates.add(3.6, {("m/1", "tokens"): 2.0})
    assert rates.rates(3.6) == {}
    rates.add(4.6, {("m/1", "tokens"): 7.0})
    assert rates.rates(4.6)[("m/1", "tokens")] == pytest.approx(5.0)
    assert rates.rates(4.6 + 2.1) == {}  # silent for a whole window: no rate


def test_samples_of_models_providers_gateways_failovers_and_checks() -> None:
    clock, wall = Clock(), Clock()
    swarm = Swarm(
        models={"m": ["m/1", "m/2"], "idle": ["idle/1"]},
        queued={"m": 3},
        providers={"a": ("active", 2), "b": ("active", 0), "c": ("backup", 0)},
    )
    history = History(1.0, 0.5, lambda: swarm, clock=clock, wall=wall, keep_s=10.0)
    assert history.window_s == 2.0
    for step in range(8):  # 0.5 s heartbeats: a holds m/1 (two replicas with b), b m/2
        t = 0.5 * step
        history.heartbeat("a", [work("m/1", int(20 * t), busy=0.25 * t, runs=int(20 * t))])
        history.heartbeat(
            "b", [work("m/1", int(10 * t)), work("m/2", int(30 * t), 0.5 * t, int(30 * t))]
        )
        history.heartbeat("c", [])
        clock.now += 0.5
    history.gateway(GatewayReport("gw", models={"m": ModelTraffic(tokens=0, requests=0)}))
    clock.now += 1.0
    history.gateway(GatewayReport("gw", models={"m": ModelTraffic(tokens=12, requests=2)}))
    clock.now -= 0.9  # (a sample a moment after the last heartbeats)
    for kind, data in [("provider_lost", {}), ("session_failover", {}), ("result_checked", {}),
                       ("generation_verified", {"ok": True}),
                       ("generation_verified", {"ok": False}), ("provider_quarantined", {}),
                       ("job_queued", {})]:  # fmt: skip
        history.event(EventRow(1, 0.0, kind, None, "a", data))
    sample = history.sample()
    m = sample.models["m"]
    assert m.tokens_s == pytest.approx(30.0)  # m/1: 20 + 10 from two providers; m/2: 30
    assert m.queued == 3 and sample.models["idle"].tokens_s == 0.0
    assert sample.tokens_s == pytest.approx(30.0)
    a, b = sample.providers["a"], sample.providers["b"]
    assert a.util == pytest.approx(0.25) and a.stage_ms == pytest.approx(12.5) and a.queued == 2
    assert b.util == pytest.approx(0.5) and b.tokens_s == pytest.approx(40.0)
    assert sample.providers["c"].stage_ms is None and sample.providers["c"].util == 0.0
    assert sample.gateways["gw"].tokens_s == pytest.approx(12.0)
    assert sample.gateways["gw"].requests_s == pytest.approx(2.0)
    assert sample.failovers == {"provider_lost": 1, "microbatch_retry": 0, "session_failover": 1}
    assert sample.checks == {"agreed": 2, "disagreed": 1, "quarantined": 1}
    assert sample.seq == 0 and history.taken == 1
    # counts are per sample; a silent provider's rates fall to nothing, a forgotten one goes
    clock.now += 5.0
    swarm.providers.pop("b")
    later = history.sample()
    assert later.failovers["provider_lost"] == 0 and later.checks["agreed"] == 0
    assert later.models["m"].tokens_s == 0.0 and "b" not in later.providers
    # an hour kept: here 10 s of 1 s samples
    for _ in range(20):
        wall.now += 1.0
        history.sample()
    assert len(history.samples) == 10
    assert [s.at for s in history.since(wall.now - 3).samples] == [
        wall.now - 2,
        wall.now - 1,
        wall.now,
    ]
