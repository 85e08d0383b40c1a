"""Simulate a swarm on a virtual clock, driving the broker's real cores.

Providers come and go by a churn model. Every join and quit goes through `broker.pool.apply`;
a lost stage is repaired by `broker.replan.on_leave`, a newcomer placed by `broker.replan.on_join`,
and every `rebalance_every` seconds `broker.placement.place` proposes a fresh placement that
is adopted only if `broker.replan.should_rebalance` says it pays. Costs come from `dag.cost`.

Work is modelled as jobs (a batch of sequences to decode, or one optimizer step) served by
pipeline replicas at their rate between events: no event per token. A replica whose stage is
being taken over or reloaded serves nothing until the stage is ready; the job it was running
goes back to the queue and the work done on it is counted as lost. A ledger checks that every
token of work is completed, lost or in progress exactly once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker import placement as placement_mod
from broker.placement import (
    Placement,
    PlacementConfig,
    PlacementError,
    Replica,
    petals_block_rates,
    petals_spans,
)
from broker.pool import (
    HeartbeatsMissed,
    PoolConfig,
    PoolState,
    ProviderJoined,
    ProviderLeft,
    StageAssigned,
    StageReady,
    apply,
)
from broker.replan import on_join, on_leave, should_rebalance
from dag.builders import finetune
from dag.cost import HardwareProfile, pipeline_metrics, schedule_length
from sim.catalog import CHURN, GPUS, NETWORKS, Churn, profile
from sim.engine import Engine
from sim.workloads import WorkloadSpec, workload

PLACEMENTS = ("ours", "equal", "petals")
PETALS_BALANCE_CHECK_S = 120.0  # Petals servers' mean balance check period (its default)
PETALS_BALANCE_QUALITY = 0.75  # a server moves if that raises swarm throughput by > 1/0.75


@dataclass(frozen=True)
class Scenario:
    name: str = "custom"
    peers: int = 50
    gpus: dict[str, float] = field(default_factory=lambda: {"rtx3080": 1.0})  # mix by weight
    network: str = "home-broadband"
    workload: str = "llama2-7b-inference"
    hours: float = 1.0
    churn: Churn = field(default_factory=lambda: CHURN["none"])
    seed: int = 0
    # "ours", "equal" (an even split over everyone, one pipeline) or "petals" (servers pick
    # their own blocks, Petals-style; inference only)
    placement: str = "ours"
    backup_fraction: float = 0.1  # share of providers kept as backups when possible
    crash_fraction: float = 0.5  # quits that are crashes (found by missed heartbeats)
    detect_s: float = 15.0  # seconds to notice a crash (3 missed 5-second heartbeats)
    failover_s: float = 5.0  # seconds for a warm backup to start serving
    load_s: float = 10.0  # seconds to load a stage once its weights are local
    rebalance_every_s: float = 600.0  # how often a full re-placement is considered
    energy_usd_per_kwh: float = 0.15  # electricity price
    rent_usd_per_gpu_hour: float = 0.0  # rental price (0 for contributed machines)
    sample_every_s: float = 60.0  # spacing of the time series in the result

    def __post_init__(self) -> None:
        unknown = [g for g in self.gpus if g not in GPUS]
        if unknown:
            raise ValueError(f"unknown GPUs {unknown}; known: {sorted(GPUS)}")
        if self.network not in NETWORKS:
            raise ValueError(f"unknown network {self.network!r}; known: {sorted(NETWORKS)}")
        if self.peers < 1 or self.hours <= 0:
            raise ValueError("a scenario needs at least one peer and a positive duration")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        kind = workload(self.workload).kind  # raises on an unknown workload
        if self.placement == "petals" and kind != "inference":
            raise ValueError("the Petals-style baseline serves inference workloads only")


@dataclass
class _Job:
    id: int
    tokens: float
    done: float = 0.0  # tokens of progress since it (re)started
    started: float = 0.0
    first_started: float | None = None


@dataclass
class _ReplicaRun:
    id: int
    ready_at: float  # serving from this time
    rate: float  # tokens/s while serving (inference: prefill and decode averaged)
    latency: float  # seconds per decode step through the pipeline
    ttft: float  # seconds from a job's start to its first token (prefill; 0 for training)
    job: _Job | None = None
    last: float = 0.0  # time its progress was last advanced
    version: int = 0  # invalidates scheduled completions when the rate or job changes


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


class SwarmSim:
    """One run of a scenario. `run()` returns a `SimResult`."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.w: WorkloadSpec = workload(scenario.workload)
        self.model = self.w.placed_model
        self.rng = random.Random(scenario.seed)
        self.engine = Engine()
        self.config = PlacementConfig(work=self.w.work, backup_fraction=scenario.backup_fraction)
        network = NETWORKS[scenario.network]
        names, weights = zip(*sorted(scenario.gpus.items()), strict=True)
        self.profiles: dict[str, HardwareProfile] = {}
        self.download: dict[str, float] = {}
        self.power: dict[str, float] = {}

        def recruit(i: int) -> str:
            gpu = GPUS[self.rng.choices(names, weights)[0]]
            up, down = network.draw(self.rng)
            peer = f"{gpu.name}-{i}"
            self.profiles[peer] = profile(gpu, up, network.rtt)
            self.download[peer] = down
            self.power[peer] = gpu.power_w
            return peer

        self.initial = [recruit(i) for i in range(scenario.peers)]
        # Newcomers: a Poisson process over the run, drawn up front so a seed fixes them.
        self.arrivals: list[tuple[float, str]] = []
        rate = scenario.peers * scenario.churn.arrivals_per_peer_hour / 3600.0
        t = 0.0
        while rate > 0:
            t += self.rng.expovariate(rate)
            if t >= scenario.hours * 3600.0:
                break
            self.arrivals.append((t, recruit(scenario.peers + len(self.arrivals))))
        self.pool = PoolState(config=PoolConfig())
        self.online: set[str] = set()
        self.placement: Placement | None = None
        self.runs: list[_ReplicaRun] = []
        self.warm: dict[str, tuple[int, int]] = {}  # backup -> block range it has loaded
        self.assigned: dict[str, tuple[str, bool]] = {}  # what the pool was last told
        self.pending_crash: dict[str, int] = {}  # crashed peers not noticed yet -> token
        self.next_token = 0
        self.queue: list[_Job] = []
        self.next_job = 0
        self.next_replica = 0
        self.log: list[dict[str, Any]] = []
        self.completed = self.lost = self.processed = 0.0
        self.jobs_done = 0
        self.job_seconds: list[float] = []
        self.token_latency: list[float] = []
        self.ttft: list[float] = []  # per completed inference job: queueing + prefill
        self.downtime = 0.0  # replica-seconds not serving after startup
        self.replica_seconds = 0.0  # replica-seconds placed after startup
        self.startup = 0.0  # seconds until the first placement serves fully
        self.quits = self.joins = self.replans = self.rebalances = self.departures = 0
        self.busy_integral = 0.0  # provider-seconds serving a stage
        self.online_integral = 0.0  # provider-seconds online
        self.gpu_energy_j = 0.0
        self._last_account = 0.0
        self.timeline: list[tuple[float, float, int, int]] = []
        self._step_cache: dict[tuple[tuple[str, int, int], ...], float] = {}
        self.spans: dict[str, tuple[int, int]] = {}  # petals: online server -> its blocks
        self.span_ready: dict[str, float] = {}  # petals: when each server's span serves
        self._idle_since: float | None = None  # petals: since when no chain covers the model

    # ---- accounting --------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Bring every replica's progress and the integrals up to `now`."""
        for run in self.runs:
            start = max(run.last, run.ready_at)
            if now > start and run.job is not None:
                done = run.rate * (now - start)
                run.job.done += done
                self.processed += done
            run.last = max(run.last, now)
        a = max(self._last_account, self.startup)
        if now > a:
            for run in self.runs:
                self.downtime += max(0.0, min(now, run.ready_at) - a)
            self.replica_seconds += len(self.runs) * (now - a)
        dt = now - self._last_account
        if dt > 0:
            serving = self._serving_providers(now)
            self.busy_integral += serving * dt
            self.online_integral += len(self.online) * dt
            self.gpu_energy_j += sum(self.power[p] for p in self.online) * dt
            self._last_account = now

    def _serving_providers(self, now: float) -> int:
        if self.s.placement == "petals":
            return sum(1 for ready in self.span_ready.values() if ready <= now)
        if self.placement is None:
            return 0
        return sum(
            len(rep.stages)
            for rep, run in zip(self.placement.replicas, self.runs, strict=True)
            if run.ready_at <= now
        )

    def _metrics(self, replica: Replica) -> tuple[float, float, float]:
        """(tokens/s, seconds per token, seconds to the first token) of a replica: for
        inference, jobs' prefill passes and decode steps share the stages; for training, the
        optimizer step with its allreduce (no first token: 0)."""
        stages = [(self.profiles[st.provider], st.layers) for st in replica.stages]
        m = pipeline_metrics(self.model, stages, self.w.work)
        if self.w.kind == "inference":
            # Jobs in flight keep the pipeline full: each stage's busy time per job is its
            # share of the prefill pass plus its decode steps, and the busiest stage sets the
            # rate. The first token waits for the prefill's trip through every stage.
            prefill = pipeline_metrics(self.model, stages, self.w.prefill_work)
            busy = max(
                p + self.w.microbatches * d
                for p, d in zip(prefill.stage_times, m.stage_times, strict=True)
            )
            rate = self.w.job_tokens / busy if busy > 0 else 0.0
            return rate, m.latency, prefill.latency + m.latency
        step = self._step_seconds(replica)
        replicas = len(self.placement.replicas) if self.placement else 1
        if replicas > 1:
            share = 2 * (replicas - 1) / replicas
            step += max(
                share
                * st.layers
                * self.w.allreduce_bytes_per_block()
                / self.profiles[st.provider].net_bandwidth
                for st in replica.stages
            )
        return self.w.job_tokens / step, m.latency, 0.0

    def _step_seconds(self, replica: Replica) -> float:
        """One optimizer step of this replica: `dag.builders.finetune`'s graph (forward and
        backward of every microbatch, then the update) scheduled on its machines with
        `dag.cost.schedule_length`. Memoised per layout: repairs change one replica."""
        key = tuple((st.provider, st.first, st.end) for st in replica.stages)
        cached = self._step_cache.get(key)
        if cached is not None:
            return cached
        spans = [(st.first, st.end) for st in replica.stages]
        seq = self.w.work.tokens // self.w.work.sequences
        adapter = [self.w.allreduce_bytes_per_block() * (e - f) for f, e in spans]
        graph = finetune(
            self.w.model,
            spans,
            microbatches=self.w.microbatches,
            batch=self.w.work.sequences,
            seq=seq,
            adapter_bytes=adapter,
        )
        machines = {i: st.provider for i, st in enumerate(replica.stages)}
        step = schedule_length(
            graph,
            lambda t: machines[t.stage] if t.stage is not None else None,
            self.profiles,
            self.w.work.dtype,
        )
        self._step_cache[key] = step
        return step

    # ---- jobs ---------------------------------------------------------------------------

    def _new_job(self) -> _Job:
        job = _Job(self.next_job, float(self.w.job_tokens))
        self.next_job += 1
        return job

    def _dispatch(self, run: _ReplicaRun, now: float) -> None:
        """Give an idle replica the next job (the queue is never empty: demand saturates)."""
        if math.isinf(run.ready_at):
            return  # broken until a repair: it takes no job
        if run.job is None:
            run.job = self.queue.pop(0) if self.queue else self._new_job()
            run.job.started = max(now, run.ready_at)
            if run.job.first_started is None:
                run.job.first_started = now  # job time counts from its first assignment
        self._schedule_completion(run, now)

    def _schedule_completion(self, run: _ReplicaRun, now: float) -> None:
        run.version += 1
        if run.job is None or run.rate <= 0:
            return
        start = max(now, run.ready_at)
        finish = start + (run.job.tokens - run.job.done) / run.rate
        self.engine.at(finish, self._complete, run, run.version)

    def _complete(self, run: _ReplicaRun, version: int) -> None:
        if version != run.version or run not in self.runs or run.job is None:
            return
        now = self.engine.now
        self._advance(now)
        job = run.job
        self.completed += job.tokens
        self.processed += job.tokens - job.done  # rounding: the finish time is exact
        self.jobs_done += 1
        self.job_seconds.append(now - (job.first_started or now))
        if self.w.kind == "inference":
            self.ttft.append(job.started - (job.first_started or job.started) + run.ttft)
        run.job = None
        self._dispatch(run, now)

    def _interrupt(self, run: _ReplicaRun) -> None:
        """The replica stops serving: its job's progress is lost and the job requeued."""
        if run.job is not None:
            self.lost += run.job.done
            run.job.done = 0.0
            self.queue.insert(0, run.job)
            run.job = None
        run.version += 1

    # ---- placement ----------------------------------------------------------------------

    def _online_profiles(self) -> dict[str, HardwareProfile]:
        return {p: self.profiles[p] for p in sorted(self.online)}

    def _place(self) -> Placement | None:
        online = self._online_profiles()
        try:
            if self.s.placement == "equal":
                return placement_mod.equal_split(self.model, online, self.config)
            return placement_mod.place(self.model, online, self.config)
        except PlacementError as exc:
            self.log.append({"t": self.engine.now, "event": "unplaceable", "reason": str(exc)})
            return None

    def _load_seconds(self, peer: str, layers: int) -> float:
        return layers * self.w.model.layer_param_bytes / self.download[peer] + self.s.load_s

    def _adopt(self, new: Placement | None, now: float, reason: str) -> None:
        """Replace the whole placement: every replica reloads what it does not already serve."""
        old_assignments = (
            {
                (st.provider, st.first, st.end)
                for rep in self.placement.replicas
                for st in rep.stages
            }
            if self.placement
            else set()
        )
        for run in self.runs:
            self._interrupt(run)
        self.placement = new
        self.runs = []
        if new is None:
            return
        for rep in new.replicas:
            loads = [
                0.0
                if (st.provider, st.first, st.end) in old_assignments
                else self._load_seconds(st.provider, st.layers)
                for st in rep.stages
            ]
            rate, latency, ttft = self._metrics(rep)
            run = _ReplicaRun(self.next_replica, now + max(loads), rate, latency, ttft, last=now)
            if reason == "placed" and now == 0.0:
                self.startup = max(self.startup, max(loads))  # first download: not churn
            self.next_replica += 1
            self.runs.append(run)
            self._dispatch(run, now)
        self._sync_pool(now)
        self.log.append(
            {"t": now, "event": reason, "replicas": len(new.replicas), "throughput": new.throughput}
        )

    def _sync_pool(self, now: float) -> None:
        """Tell the pool who serves and who backs up what (placement decided); only changes
        are sent, as the broker service would."""
        if self.placement is None:
            return
        for rep, run in zip(self.placement.replicas, self.runs, strict=True):
            for st in rep.stages:
                self._assign(st.provider, self._stage_name(run, st.first, st.end), True, now)
        for (r, s), peer in self.placement.backups.items():
            st = self.placement.replicas[r].stages[s]
            name = self._stage_name(self.runs[r], st.first, st.end)
            if self._assign(peer, name, False, now) and self.warm.get(peer) != (st.first, st.end):
                ready = now + self._load_seconds(peer, st.layers)
                self.engine.at(ready, self._backup_ready, peer, name, st.first, st.end)

    @staticmethod
    def _stage_name(run: _ReplicaRun, first: int, end: int) -> str:
        """Replicas may serve the same blocks: the pool needs a name per replica's stage."""
        return f"r{run.id}:{first}-{end}"

    def _assign(self, peer: str, stage: str, active: bool, now: float) -> bool:
        """Send StageAssigned if it changes anything; True if it did."""
        if self.assigned.get(peer) == (stage, active):
            return False
        self.assigned[peer] = (stage, active)
        self.pool, _ = apply(self.pool, StageAssigned(peer, stage, active, now))
        return True

    def _backup_ready(self, peer: str, name: str, first: int, end: int) -> None:
        if peer not in self.online:
            return
        self.warm[peer] = (first, end)
        self.pool, _ = apply(self.pool, StageReady(peer, name, self.engine.now))

    # ---- churn --------------------------------------------------------------------------

    def _join(self, peer: str, first: bool = False) -> None:
        now = self.engine.now
        self._advance(now)
        if self.pending_crash.pop(peer, None) is not None:
            # Back before its crash was noticed: the broker learns of the loss now (as when a
            # restarted provider joins again) and repairs first.
            self._repair(peer, True)
        self.online.add(peer)
        self.pool, _ = apply(self.pool, ProviderJoined(peer, self.profiles[peer], now))
        if not first:
            self.joins += 1
            if self.s.placement == "petals":
                spans = petals_spans(
                    self.model, self._online_profiles(), self.config, existing=self.spans
                )
                if peer in spans:
                    self._petals_load(peer, spans[peer], now)
            elif self.placement is None:
                self._adopt(self._place(), now, "placed")
            elif self.s.placement == "ours":
                self.placement = on_join(
                    self.placement, peer, self.model, self._online_profiles(), self.config
                )
                self._sync_pool(now)
            self.log.append({"t": now, "event": "join", "peer": peer})
        session = self.s.churn.session(self.rng)
        if math.isfinite(session):
            crash = self.rng.random() < self.s.crash_fraction
            self.engine.at(now + session, self._quit, peer, crash)

    def _quit(self, peer: str, crash: bool) -> None:
        now = self.engine.now
        if self.spans.pop(peer, None) is not None:
            # Petals clients route around a failed server at once (replaying the hop's inputs
            # to another server of those blocks): only its share of throughput is gone.
            self.span_ready.pop(peer)
            self._petals_refresh()
        self.online.discard(peer)
        self.warm.pop(peer, None)
        self.assigned.pop(peer, None)
        self.quits += 1
        # A crash is noticed only after the heartbeats stop; meanwhile its replica is broken.
        if crash:
            self._advance(now)
            self._break_replica_of(peer, now, until=math.inf)
            self.pending_crash[peer] = token = self.next_token
            self.next_token += 1
            self.engine.at(now + self.s.detect_s, self._detect, peer, token)
        else:
            self._repair(peer, False)
        if self.s.churn.departure_fraction and self.rng.random() < self.s.churn.departure_fraction:
            self.departures += 1
            self.log.append({"t": now, "event": "departed", "peer": peer})
            return  # gone for good
        offline = self.s.churn.offline(self.rng)
        self.engine.at(now + offline, self._join, peer)

    def _detect(self, peer: str, token: int) -> None:
        """Heartbeats stopped long enough: the crash is noticed (unless already handled)."""
        if self.pending_crash.get(peer) == token:
            del self.pending_crash[peer]
            self._repair(peer, True)

    def _break_replica_of(self, peer: str, now: float, until: float) -> None:
        if self.placement is None:
            return
        for rep, run in zip(self.placement.replicas, self.runs, strict=True):
            if any(st.provider == peer for st in rep.stages):
                self._interrupt(run)
                run.ready_at = until

    def _repair(self, peer: str, crashed: bool) -> None:
        now = self.engine.now
        self._advance(now)
        event = HeartbeatsMissed(peer, now) if crashed else ProviderLeft(peer, now)
        self.pool, actions = apply(self.pool, event)
        if self.placement is None:
            return
        if self.s.placement != "ours":  # the baseline has no repair: re-split over who is left
            if peer in self.placement.providers():
                self._adopt(self._place(), now, "resplit")
            return
        where = [
            (r, s)
            for r, rep in enumerate(self.placement.replicas)
            for s, st in enumerate(rep.stages)
            if st.provider == peer
        ]
        repair = on_leave(self.placement, peer, self.model, self._online_profiles(), self.config)
        entry: dict[str, Any] = {
            "t": now,
            "event": "replan",
            "peer": peer,
            "crash": crashed,
            "pool_actions": [type(a).__name__ for a in actions],
            "moves": [(m.first, m.end, m.source, m.target) for m in repair.moves],
            "dissolved": repair.dissolved,
        }
        if where:
            self.replans += 1
            r = where[0][0]
            run = self.runs[r]
            self._interrupt(run)
            if repair.dissolved:
                self.runs.pop(r)
            else:
                delays = []
                for m in repair.moves:
                    warm = self.warm.get(m.target) == (m.first, m.end)
                    delays.append(
                        self.s.failover_s if warm else self._load_seconds(m.target, m.end - m.first)
                    )
                    self.warm.pop(m.target, None)
                delay = max(delays, default=0.0)
                served = repair.placement.replicas[r].stages
                # Another of its stages may have crashed unnoticed: then it stays broken.
                broken = any(st.provider not in self.online for st in served)
                run.ready_at = math.inf if broken else now + delay
                entry["delay_s"] = delay
        self.placement = repair.placement
        for run, rep in zip(self.runs, self.placement.replicas, strict=True):
            old_rate = run.rate
            run.rate, run.latency, run.ttft = self._metrics(rep)
            if run.rate != old_rate or run.job is None:
                self._advance(now)
                self._dispatch(run, now)
        self._sync_pool(now)
        self.log.append(entry)

    def _rebalance_check(self) -> None:
        now = self.engine.now
        self._advance(now)
        if self.s.placement == "ours" and self.placement is not None:
            candidate = self._place()
            if candidate is not None and should_rebalance(self.placement, candidate):
                self.rebalances += 1
                self._adopt(candidate, now, "rebalance")
        self.engine.at(now + self.s.rebalance_every_s, self._rebalance_check)

    # ---- the Petals-style baseline ------------------------------------------------------
    # Servers pick their own spans (`broker.placement.petals_spans`) and requests route through
    # any chain of them, so the swarm serves at its weakest block's rate. No broker re-plans;
    # servers check every PETALS_BALANCE_CHECK_S whether one of them moving would raise the
    # swarm's throughput enough, and a block nobody serves halts everything until then.
    # Optimistic for the baseline: a quit costs no in-flight work (the replay is free).

    def _petals_start(self, now: float) -> None:
        for peer, span in petals_spans(self.model, self._online_profiles(), self.config).items():
            self._petals_load(peer, span, now, startup=True)
        self.runs = [_ReplicaRun(self.next_replica, now, 0.0, 0.0, 0.0, last=now)]
        self.next_replica += 1
        self._petals_refresh()
        self.engine.at(now + PETALS_BALANCE_CHECK_S, self._petals_balance)

    def _petals_load(
        self, peer: str, span: tuple[int, int], now: float, startup: bool = False
    ) -> None:
        ready = now + self._load_seconds(peer, span[1] - span[0])
        if startup:
            self.startup = max(self.startup, ready - now)
        self.spans[peer] = span
        self.span_ready[peer] = ready
        self.engine.at(ready, self._petals_refresh)

    def _petals_chain(self, ready: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
        """A route through the model: from each block, the server that reaches furthest."""
        chain, block = [], 0
        while block < self.model.n_layers:
            holders = [(end, p) for p, (first, end) in ready.items() if first <= block < end]
            if not holders:
                return []
            end, peer = max(holders)
            chain.append((peer, end - block))
            block = end
        return chain

    def _petals_refresh(self) -> None:
        """Recompute the swarm's rate from the servers whose spans are loaded."""
        now = self.engine.now
        self._advance(now)
        if not self.runs:
            return
        ready = {p: s for p, s in self.spans.items() if self.span_ready[p] <= now}
        profiles = {p: self.profiles[p] for p in ready}
        chain = self._petals_chain(ready)
        run = self.runs[0]
        old = run.rate
        if not chain:
            run.rate = run.latency = run.ttft = 0.0
        else:
            decode = petals_block_rates(self.model, profiles, ready, self.config)
            prefill_config = PlacementConfig(work=self.w.prefill_work)
            prefill = petals_block_rates(self.model, profiles, ready, prefill_config)
            # Each block serves a job's prefill and its decode steps with the same servers.
            per_block = self.w.job_tokens / decode + self.w.prefill_work.tokens / prefill
            run.rate = self.w.job_tokens / float(per_block.max())
            stages = [(self.profiles[p], n) for p, n in chain]
            run.latency = pipeline_metrics(self.model, stages, self.w.work).latency
            run.ttft = (
                pipeline_metrics(self.model, stages, self.w.prefill_work).latency + run.latency
            )
        if run.rate == 0.0 and self._idle_since is None and now >= self.startup:
            self._idle_since = now
        elif run.rate > 0.0 and self._idle_since is not None:
            self.downtime += now - self._idle_since
            self._idle_since = None
        if run.rate != old or run.job is None:
            self._dispatch(run, now)

    def _petals_balance(self) -> None:
        """Petals' rebalancing: the one server whose move helps most moves, if it helps
        by more than 1 / PETALS_BALANCE_QUALITY (or anything, while some block is unserved)."""
        now = self.engine.now
        profiles = self._online_profiles()
        if self.spans:
            current = float(petals_block_rates(self.model, profiles, self.spans, self.config).min())
            best: tuple[float, str, tuple[int, int]] | None = None
            for peer in sorted(self.spans):
                others = {p: s for p, s in self.spans.items() if p != peer}
                moved = petals_spans(self.model, profiles, self.config, existing=others)
                if moved.get(peer, self.spans[peer]) == self.spans[peer]:
                    continue
                after = float(petals_block_rates(self.model, profiles, moved, self.config).min())
                if best is None or after > best[0]:
                    best = (after, peer, moved[peer])
            if best is not None and best[0] > current / PETALS_BALANCE_QUALITY:
                self.rebalances += 1
                self.log.append(
                    {"t": now, "event": "rebalance", "peer": best[1], "span": list(best[2])}
                )
                self._petals_load(best[1], best[2], now)
                self._petals_refresh()
        self.engine.at(now + PETALS_BALANCE_CHECK_S, self._petals_balance)

    def _sample(self) -> None:
        now = self.engine.now
        self._advance(now)
        serving = [run for run in self.runs if run.ready_at <= now]
        self.timeline.append((now, sum(r.rate for r in serving), len(serving), len(self.online)))
        self.token_latency.extend(r.latency for r in serving)
        self.engine.at(now + self.s.sample_every_s, self._sample)

    # ---- run ----------------------------------------------------------------------------

    def run(self, on_progress: Callable[[float], None] | None = None) -> SimResult:
        end = self.s.hours * 3600.0
        for peer in self.initial:
            self._join(peer, first=True)
        for t, peer in self.arrivals:
            self.engine.at(t, self._join, peer)
        if self.s.placement == "petals":
            self._petals_start(0.0)
        else:
            self._adopt(self._place(), 0.0, "placed")
        self.engine.at(self.s.rebalance_every_s, self._rebalance_check)
        self.engine.at(0.0, self._sample)
        last_report = [0.0]

        def progress(now: float) -> None:
            if on_progress is not None and now - last_report[0] >= end / 100:
                last_report[0] = now
                on_progress(now / end)

        self.engine.run(end, progress)
        self._advance(end)
        if self._idle_since is not None:
            self.downtime += end - self._idle_since
        in_progress = sum(run.job.done for run in self.runs if run.job is not None)
        in_progress += sum(job.done for job in self.queue)
        energy_kwh = self.gpu_energy_j / 3.6e6
        cost = (
            energy_kwh * self.s.energy_usd_per_kwh
            + self.s.rent_usd_per_gpu_hour * self.online_integral / 3600
        )
        tokens = self.completed
        return SimResult(
            scenario=self.s,
            duration_s=end,
            tokens_completed=self.completed,
            tokens_lost=self.lost,
            tokens_in_progress=in_progress,
            tokens_processed=self.processed,
            jobs_completed=self.jobs_done,
            job_seconds=self.job_seconds,
            token_latency_s=self.token_latency,
            ttft_s=self.ttft,
            throughput_tokens_s=(self.completed + in_progress) / end,
            samples_s=(self.completed + in_progress) / end / self._tokens_per_sample(),
            utilization=self.busy_integral / self.online_integral if self.online_integral else 0.0,
            replica_downtime_s=self.downtime,
            replica_seconds=self.replica_seconds,
            startup_s=self.startup,
            quits=self.quits,
            joins=self.joins,
            departures=self.departures,
            arrivals=len(self.arrivals),
            replans=self.replans,
            rebalances=self.rebalances,
            cost_usd=cost,
            cost_per_mtok_usd=cost / tokens * 1e6 if tokens else math.inf,
            timeline=self.timeline,
            log=self.log,
            events_run=self.engine.events_run,
        )

    def _tokens_per_sample(self) -> float:
        if self.w.kind == "inference":
            return float(self.w.microbatches)  # a sequence gets one token per step
        return self.w.work.tokens / self.w.work.sequences


def simulate(scenario: Scenario, on_progress: Callable[[float], None] | None = None) -> SimResult:
    return SwarmSim(scenario).run(on_progress)
