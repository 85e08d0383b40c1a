"""What a simulated run measured (`SimResult`), and its summary as JSON-safe figures."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.scenario import Scenario


@dataclass
class SimResult:
    scenario: Scenario
    duration_s: float
    tokens_completed: float
    tokens_lost: float
    tokens_in_progress: float
    tokens_processed: float  # integral of the serving rate: must equal the three above
    jobs_completed: int
    job_seconds: list[float]  # service time of each completed job (restarts included)
    token_latency_s: list[float]  # per-token pipeline latency, sampled over time
    ttft_s: list[float]  # inference: time to the first token of each completed job
    throughput_tokens_s: float
    samples_s: float  # sequences per second (inference) or training samples per second
    utilization: float  # time-averaged share of online providers serving a stage
    replica_downtime_s: float  # replica-seconds not serving after startup (repairs, reloads)
    replica_seconds: float  # replica-seconds placed after startup
    startup_s: float  # seconds until every replica of the first placement serves
    quits: int
    joins: int  # rejoins and newcomers
    departures: int  # quits that never came back
    arrivals: int  # newcomers over the run
    replans: int
    rebalances: int
    cost_usd: float
    cost_per_mtok_usd: float
    timeline: list[tuple[float, float, int, int]]  # (t, tokens/s, serving replicas, online)
    log: list[dict[str, Any]]
    events_run: int

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return math.nan
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def lost_share(self) -> float:
        """Replica-seconds lost to churn over the replica-seconds placed since startup."""
        return self.replica_downtime_s / self.replica_seconds if self.replica_seconds else 0.0

    def summary(self) -> dict[str, Any]:
        """Figures as JSON-safe values (None where undefined, e.g. no job completed)."""
        return {k: _finite(v) for k, v in self._summary().items()}

    def _summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "peers": self.scenario.peers,
            "gpus": self.scenario.gpus,
            "network": self.scenario.network,
            "workload": self.scenario.workload,
            "churn": self.scenario.churn.name,
            "hours": self.scenario.hours,
            "seed": self.scenario.seed,
            "throughput_tokens_s": round(self.throughput_tokens_s, 3),
            "samples_s": round(self.samples_s, 4),
            "job_seconds_p50": round(self.percentile(self.job_seconds, 0.5), 3),
            "job_seconds_p95": round(self.percentile(self.job_seconds, 0.95), 3),
            "job_seconds_p99": round(self.percentile(self.job_seconds, 0.99), 3),
            "token_latency_ms_p50": round(1e3 * self.percentile(self.token_latency_s, 0.5), 3),
            "token_latency_ms_p95": round(1e3 * self.percentile(self.token_latency_s, 0.95), 3),
            "ttft_ms_p50": round(1e3 * self.percentile(self.ttft_s, 0.5), 3),
            "ttft_ms_p95": round(1e3 * self.percentile(self.ttft_s, 0.95), 3),
            "utilization": round(self.utilization, 4),
            "time_lost_to_churn": round(self.lost_share(), 4),
            "replica_downtime_s": round(self.replica_downtime_s, 1),
            "startup_s": round(self.startup_s, 1),
            "tokens_completed": round(self.tokens_completed),
            "tokens_lost": round(self.tokens_lost),
            "jobs_completed": self.jobs_completed,
            "quits": self.quits,
            "joins": self.joins,
            "arrivals": self.arrivals,
            "departures": self.departures,
            "replans": self.replans,
            "rebalances": self.rebalances,
            "cost_usd": round(self.cost_usd, 4),
            "cost_per_mtok_usd": round(self.cost_per_mtok_usd, 4),
            "events": self.events_run,
        }


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
