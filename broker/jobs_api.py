"""The batch job routes (`/v1/jobs...`): submit, list, a job's state (a long poll), cancel,
results, the adapter a fine-tune trained, a job's story and its event stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp_sse import EventSourceResponse

from broker.errors import NotFound
from broker.events import EventLog
from broker.finetune.kind import FinetuneJobs
from broker.httpkit import (
    KEEPALIVE_S,
    RESULT_ROWS,
    answer,
    body_as,
    event_stream,
    job_view,
    query_as,
    results_event,
    sse,
)
from broker.jobkinds import TERMINAL
from broker.jobs import JobRunner
from broker.schema import JobRow
from broker.store import Store
from proto.api import jobs as api


class JobRoutes:
    def __init__(
        self,
        store: Store,
        events: EventLog,
        jobs: JobRunner,
        finetunes: FinetuneJobs,
        stopping: Callable[[], bool],
    ) -> None:
        self.store = store
        self.events = events
        self.jobs = jobs
        self.finetunes = finetunes
        self.stopping = stopping

    def _job(self, job_id: str) -> JobRow:
        job = self.store.job(job_id, full=False)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return job

    def _view(self, job: JobRow) -> api.Job:
        return job_view(job, self.store.count_done(job.id))

    async def submit(self, request: web.Request) -> web.Response:
        body = await body_as(request, object)  # parsed; then checked as its kind's struct
        job = await self.jobs.submit(body)
        return answer(job_view(job, 0), status=201)

    async def list(self, request: web.Request) -> web.Response:
        query = query_as(request, api.JobsQuery)
        rows = self.store.jobs(limit=query.limit)
        return answer(api.JobList([self._view(j) for j in rows]))

    async def get(self, request: web.Request) -> web.Response:
        """A job's state; with `wait=S`, a job still going is answered once its state or
        progress changes, or after S seconds (a long poll: no polling loop needed)."""
        job = self._job(request.match_info["id"])
        hold = query_as(request, api.JobQuery).wait
        done = self.store.count_done(job.id)
        seen, loop = (job.state, done), asyncio.get_running_loop()
        end = loop.time() + hold
        while job.state not in TERMINAL and not self.stopping():
            left = end - loop.time()
            if left <= 0:
                break
            await self.events.wait(left)  # progress and state changes are events
            job = self.store.job(job.id, full=False) or job
            done = self.store.count_done(job.id)
            if (job.state, done) != seen:
                break
        return answer(job_view(job, done))

    async def cancel(self, request: web.Request) -> web.Response:
        return answer(self._view(self.jobs.cancel(request.match_info["id"])))

    async def results(self, request: web.Request) -> web.Response:
        query = query_as(request, api.ResultsQuery)
        return answer(self.jobs.results(request.match_info["id"], query.offset, query.limit))

    async def adapter(self, request: web.Request) -> web.StreamResponse:
        path, row = self.finetunes.adapter_path(request.match_info["id"])
        return web.FileResponse(
            path,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{row["job"]}.safetensors"',
                "X-Content-SHA256": row["sha256"],
            },
        )

    async def delete_results(self, request: web.Request) -> web.Response:
        job = self._job(request.match_info["id"])
        removed = self.store.delete_results(job.id)
        self.events.emit("job_results_deleted", job=job.id, microbatches=removed)
        return answer(api.Deleted(job.id, removed))

    async def story(self, request: web.Request) -> web.Response:
        job = self._job(request.match_info["id"])
        events = [e.to_json() for e in self.store.story(job.id)]
        return answer(api.Story(self._view(job), events))

    async def events_of(self, request: web.Request) -> web.StreamResponse:
        """A job's events as they happen; once it has succeeded, its results in blocks of a
        few microbatches (`results` events), then `end`."""
        job = self._job(request.match_info["id"])
        return await event_stream(request, lambda response: self._events(response, job))

    async def _events(self, response: EventSourceResponse, job: JobRow) -> None:
        store = self.store
        since = 0
        current: JobRow | None = job
        while not self.stopping() and response.is_connected():  # (its pings notice a leaver)
            current = store.job(job.id, full=False)  # (read first: no event is missed)
            while rows := store.events(since=since, limit=1000, job=job.id):
                for row in rows:
                    since = row.id
                    await sse(response, row.kind, row.to_json())
            if current is None or current.state in TERMINAL:
                break
            await self.events.wait(KEEPALIVE_S)
        if current is not None and current.state == "succeeded" and current.kind != "finetune":
            offset, first = 0, 0
            while True:  # a few microbatches at a time, encoded off the event loop
                stored = store.results_from(job.id, first, RESULT_ROWS)
                if not stored:
                    break
                block = await asyncio.to_thread(results_event, job.id, offset, stored)
                await sse(response, "results", block)
                first = stored[-1][0] + 1
                offset += sum(shape[0] for _, shape, _ in stored)
        await sse(response, "end", self._view(current) if current is not None else None)
        await response.write_eof()
