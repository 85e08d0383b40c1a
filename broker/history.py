"""The dashboard's charts: the swarm sampled every `every_s` seconds, an hour of samples kept
(`GET /v1/metrics/history`; each new one also goes down `/v1/stream` as a `sample` event).

Providers report cumulative work counters per stage in their heartbeats (`StageWork`), and
gateways their traffic counters in their reports. The broker turns them into rates over the
reports of about the last `window_s` seconds, divided by the time between those reports'
arrivals, so a heartbeat that comes late or early neither halves nor doubles a rate. A
counter that goes down means its source restarted: its readings start again.

A model's tokens/s are the tokens generated through its stages (the stage that counted most,
summed over its providers): every session counts, whether it came through the broker, a
gateway or an SDK that dialled the providers itself. Failovers and verification results are
the log's events, counted as they are emitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.schema import EventRow
from proto import api
from proto.api.keys import GatewayReport
from proto.heartbeat import StageWork

if TYPE_CHECKING:
    from broker.config import BrokerConfig
    from broker.events import EventLog
    from broker.registry import Registry
    from broker.serving import Serving
    from broker.store import Store

log = logging.getLogger("fusionai.broker")
KEEP_S = 3600.0  # an hour of samples
SILENT_GATEWAY_S = 60.0  # a gateway silent this long (beyond its rates' window) is dropped
MAX_SAMPLES = 7200  # (at most: an hour at the shortest interval, half a second)
FAILOVERS = ("provider_lost", "microbatch_retry", "session_failover")
Key = tuple[str, str]  # (stage key or "", counter name)


class Rates:
    """Cumulative counters that one source reports now and then, and their rates."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.readings: deque[tuple[float, dict[Key, float]]] = deque()

    def add(self, at: float, totals: dict[Key, float]) -> None:
        if self.readings:
            last = self.readings[-1][1]
            if any(totals.get(k, 0.0) < v for k, v in last.items()):
                self.readings.clear()  # the source restarted: its counters start again
        self.readings.append((at, totals))
        # keep the newest reading at or before the window's start (the rates' baseline)
        while len(self.readings) > 2 and self.readings[1][0] <= at - self.window_s:
            self.readings.popleft()

    def rates(self, now: float) -> dict[Key, float]:
        """Per second over the readings kept ({}: fewer than two, or silent for a window)."""
        if len(self.readings) < 2 or now - self.readings[-1][0] > self.window_s:
            return {}
        (t0, first), (t1, last) = self.readings[0], self.readings[-1]
        if t1 <= t0:
            return {}
        return {k: (v - first.get(k, 0.0)) / (t1 - t0) for k, v in last.items()}

    def delta(self) -> dict[Key, float]:
        """How much each counter grew over the readings kept."""
        if not self.readings:
            return {}
        first, last = self.readings[0][1], self.readings[-1][1]
        return {k: v - first.get(k, 0.0) for k, v in last.items()}


@dataclass(frozen=True)
class Swarm:
    """What a sample reads of the swarm at its moment."""

    models: dict[str, list[str]]  # model -> its provider stages' keys, in order
    queued: dict[str, int]  # model -> jobs waiting
    providers: dict[str, tuple[str, int]]  # peer -> (pool, requests waiting or running)


def watch(
    config: BrokerConfig, serving: Serving, store: Store, registry: Registry, events: EventLog
) -> History:
    """The broker's history: fed by providers' heartbeats (through `registry`) and the log's
    events; a sample reads `serving`, `store` and `registry` (gateways' reports are handed to
    `History.gateway` by `broker.gateways`)."""
    history = History(
        config.metrics_every_s,
        config.heartbeat_s,
        swarm_reader(serving, store, registry),
        clock=registry.clock,
    )
    registry.on_work = history.heartbeat
    events.sinks.append(history.event)
    return history


def swarm_reader(serving: Serving, store: Store, registry: Registry) -> Callable[[], Swarm]:
    """What a sample reads of the broker: models' stage keys, queued jobs, live providers."""

    def read() -> Swarm:
        return Swarm(
            models={name: list(plan.keys) for name, plan in serving.plans.items()},
            queued=store.count_queued(),
            providers={
                peer: (p.status.value, registry.load.get(peer, (0, 0))[0])
                for peer, p in registry.core.pool.providers.items()
                if p.status.value != "dead"
            },
        )

    return read


def _work_totals(work: Iterable[StageWork]) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for w in work:
        out[w.key, "requests"] = float(w.requests)
        out[w.key, "tokens"] = float(w.tokens)
        out[w.key, "positions"] = float(w.positions)
        out[w.key, "runs"] = float(w.runs)
        out[w.key, "busy_s"] = w.busy_s
    return out


class History:
    def __init__(
        self,
        every_s: float,
        heartbeat_s: float,
        read: Callable[[], Swarm],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        keep_s: float = KEEP_S,
    ) -> None:
        self.every_s = every_s
        # rates over at least two heartbeats and two samples
        self.window_s = max(2 * every_s, 2 * heartbeat_s)
        self.read = read
        self.clock = clock
        self.wall = wall
        self.samples: deque[api.Sample] = deque(
            maxlen=max(1, min(MAX_SAMPLES, round(keep_s / every_s)))
        )
        self.taken = 0  # samples taken
        self.providers: dict[str, Rates] = {}
        self.gateways: dict[str, Rates] = {}
        self.counted: Counter[str] = Counter()  # events since the last sample

    # ---- what comes in ----------------------------------------------------------------------

    def heartbeat(self, peer: str, work: Iterable[StageWork]) -> None:
        rates = self.providers.setdefault(peer, Rates(self.window_s))
        rates.add(self.clock(), _work_totals(work))

    def gateway(self, report: GatewayReport) -> None:
        totals: dict[Key, float] = {}
        for model, traffic in report.models.items():
            totals[model, "tokens"] = float(traffic.tokens)
            totals[model, "requests"] = float(traffic.requests)
        self.gateways.setdefault(report.gateway, Rates(self.window_s)).add(self.clock(), totals)

    def event(self, row: EventRow) -> None:
        """Count an event of the log (one of its sinks)."""
        kind, data = row.kind, row.data
        if kind in FAILOVERS:
            self.counted[kind] += 1
        elif kind == "result_checked" or (kind == "generation_verified" and data.get("ok")):
            self.counted["agreed"] += 1
        elif kind == "generation_verified":
            self.counted["disagreed"] += 1
        elif kind == "provider_quarantined":  # (a forward check that disagreed ends in one)
            self.counted["quarantined"] += 1

    # ---- samples ----------------------------------------------------------------------------

    def sample(self) -> api.Sample:
        """Take a sample now and keep it."""
        now, swarm = self.clock(), self.read()
        for peer in [p for p in self.providers if p not in swarm.providers]:
            del self.providers[peer]  # (forgotten by the registry)
        per_key: Counter[Key] = Counter()  # rates summed over the providers holding a key
        providers: dict[str, api.ProviderSample] = {}
        for peer, (pool, queued) in sorted(swarm.providers.items()):
            rates = self.providers.get(peer)
            got = rates.rates(now) if rates is not None else {}
            grown = rates.delta() if rates is not None and got else {}
            per_key.update(got)
            busy = sum(v for (_, name), v in grown.items() if name == "busy_s")
            runs = sum(v for (_, name), v in grown.items() if name == "runs")
            providers[peer] = api.ProviderSample(
                pool=pool,
                util=round(sum(v for (_, n), v in got.items() if n == "busy_s"), 4),
                stage_ms=round(1e3 * busy / runs, 3) if runs > 0 else None,
                tokens_s=round(sum(v for (_, n), v in got.items() if n == "positions"), 3),
                queued=queued,
            )
        models: dict[str, api.ModelSample] = {}
        for name, keys in sorted(swarm.models.items()):
            tokens = max((per_key[k, "tokens"] for k in keys), default=0.0)
            requests = max((per_key[k, "requests"] for k in keys), default=0.0)
            models[name] = api.ModelSample(
                tokens_s=round(max(0.0, tokens), 3),
                requests_s=round(max(0.0, requests), 3),
                queued=swarm.queued.get(name, 0),
            )
        gateways: dict[str, api.GatewaySample] = {}
        for gateway, rates in sorted(self.gateways.items()):
            if now - rates.readings[-1][0] > 3 * self.window_s + SILENT_GATEWAY_S:
                del self.gateways[gateway]  # (gone: no longer charted)
                continue
            got = rates.rates(now)
            gateways[gateway] = api.GatewaySample(
                tokens_s=round(sum(v for (_, n), v in got.items() if n == "tokens"), 3),
                requests_s=round(sum(v for (_, n), v in got.items() if n == "requests"), 3),
            )
        counted, self.counted = self.counted, Counter()
        sample = api.Sample(
            seq=self.taken,
            at=round(self.wall(), 3),
            tokens_s=round(sum(m.tokens_s for m in models.values()), 3),
            models=models,
            providers=providers,
            gateways=gateways,
            failovers={k: counted[k] for k in FAILOVERS},
            checks={k: counted[k] for k in ("agreed", "disagreed", "quarantined")},
        )
        self.taken += 1
        self.samples.append(sample)
        return sample

    async def run(self, stop: asyncio.Event, wake: Callable[[], None]) -> None:
        """A sample every `every_s` until `stop`; `wake` tells the streams of each."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
                return
            except TimeoutError:
                pass
            try:
                self.sample()
                wake()
            except Exception:  # a bug here must not stop the charts for good
                log.exception("a metrics sample failed; trying again")

    def since(self, at: float = 0.0, after: int = -1) -> api.History:
        """The samples taken after Unix time `at` and after the one numbered `after`."""
        return api.History(
            every_s=self.every_s,
            window_s=self.window_s,
            samples=[s for s in self.samples if s.at > at and s.seq > after],
        )
