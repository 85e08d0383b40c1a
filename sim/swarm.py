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
from broker.placement import Placement, PlacementConfig, PlacementError, Replica
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
    placement: str = "ours"  # "ours" or "equal" (an even split over everyone, one pipeline)
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
        if self.placement not in ("ours", "equal"):
            raise ValueError(f"placement must be 'ours' or 'equal', got {self.placement!r}")
        workload(self.workload)  # raises on an unknown workload


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
    rate: float  # tokens/s while serving
    latency: float  # seconds per token through the pipeline
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
    throughput_tokens_s: float
    samples_s: float  # sequences per second (inference) or training samples per second
    utilization: float  # time-averaged share of online providers serving a stage
    replica_downtime_s: float  # replica-seconds lost to repairs and reloads (not startup)
    startup_s: float  # seconds until every replica of the first placement serves
    quits: int
    joins: int
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

    def _lost_share(self) -> float:
        """Replica-seconds lost to churn over the replica-seconds the run could serve."""
        peak = max((t[2] for t in self.timeline), default=0)
        return self.replica_downtime_s / (self.duration_s * peak) if peak else 0.0

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
            "utilization": round(self.utilization, 4),
            "time_lost_to_churn": round(
                self.replica_downtime_s
                / max(
                    1e-9,
                    self.duration_s
                    * max(1, len(self.timeline) and max(t[2] for t in self.timeline)),
                ),
                4,
            ),
            "replica_downtime_s": round(self.replica_downtime_s, 1),
            "startup_s": round(self.startup_s, 1),
            "tokens_completed": round(self.tokens_completed),
            "tokens_lost": round(self.tokens_lost),
            "jobs_completed": self.jobs_completed,
            "quits": self.quits,
            "joins": self.joins,
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
        for i in range(scenario.peers):
            gpu = GPUS[self.rng.choices(names, weights)[0]]
            up, down = network.draw(self.rng)
            peer = f"{gpu.name}-{i}"
            self.profiles[peer] = profile(gpu, up, network.rtt)
            self.download[peer] = down
            self.power[peer] = gpu.power_w
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
        self.downtime = 0.0
        self.startup = 0.0  # seconds until the first placement serves fully
        self.quits = self.joins = self.replans = self.rebalances = 0
        self.busy_integral = 0.0  # provider-seconds serving a stage
        self.online_integral = 0.0  # provider-seconds online
        self.gpu_energy_j = 0.0
        self._last_account = 0.0
        self.timeline: list[tuple[float, float, int, int]] = []
        self._step_cache: dict[tuple[tuple[str, int, int], ...], float] = {}

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
        dt = now - self._last_account
        if dt > 0:
            serving = self._serving_providers(now)
            self.busy_integral += serving * dt
            self.online_integral += len(self.online) * dt
            self.gpu_energy_j += sum(self.power[p] for p in self.online) * dt
            self._last_account = now

    def _serving_providers(self, now: float) -> int:
        if self.placement is None:
            return 0
        return sum(
            len(rep.stages)
            for rep, run in zip(self.placement.replicas, self.runs, strict=True)
            if run.ready_at <= now
        )

    def _metrics(self, replica: Replica) -> tuple[float, float]:
        """(tokens/s, seconds per token) of a replica, allreduce included for training."""
        stages = [(self.profiles[st.provider], st.layers) for st in replica.stages]
        m = pipeline_metrics(self.model, stages, self.w.work)
        if self.w.kind == "inference":
            return m.throughput, m.latency
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
        return self.w.job_tokens / step, m.latency

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
            rate, latency = self._metrics(rep)
            run = _ReplicaRun(self.next_replica, now + max(loads), rate, latency, last=now)
            if reason == "placed" and now == 0.0:
                self.startup = max(self.startup, max(loads))  # first download: not churn
            else:
                self.downtime += max(loads)
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
            if self.placement is None:
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
                self.downtime += delay + (self.s.detect_s if crashed else 0.0)
                entry["delay_s"] = delay
        self.placement = repair.placement
        for run, rep in zip(self.runs, self.placement.replicas, strict=True):
            old_rate = run.rate
            run.rate, run.latency = self._metrics(rep)
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
        for peer in self.profiles:
            self._join(peer, first=True)
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
            throughput_tokens_s=(self.completed + in_progress) / end,
            samples_s=(self.completed + in_progress) / end / self._tokens_per_sample(),
            utilization=self.busy_integral / self.online_integral if self.online_integral else 0.0,
            replica_downtime_s=self.downtime,
            startup_s=self.startup,
            quits=self.quits,
            joins=self.joins,
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
