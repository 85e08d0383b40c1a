"""Job queue policies behind one interface, and a pure event-driven schedule to compare them.

- `Fifo`: jobs start in arrival order when enough GPUs are free; nobody overtakes.
- `SjfBsbf` (arXiv:2407.13088): shortest job first; a job that cannot start alone may share the
  GPUs of a running job when the estimated benefit is positive: the time it would otherwise
  wait for free GPUs, minus its own slowdown from sharing and the delay it causes the job it
  shares with. Each GPU set is shared by at most two jobs.

`schedule(jobs, gpus, policy)` plays the policy over a job list on a cluster of `gpus` GPUs,
with progress rates (1 alone, 1/slowdown when sharing) between events, and returns each
job's completion time. Pure: no clock; the simulator drives the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
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

    def decide(
        self, now: float, queue: Sequence[Job], running: Sequence[Running], free: int
    ) -> list[Decision]: ...


class Fifo:
    name = "fifo"

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
