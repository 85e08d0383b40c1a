"""Jobs: `dag/` graphs the broker runs through the swarm, persisted in SQLite.

A job's states: queued -> placed (every stage has a route) -> running -> succeeded, failed or
cancelled. This runner owns that lifecycle for every kind of job: a submission goes to its
kind (`broker/jobkinds.py`: "embed" in `embedjobs.py`, "finetune" in `finetune/`, registered
by the composition root) to be checked and turned into a graph, is stored and queued; which
queued job starts when is the decision core's (`broker.core.queue`, FIFO or SJF-BSBF): the
runner reports jobs queued, progressing and ended, and starts those the core says
(`StartJob`), a job that shares a route alongside its host. A started job runs in its own
task, by its kind, until it ends or the broker stops (it then resumes when the broker starts
again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from broker.core.actions import StartJob
from broker.core.events import JobEnded, JobQueued, ModelUsed
from broker.driver import CoreDriver
from broker.errors import NotFound
from broker.events import EventLog
from broker.jobkinds import ACTIVE, NOMINAL_FLOPS, TERMINAL, JobError, JobFailed, JobKind, convert
from broker.schema import JobRow
from broker.store import Store

log = logging.getLogger("fusionai.broker")


class JobRunner:
    """`route(model)` names the providers a started job's event reports; `has_model(name)`
    whether a stored model still exists (a resumed job of a deleted model fails)."""

    def __init__(
        self,
        store: Store,
        events: EventLog,
        driver: CoreDriver,
        clock: Callable[[], float],
        route: Callable[[str], Any],
        has_model: Callable[[str], bool],
    ) -> None:
        self.store = store
        self.events = events
        self.driver = driver
        self.clock = clock
        self.route = route
        self.has_model = has_model
        self.kinds: dict[str, JobKind] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.driver.carry(StartJob, self._start)

    def register(self, kind: JobKind) -> None:
        """Run jobs of `kind.name` with `kind`."""
        self.kinds[kind.name] = kind

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, body: Any) -> JobRow:
        """Check a submission (parsed JSON) by its kind, store it and queue it."""
        if not isinstance(body, dict):
            raise JobError("body", "a job is a JSON object")
        name = body.get("kind", "embed")
        kind = self.kinds.get(name) if isinstance(name, str) else None
        if kind is None:
            raise JobError(
                "kind", f"unknown job kind {name!r}; this broker runs {', '.join(self.kinds)}"
            )
        request = await asyncio.to_thread(convert, body, kind.request)  # (up to 64 MiB of texts)
        prepared = await kind.prepare(request)
        job_id = uuid.uuid4().hex[:16]
        job = self.store.add_job(
            job_id,
            kind.name,
            prepared.model,
            prepared.request,
            prepared.graph,
            prepared.units,
            prepared.flops / NOMINAL_FLOPS,
        )
        self.events.emit("job_queued", job=job_id, model=prepared.model, **prepared.event)
        self._queue(job)
        return job

    def _queue(self, job: JobRow) -> None:
        """The core hears of a queued job (and starts it when its model has a free route)."""
        self.driver.handle(
            JobQueued(job.id, job.model, job.created, max(1e-6, job.estimate_s), self.clock())
        )

    def cancel(self, job_id: str) -> JobRow:
        job = self.store.job(job_id, full=False)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if job.state in TERMINAL:
            return job
        self.store.set_job_state(job_id, "cancelled", "cancelled by request")
        self.events.emit("job_cancelled", job=job_id)
        task_ = self.tasks.pop(job_id, None)
        if task_ is not None:
            task_.cancel()
        self._release(job_id)
        found = self.store.job(job_id, full=False)
        assert found is not None
        return found

    def results(self, job_id: str, offset: int, limit: int) -> Any:
        job = self.store.job(job_id, full=False)
        if job is None:
            raise NotFound(f"no job {job_id}")
        kind = self.kinds.get(job.kind)
        if kind is None:
            raise NotFound(f"job {job_id} is a {job.kind} job, which this broker does not run")
        return kind.results(job, offset, limit)

    def busy(self, model: str) -> bool:
        """A job, an embedding request or a generation session is using the model (so its
        placement is not rebalanced now)."""
        return self.driver.core.busy(model)

    @contextlib.contextmanager
    def using(self, model: str) -> Iterator[None]:
        """Tell the core an interactive request uses `model` while this block runs."""
        self.driver.handle(ModelUsed(model, 1, self.clock()))
        try:
            yield
        finally:
            self.driver.handle(ModelUsed(model, -1, self.clock()))

    # ---- scheduling ------------------------------------------------------------------------

    def resume(self) -> None:
        """After a restart: jobs that were placed or running go back to the queue; the core
        hears of every queued job (one whose model is gone fails)."""
        for job in self.store.jobs(ACTIVE):
            done = self.store.count_done(job.id)
            self.store.set_job_state(job.id, "queued")
            self.events.emit("job_resumed", job=job.id, done=done, of=job.microbatches)
        for job in self.store.jobs(("queued",), oldest_first=True):
            if not self.has_model(job.model):
                self._finish(job.id, "failed", f"model {job.model} is no longer stored")
            else:
                self._queue(job)

    async def schedule(self, stop: asyncio.Event) -> None:
        """Own the running jobs until the broker stops: then they are cancelled (they resume
        when it starts again). Jobs start when the core says (`StartJob`)."""
        try:
            await stop.wait()
        finally:
            self.driver.stop()  # jobs cancelled now change no decision on their way out
            for t in list(self.tasks.values()):
                t.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _start(self, action: StartJob) -> None:
        self.store.set_job_state(action.job, "placed")
        route = self.route(action.model)
        self.events.emit("job_placed", job=action.job, route=route, shares_with=action.shares)
        self.tasks[action.job] = asyncio.create_task(self._run(action.job))

    def _finish(self, job_id: str, state: str, error: str = "") -> None:
        job = self.store.job(job_id, full=False)
        if job is None or job.state in TERMINAL:
            return
        self.store.set_job_state(job_id, state, error)
        self.events.emit(f"job_{state}", job=job_id, **({"reason": error} if error else {}))

    # ---- running ---------------------------------------------------------------------------

    async def _run(self, job_id: str) -> None:
        try:
            job = self.store.job(job_id)
            assert job is not None
            await self.kinds[job.kind].run(job)
            self._finish(job_id, "succeeded")
        except asyncio.CancelledError:
            raise
        except JobFailed as exc:
            self._finish(job_id, "failed", str(exc))
        except Exception as exc:  # a bug must fail the job loudly, not hang it
            log.exception("job %s crashed", job_id)
            self._finish(job_id, "failed", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if self.tasks.get(job_id) is asyncio.current_task():
                del self.tasks[job_id]
                self._release(job_id)

    def _release(self, job_id: str) -> None:
        """A job stopped or was cancelled: the core frees its route (a job sharing it
        carries on, holding it) and may start the next."""
        self.driver.handle(JobEnded(job_id, self.clock()))

    def redo(self, peer: str, dropped: dict[str, int]) -> None:
        """A quarantined provider's results were dropped: finished jobs run again for them
        (running ones notice by themselves)."""
        for job_id, n in dropped.items():
            job = self.store.job(job_id, full=False)
            if job is None:
                continue
            self.events.emit("job_redo", job=job_id, peer=peer, microbatches=n, was=job.state)
            if job.state == "succeeded":
                self.store.set_job_state(job_id, "queued")
                self._queue(job)
