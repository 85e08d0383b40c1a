"""Job queue policies behind one interface, and a pure event-driven schedule to compare them.

- `Fifo`: jobs start in arrival order when enough GPUs are free; nobody overtakes.
- `SjfBsbf` (arXiv:2407.13088): shortest job first; a job that cannot start alone may share the
  GPUs of a running job when the estimated benefit is positive: the time it would otherwise
  wait for free GPUs, minus its own slowdown from sharing and the delay it causes the job it
  shares with. Each GPU set is shared by at most two jobs.

`JobQueue` is the broker's queue state: jobs waiting and running per model, who shares whose
route and who holds it; each model's pipeline replicas are its "GPU sets". The decision core
(`broker.core.Core`) asks it what starts whenever jobs or routes change.

`schedule(jobs, gpus, policy)` plays the policy over a job list on a cluster of `gpus` GPUs,
with progress rates (1 alone, 1/slowdown when sharing) between events, and returns each
job's completion time. Pure: no clock; the simulator drives the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol


@dataclass(frozen=True)
class Job:
    id: str
    arrival: float  # seconds
    gpus: int  # GPUs it needs
    duration: float  # seconds it runs alone
    share_slowdown: float = 1.6  # how much slower it runs while sharing its GPUs (< 2: a gain)


@dataclass(frozen=True)
class Running:
    job: Job
    remaining: float  # seconds of solo work left
    partner: str | None = None  # the job it shares its GPUs with
    held: int = 0  # GPUs this job holds (a sharing guest holds none until its host ends)


@dataclass(frozen=True)
class Start:
    job: Job


@dataclass(frozen=True)
class Share:
    job: Job
    host: str  # the running job whose GPUs it shares


Decision = Start | Share


class QueuePolicy(Protocol):
    name: str
    shares: bool  # may start a job on a running job's GPUs (else only on free ones)

    def decide(
        self, now: float, queue: Sequence[Job], running: Sequence[Running], free: int
    ) -> list[Decision]: ...


class Fifo:
    name = "fifo"
    shares = False

    def decide(
        self, now: float, queue: Sequence[Job], running: Sequence[Running], free: int
    ) -> list[Decision]:
        out: list[Decision] = []
        for job in sorted(queue, key=lambda j: (j.arrival, j.id)):
            if job.gpus > free:
                break  # strict order: nobody overtakes the head of the queue
            out.append(Start(job))
            free -= job.gpus
        return out


def _rate(r: Running, running: dict[str, Running]) -> float:
    return 1.0 / r.job.share_slowdown if r.partner is not None else 1.0


def _finish_time(r: Running, running: dict[str, Running]) -> float:
    return r.remaining / _rate(r, running)


class SjfBsbf:
    name = "sjf-bsbf"
    shares = True

    def decide(
        self, now: float, queue: Sequence[Job], running: Sequence[Running], free: int
    ) -> list[Decision]:
        out: list[Decision] = []
        by_id = {r.job.id: r for r in running}
        shared: set[str] = {r.job.id for r in running if r.partner is not None}
        for job in sorted(queue, key=lambda j: (j.duration, j.arrival, j.id)):
            if job.gpus <= free:
                out.append(Start(job))
                free -= job.gpus
                continue
            wait = self._wait_for(job.gpus, free, list(by_id.values()))
            best: tuple[float, str] | None = None
            for host in by_id.values():
                if host.job.id in shared or host.job.gpus < job.gpus:
                    continue
                own_cost = job.duration * (job.share_slowdown - 1)  # extra time sharing costs us
                overlap = min(
                    job.duration * job.share_slowdown, host.remaining * host.job.share_slowdown
                )
                host_delay = overlap * (1 - 1 / host.job.share_slowdown)  # work the host loses
                benefit = wait - own_cost - host_delay
                if benefit > 0 and (best is None or benefit > best[0]):
                    best = (benefit, host.job.id)
            if best is not None:
                out.append(Share(job, best[1]))
                shared |= {job.id, best[1]}
        return out

    @staticmethod
    def _wait_for(gpus: int, free: int, running: list[Running]) -> float:
        """When `gpus` GPUs would be free if nothing new started (estimate)."""
        by_id = {r.job.id: r for r in running}
        releases = []
        for r in running:
            if r.held:
                end = _finish_time(r, by_id)
                if r.partner is not None and r.partner in by_id:
                    end = max(end, _finish_time(by_id[r.partner], by_id))
                releases.append((end, r.held))
        for end, released in sorted(releases):
            free += released
            if free >= gpus:
                return end
        return float("inf")


POLICIES: dict[str, Callable[[], QueuePolicy]] = {"fifo": Fifo, "sjf-bsbf": SjfBsbf}


def policy_named(name: str) -> QueuePolicy:
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown queue policy {name!r}; known: {sorted(POLICIES)}")
    return factory()


@dataclass
class _Started:
    job: Job
    model: str
    done: float = 0.0  # share of its work finished
    partner: str | None = None  # the job it shares its route with
    held: int = 1  # route slots it holds (0: a guest on its partner's)


@dataclass
class JobQueue:
    """Jobs waiting and running, per model (mutable; no clock: times come with the calls)."""

    policy: QueuePolicy
    queued: dict[str, tuple[str, Job]] = field(default_factory=dict)  # job -> (model, job)
    running: dict[str, _Started] = field(default_factory=dict)
    _held: dict[str, int] = field(default_factory=dict)  # model -> route slots held

    def add(self, job: str, model: str, created: float, estimate_s: float) -> None:
        if job in self.running:
            return
        self.queued[job] = (model, Job(job, created, 1, max(1e-6, estimate_s)))

    def progress(self, job: str, done: float) -> None:
        started = self.running.get(job)
        if started is not None:
            started.done = min(1.0, max(0.0, done))

    def end(self, job: str) -> str | None:
        """`job` left the queue or stopped running; the model it ran on, if it ran. A job
        sharing its route carries on, holding the route."""
        self.queued.pop(job, None)
        started = self.running.pop(job, None)
        if started is None:
            return None
        partner = self.running.get(started.partner) if started.partner is not None else None
        if partner is not None:
            partner.partner = None
            partner.held += started.held
        else:
            self._held[started.model] -= started.held
        return started.model

    def busy(self, model: str) -> bool:
        return any(s.model == model for s in self.running.values())

    def held(self, model: str) -> int:
        """Route slots the running jobs on `model` hold."""
        return self._held.get(model, 0)

    def decide(self, now: float, slots: Callable[[str], int]) -> list[tuple[str, str, str | None]]:
        """Jobs to start now, as (job, model, the job whose route it shares or None), for
        each model with `slots(model)` replicas serving it (0: not servable now)."""
        models: dict[str, list[Job]] = {}
        for model, job in sorted(self.queued.values(), key=lambda mj: (mj[1].arrival, mj[1].id)):
            models.setdefault(model, []).append(job)
        out: list[tuple[str, str, str | None]] = []
        for model, jobs in models.items():
            n = slots(model)
            if n <= 0 or (n <= self.held(model) and not self.policy.shares):
                continue  # no free route, and this policy does not share running jobs'
            running = [
                Running(s.job, s.job.duration * (1 - s.done), s.partner, s.held)
                for s in self.running.values()
                if s.model == model
            ]
            free = max(0, n - sum(r.held for r in running))
            for decision in self.policy.decide(now, jobs, running, free):
                host = decision.host if isinstance(decision, Share) else None
                del self.queued[decision.job.id]
                self.running[decision.job.id] = _Started(
                    decision.job, model, partner=host, held=0 if host else 1
                )
                self._held[model] = self.held(model) + (0 if host else 1)
                if host is not None:
                    self.running[host].partner = decision.job.id
                out.append((decision.job.id, model, host))
        return out


def schedule(jobs: Sequence[Job], gpus: int, policy: QueuePolicy) -> dict[str, float]:
    """Completion time of every job under `policy` on `gpus` GPUs."""
    for job in jobs:
        if job.gpus > gpus:
            raise ValueError(f"job {job.id} needs {job.gpus} GPUs; the cluster has {gpus}")
    pending = sorted(jobs, key=lambda j: (j.arrival, j.id))
    queue: list[Job] = []
    running: dict[str, Running] = {}
    done: dict[str, float] = {}
    now = 0.0
    free = gpus
    while pending or queue or running:
        while pending and pending[0].arrival <= now + 1e-12:
            queue.append(pending.pop(0))
        for decision in policy.decide(now, queue, list(running.values()), free):
            queue.remove(decision.job)
            if isinstance(decision, Start):
                running[decision.job.id] = Running(
                    decision.job, decision.job.duration, held=decision.job.gpus
                )
                free -= decision.job.gpus
            else:
                host = running[decision.host]
                running[decision.host] = replace(host, partner=decision.job.id)
                running[decision.job.id] = Running(
                    decision.job, decision.job.duration, partner=decision.host
                )
        next_arrival = pending[0].arrival if pending else float("inf")
        next_finish = min(
            (_finish_time(r, running) for r in running.values()), default=float("inf")
        )
        step = min(next_arrival - now, next_finish)
        if step == float("inf"):
            raise RuntimeError(f"{policy.name}: jobs {[j.id for j in queue]} can never start")
        for job_id, r in list(running.items()):
            running[job_id] = replace(r, remaining=r.remaining - step * _rate(r, running))
        now += step
        for job_id in list(running):
            current = running.get(job_id)  # current state: a partner's end may have changed it
            if current is not None and current.remaining <= 1e-9:
                done[job_id] = now
                del running[job_id]
                partner = running.get(current.partner) if current.partner is not None else None
                if partner is not None:  # the partner carries on, holding the GPUs
                    running[partner.job.id] = replace(
                        partner, partner=None, held=partner.held + current.held
                    )
                else:
                    free += current.held
    return done


def mean_completion(jobs: Sequence[Job], done: dict[str, float]) -> float:
    """Mean of (completion - arrival) over the jobs."""
    return sum(done[j.id] - j.arrival for j in jobs) / len(jobs)
