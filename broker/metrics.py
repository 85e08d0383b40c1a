"""`/metrics` for Prometheus: the swarm's state and the broker's traffic.

Counters and histograms are updated as things happen; the gauges (providers per pool, queue
lengths, models served) are read from the registry and the store when Prometheus scrapes.
Each broker has its own collector registry, so several brokers can live in one process.

    fusionai_providers{pool}                      providers per pool (active, backup, ...)
    fusionai_jobs{state}                          jobs per state (queued, running, ...)
    fusionai_queue_length{model}                  queued jobs per model
    fusionai_model_stages_served{model}           provider stages with at least one route
    fusionai_job_outcomes_total{outcome}          finished jobs: succeeded, failed, cancelled
    fusionai_failovers_total{kind}                providers lost, microbatch retries, session moves
    fusionai_stage_requests_total{model,relay}    stage tasks answered by providers (relay:
                                                  "chain" from provider to provider, "direct")
    fusionai_stage_seconds{model}                 their latency (histogram)
    fusionai_generated_tokens_total{model}        tokens generated through /v1/completions
    fusionai_interactive_seconds{endpoint}        embeddings and completions latency (histogram)
    fusionai_http_request_seconds{method,route,status}   every HTTP request (histogram)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
POOLS = ("active", "backup", "draining", "dead")
STATES = ("queued", "placed", "running", "succeeded", "failed", "cancelled")
FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Readings:
    """What the gauges read at each scrape."""

    pools: Callable[[], Iterable[str]]  # each known provider's pool
    jobs: Callable[[], dict[str, int]]  # jobs per state
    queued: Callable[[], dict[str, int]]  # queued jobs per model
    served: Callable[[], dict[str, int]]  # per model: provider stages with a route


class _State(Collector):
    def __init__(self, readings: Readings) -> None:
        self.readings = readings

    def collect(self) -> Iterator[Metric]:
        r = self.readings
        pools = GaugeMetricFamily("fusionai_providers", "Providers per pool", labels=["pool"])
        counts = dict.fromkeys(POOLS, 0)
        for pool in r.pools():
            counts[pool] = counts.get(pool, 0) + 1
        for pool, n in sorted(counts.items()):
            pools.add_metric([pool], n)
        yield pools
        jobs = GaugeMetricFamily("fusionai_jobs", "Jobs per state", labels=["state"])
        by_state = r.jobs()
        for state in STATES:
            jobs.add_metric([state], by_state.get(state, 0))
        yield jobs
        queue = GaugeMetricFamily(
            "fusionai_queue_length", "Queued jobs per model", labels=["model"]
        )
        served = GaugeMetricFamily(
            "fusionai_model_stages_served",
            "Provider stages of a model with at least one serving provider",
            labels=["model"],
        )
        queued = r.queued()
        for name, stages in sorted(r.served().items()):
            queue.add_metric([name], queued.get(name, 0))
            served.add_metric([name], stages)
        yield queue
        yield served


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.outcomes = Counter("fusionai_job_outcomes", "Finished jobs", ["outcome"], registry=r)
        self.failovers = Counter(
            "fusionai_failovers",
            "Providers lost, microbatches retried, generation sessions moved",
            ["kind"],
            registry=r,
        )
        self.stage_requests = Counter(
            "fusionai_stage_requests",
            "Stage tasks answered by providers",
            ["model", "relay"],
            registry=r,
        )
        self.stage_seconds = Histogram(
            "fusionai_stage_seconds", "Stage request latency", ["model"], buckets=FAST, registry=r
        )
        self.generated = Counter(
            "fusionai_generated_tokens", "Tokens generated for completions", ["model"], registry=r
        )
        self.interactive_seconds = Histogram(
            "fusionai_interactive_seconds",
            "Embeddings and completions request latency",
            ["endpoint"],
            buckets=FAST,
            registry=r,
        )
        self.http_seconds = Histogram(
            "fusionai_http_request_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            buckets=FAST,
            registry=r,
        )

    def watch(self, readings: Readings) -> None:
        """Read the swarm's state with `readings` at each scrape."""
        self.registry.register(_State(readings))

    def event(self, row: object) -> None:
        """Count an event of the broker's log (one of its sinks)."""
        kind = getattr(row, "kind", "")
        if kind in ("job_succeeded", "job_failed", "job_cancelled"):
            self.outcomes.labels(kind.removeprefix("job_")).inc()
        elif kind == "provider_lost":
            self.failovers.labels("provider_lost").inc()
        elif kind == "microbatch_retry":
            self.failovers.labels("microbatch_retry").inc()

    def failover(self, kind: str) -> None:
        self.failovers.labels(kind).inc()

    def stage(self, model: str, seconds: float, relay: str) -> None:
        self.stage_requests.labels(model, relay).inc()
        self.stage_seconds.labels(model).observe(seconds)

    def tokens(self, model: str, n: int) -> None:
        self.generated.labels(model).inc(n)

    def interactive(self, endpoint: str, seconds: float) -> None:
        self.interactive_seconds.labels(endpoint).observe(seconds)

    def http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_seconds.labels(method, route, str(status)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
