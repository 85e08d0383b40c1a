"""Simulate a swarm on a virtual clock, driving the broker's own decision core.

Providers come and go by a churn model. For the broker's placement ("ours") every join, quit,
stage load and job goes to `broker.core.Core` through `sim.driver.Driver`, with the same
configuration types the broker uses (`CoreConfig`: the pool's heartbeats and flapping, the
placement's work and backups, the queue policy, rebalancing); the simulator only models what
the core's actions take: a stage's download and load (`AssignStage`), a warm backup's switch
(`PromoteStage`), a crash noticed after the pool's detection time (`PoolConfig.detection_s`).
A replica serves once the core has every one of its stages confirmed; jobs start when the
core's queue says (`StartJob`). The baselines ("equal": one even split re-made after every
loss; "petals": servers pick their own blocks) make no broker decisions. Costs come from
`dag.cost`.

Work is modelled as jobs (a batch of sequences to decode, or one optimizer step) served by
pipeline replicas at their rate between events: no event per token. A replica whose stage is
being taken over or reloaded serves nothing until the stage is ready; the job it was running
waits for a replica again and the work done on it is counted as lost. A ledger checks that
every token of work is completed, lost or in progress exactly once.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from broker.core.events import (
    HeartbeatsMissed,
    Input,
    JobEnded,
    JobQueued,
    ModelAdded,
    ProviderJoined,
    ProviderLeft,
    RebalanceCheck,
)
from broker.core.placement import Placement, PlacementConfig, PlacementError, Replica, equal_split
from broker.core.pool import PoolState
from dag.cost import HardwareProfile
from sim import brokered, petals, population
from sim.driver import Driver
from sim.engine import Engine
from sim.rates import ReplicaRates
from sim.result import SimResult
from sim.scenario import Scenario
from sim.work import Job, ReplicaRun
from sim.workloads import WorkloadSpec


class SwarmSim:
    """One run of a scenario. `run()` returns a `SimResult`."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.w: WorkloadSpec = scenario.spec
        self.model = self.w.placed_model
        self.rng = random.Random(scenario.seed)
        self.engine = Engine()
        self.config = PlacementConfig(work=self.w.work, backup_fraction=scenario.backup_fraction)
        self.driver = Driver(scenario.core_config(self.config))
        self.ours = scenario.placement == "ours"
        self.keys = tuple(f"{self.model.name}/{i}" for i in range(self.model.n_layers))
        people = population.draw(scenario, self.rng)
        self.profiles: dict[str, HardwareProfile] = people.profiles
        self.download: dict[str, float] = people.download
        self.power: dict[str, float] = people.power
        self.initial = people.initial
        self.arrivals: list[tuple[float, str]] = people.arrivals
        self.rates = ReplicaRates(self.w, self.profiles)
        self.online: set[str] = set()
        self.session: dict[str, int] = {}  # peer -> its current online session's number
        self.placement: Placement | None = None
        self.runs: list[ReplicaRun] = []
        self.runs_of: dict[str, list[ReplicaRun]] = {}  # provider -> the runs it is part of
        self.loading: dict[tuple[str, str], int] = {}  # (peer, unit) -> the load under way
        self.pending_crash: dict[str, int] = {}  # crashed peers not noticed yet -> token
        self.next_token = 0
        self.waiting: list[Job] = []  # jobs due to run, waiting for a serving replica
        self.jobs: dict[str, Job] = {}  # the broker's job ids -> jobs
        self.next_job = 0
        self.next_replica = 0
        self._inbox: deque[Input] = deque()
        self._touched: set[str] = set()  # providers whose stages changed since the last check
        self._handling = False
        self.log: list[dict[str, Any]] = []
        self.completed = self.lost = self.processed = 0.0
        self.jobs_done = 0
        self.job_seconds: list[float] = []
        self.token_latency: list[float] = []
        self.ttft: list[float] = []  # per completed inference job: queueing + prefill
        self.downtime = 0.0  # replica-seconds not serving after startup
        self.replica_seconds = 0.0  # replica-seconds placed after startup
        # seconds until the first placement serves fully (accounting starts then)
        self.startup = 0.0 if scenario.placement == "petals" else math.inf
        self._placed = False  # a placement was made
        self._first: set[int] = set()  # runs of the first placement not serving yet
        self.quits = self.joins = self.replans = self.rebalances = self.departures = 0
        self.busy_integral = 0.0  # provider-seconds serving a stage
        self.online_integral = 0.0  # provider-seconds online
        self.gpu_energy_j = 0.0
        self._last_account = 0.0
        self.timeline: list[tuple[float, float, int, int]] = []
        self.spans: dict[str, tuple[int, int]] = {}  # petals: online server -> its blocks
        self.span_ready: dict[str, float] = {}  # petals: when each server's span serves
        self._idle_since: float | None = None  # petals: since when no chain covers the model

    @property
    def pool(self) -> PoolState:
        """The broker's view of the providers."""
        return self.driver.core.pool

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
        return sum(len(run.layout) for run in self.runs if run.ready_at <= now)

    # ---- jobs ---------------------------------------------------------------------------

    def _new_job(self) -> Job:
        job = Job(self.next_job, float(self.w.job_tokens))
        self.next_job += 1
        return job

    def _queue_job(self) -> None:
        """Demand saturates: the broker's queue always holds a job."""
        job = self._new_job()
        self.jobs[job.key] = job
        now = self.engine.now
        self._inbox.append(JobQueued(job.key, self.model.name, now, job.tokens, now))

    def _dispatch(self, run: ReplicaRun, now: float) -> None:
        """Give an idle, serving replica the next job: one the broker started (the baselines
        have no queue: a new one)."""
        if math.isinf(run.ready_at):
            return  # not serving (yet, or until a repair)
        if run.job is None:
            if self.waiting:
                run.job = self.waiting.pop(0)
            elif not self.ours:
                run.job = self._new_job()
            else:
                return
            run.job.started = max(now, run.ready_at)
            if run.job.first_started is None:
                run.job.first_started = now  # job time counts from its first assignment
        self._schedule_completion(run, now)

    def _schedule_completion(self, run: ReplicaRun, now: float) -> None:
        run.version += 1
        if run.job is None or run.rate <= 0:
            return
        start = max(now, run.ready_at)
        finish = start + (run.job.tokens - run.job.done) / run.rate
        self.engine.at(finish, self._complete, run, run.version)

    def _complete(self, run: ReplicaRun, version: int) -> None:
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
        if self.ours:
            self.jobs.pop(job.key, None)
            brokered.tell(self, JobEnded(job.key, now))
        self._dispatch(run, now)

    def _interrupt(self, run: ReplicaRun) -> None:
        """The replica stops serving: its job's progress is lost and the job waits again."""
        if run.job is not None:
            self.lost += run.job.done
            run.job.done = 0.0
            self.waiting.insert(0, run.job)
            run.job = None
        run.version += 1

    def _ready(self, run: ReplicaRun, now: float) -> None:
        self._advance(now)
        run.ready_at = now
        self._first.discard(run.id)
        self._check_startup(now)
        self._dispatch(run, now)

    def _check_startup(self, now: float) -> None:
        if math.isinf(self.startup) and self._placed and not self._first:
            self.startup = now  # every replica of the first placement serves

    # ---- placement ----------------------------------------------------------------------

    def _set_placement(
        self, new: Placement | None, now: float, ready: Callable[[Replica], float] | None
    ) -> None:
        """Follow a new placement: replicas laid out as before keep serving; others wait until
        `ready(replica)` (None: until the core confirms every stage)."""
        self._advance(now)
        first = new is not None and not self._placed
        self._placed = self._placed or first
        self.placement = new  # (a training step's all-reduce depends on the replica count)
        kept = {run.layout: run for run in self.runs}
        runs = []
        for rep in new.replicas if new is not None else ():
            layout = tuple((st.provider, st.first, st.end) for st in rep.stages)
            run = kept.pop(layout, None)
            if run is None:
                rate, latency, ttft = self.rates.metrics(rep, len(new.replicas) if new else 1)
                at = math.inf if ready is None else ready(rep)
                run = ReplicaRun(
                    self.next_replica, at, rate, latency, ttft, last=now, layout=layout
                )
                self.next_replica += 1
                if first:
                    self._first.add(run.id)
            runs.append(run)
        for run in kept.values():
            self._interrupt(run)
            self._first.discard(run.id)
        self.runs = runs
        self.runs_of = {}
        for run in runs:
            for peer, _, _ in run.layout:
                self.runs_of.setdefault(peer, []).append(run)
        if first and ready is not None:  # a baseline: it serves when its loads are done
            self.startup = max((run.ready_at for run in runs), default=now)
            self._first.clear()
        for run in runs:
            if math.isinf(run.ready_at) and ready is None and brokered.confirmed(self, run):
                run.ready_at = now
                self._first.discard(run.id)
            self._dispatch(run, now)
        self._check_startup(now)

    def _online_profiles(self) -> dict[str, HardwareProfile]:
        return {p: self.profiles[p] for p in sorted(self.online)}

    def _load_seconds(self, peer: str, layers: int) -> float:
        return layers * self.w.model.layer_param_bytes / self.download[peer] + self.s.load_s

    def _equal_split(self, now: float, reason: str) -> None:
        """The baseline: one pipeline over everyone online, blocks split evenly."""
        try:
            new = equal_split(self.model, self._online_profiles(), self.config)
        except PlacementError as exc:
            self.log.append({"t": now, "event": "unplaceable", "reason": str(exc)})
            new = None
        held = {run.layout for run in self.runs}
        held_stages = {stage for layout in held for stage in layout}

        def ready(rep: Replica) -> float:
            loads = [
                0.0
                if (st.provider, st.first, st.end) in held_stages
                else self._load_seconds(st.provider, st.layers)
                for st in rep.stages
            ]
            return now + max(loads)

        if reason == "resplit":
            self.replans += 1
        self._set_placement(new, now, ready)
        if new is not None:
            self.log.append(
                {"t": now, "event": reason, "replicas": 1, "throughput": new.throughput}
            )

    # ---- churn --------------------------------------------------------------------------

    def _join(self, peer: str, first: bool = False) -> None:
        now = self.engine.now
        self._advance(now)
        self.pending_crash.pop(peer, None)  # back before its crash was noticed
        self.online.add(peer)
        self.session[peer] = self.session.get(peer, 0) + 1
        if self.ours:
            brokered.tell(self, ProviderJoined(peer, self.profiles[peer], now))
        if not first:
            self.joins += 1
            if self.s.placement == "petals":
                petals.join(self, peer, now)
            elif self.s.placement == "equal" and self.placement is None:
                self._equal_split(now, "placed")
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
            petals.refresh(self)
        self._advance(now)
        self.online.discard(peer)
        self.quits += 1
        for run in self.runs_of.get(peer, []):  # its replicas stop serving at once
            self._interrupt(run)
            run.ready_at = math.inf
        if crash:  # noticed only after the heartbeats stop
            self.pending_crash[peer] = token = self.next_token
            self.next_token += 1
            detect = self.driver.core.config.pool.detection_s
            self.engine.at(now + detect, self._detect, peer, token)
        else:
            self._lost(peer, crashed=False)
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
            self._lost(peer, crashed=True)

    def _lost(self, peer: str, crashed: bool) -> None:
        now = self.engine.now
        if self.ours:
            brokered.tell(self, HeartbeatsMissed(peer, now) if crashed else ProviderLeft(peer, now))
        elif self.placement is not None and peer in self.placement.providers():
            self._equal_split(now, "resplit")  # the baseline has no repair: it re-splits

    def _rebalance_check(self) -> None:
        now = self.engine.now
        brokered.tell(self, RebalanceCheck(now))
        self.engine.at(now + self.driver.core.config.rebalance_every_s, self._rebalance_check)

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
            petals.start(self, 0.0)
        elif self.ours:
            self._queue_job()
            brokered.tell(self, ModelAdded(self.model.name, self.model, self.keys, 0.0))
            self.engine.at(self.driver.core.config.rebalance_every_s, self._rebalance_check)
        else:
            self._equal_split(0.0, "placed")
        self.engine.at(0.0, self._sample)
        last_report = [0.0]

        def progress(now: float) -> None:
            if on_progress is not None and now - last_report[0] >= end / 100:
                last_report[0] = now
                on_progress(now / end)

        self.engine.run(end, progress)
        self._advance(end)
        if math.isinf(self.startup):  # the first placement never served whole (or none)
            self.startup = end if self._placed else 0.0
        if self._idle_since is not None:
            self.downtime += end - self._idle_since
        in_progress = sum(run.job.done for run in self.runs if run.job is not None)
        in_progress += sum(job.done for job in self.waiting)
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
