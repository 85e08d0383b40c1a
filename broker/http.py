"""The broker's minimal HTTP API (JSON, under `/v1`) and the artifact store over HTTP.

    GET  /healthz                         liveness and a one-line summary
    GET  /v1/swarm                        providers (pool, hardware, load) and models
    GET  /v1/providers                    the providers alone
    GET  /v1/models                       models and whether they are served
    POST /v1/models                       register a model: its manifest.json as the body
    GET  /v1/models/{name}                its stages and route (providers, addresses, backups)
    GET  /v1/models/{name}/route          the same, for a client opening interactive sessions
    GET  /v1/models/{name}/manifest       its manifest.json (clients fetch their stages by it)
    POST /v1/models/{name}/pick           a provider for one stage of a client's session
    POST /v1/providers/{peer}/report      a client's request to this provider failed
    PUT  /v1/artifacts/{sha256}           upload an artifact (verified against its name)
    GET  /v1/artifacts/{sha256}           download one (range requests supported)
    POST /v1/jobs                         submit a job: {"model", "texts" | "token_ids", ...}
    GET  /v1/jobs                         recent jobs
    GET  /v1/jobs/{id}                    a job's state and progress
    POST /v1/jobs/{id}/cancel             cancel it
    GET  /v1/jobs/{id}/results            its results (?offset=&limit= rows), once succeeded
    DELETE /v1/jobs/{id}/results          forget them (results are kept until then)
    GET  /v1/jobs/{id}/adapter            a fine-tune job's trained adapter (safetensors)
    GET  /v1/jobs/{id}/story              the events that tell what happened to it
    GET  /v1/jobs/{id}/events             its progress, then its results, as server-sent events
    GET  /v1/events                       the event log (?since=ID&limit=N)
    GET  /v1/stream                       the dashboard's feed: snapshots and events (SSE)
    POST /v1/embeddings                   OpenAI-style embeddings (`broker.gateway`)
    POST /v1/completions                  OpenAI-style completions, `stream` as SSE
    GET  /metrics                         Prometheus metrics (`broker.metrics`)
    GET  /openapi.json                    this API as an OpenAPI 3.1 document
    GET  /                                the dashboard (static files in broker/dashboard/)

With API keys configured, everything but `/healthz`, `/openapi.json` and the dashboard's
static files needs `Authorization: Bearer KEY` (`broker.auth`). Errors are JSON
`{"error": {"message", "field"?}}` with 400 (bad input, naming the field), 401 (no valid key),
404 (unknown model or job), 409 (not yet possible), 413 (too large), 429 (too many requests
in progress) or 503 (no provider serves the model in time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from broker.auth import ArtifactTokens, Keys
from broker.config import BrokerConfig
from broker.errors import NotFound
from broker.events import EventLog
from broker.finetune.kind import FinetuneJobs
from broker.gateway import Gateway
from broker.httpkit import (
    DASHBOARD,
    KEEPALIVE_S,
    MAX_JOB_WAIT_S,
    OPENAPI,
    RESULT_ROWS,
    Handler,
    error,
    errors,
    event_stream,
    float_param,
    int_param,
    job_json,
    json_body,
    presented_key,
    public_path,
    results_event,
    sse,
    sse_bytes,
)
from broker.jobkinds import TERMINAL
from broker.jobs import JobRunner
from broker.metrics import Metrics
from broker.models import ModelStore, StoredModel
from broker.registry import Registry
from broker.schema import JobRow
from broker.serving import Serving
from broker.sessions_api import SessionRoutes
from broker.store import Store
from broker.verify import Verifier

log = logging.getLogger("fusionai.broker")


@dataclass(frozen=True)
class ApiParts:
    """What the HTTP API uses of the broker, handed over by the composition root."""

    config: BrokerConfig
    store: Store
    events: EventLog
    registry: Registry
    serving: Serving
    models: ModelStore
    jobs: JobRunner
    finetunes: FinetuneJobs
    verifier: Verifier
    gateway: Gateway
    keys: Keys
    tokens: ArtifactTokens
    metrics: Metrics
    inflight: dict[str, int]  # stage requests outstanding per provider (shared with jobs)
    add_model: Callable[[bytes], Awaitable[StoredModel]]
    stopping: Callable[[], bool]
    rng: random.Random  # who checks a client's stage: unpredictable
    peer_id: str
    addrs: list[str]


def make_app(parts: ApiParts) -> web.Application:
    keys, tokens, metrics = parts.keys, parts.tokens, parts.metrics

    @web.middleware
    async def measure(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            info = request.match_info.route.resource
            route = info.canonical if info is not None else "unmatched"
            metrics.http(request.method, route, status, time.perf_counter() - start)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not keys.required or public_path(request.path) or request.method == "OPTIONS":
            return await handler(request)
        sha = request.match_info.get("sha")
        download = request.method in ("GET", "HEAD") and sha is not None  # by a provider
        if download and tokens.valid(sha or "", request.query.get("token")):
            return await handler(request)
        if not keys.valid(presented_key(request)):
            response = error(401, "a valid API key is needed: Authorization: Bearer KEY")
            response.headers["WWW-Authenticate"] = 'Bearer realm="fusionai"'
            return response
        return await handler(request)

    app = web.Application(
        middlewares=[measure, errors, auth], client_max_size=parts.config.max_body_bytes
    )
    store, jobs, serving = parts.store, parts.jobs, parts.serving
    sessions = SessionRoutes(
        serving,
        parts.registry,
        parts.verifier,
        parts.inflight,
        parts.rng,
        parts.config.request_timeout_s,
    )
    gateway = parts.gateway

    def job_or_404(job_id: str) -> JobRow:
        job = store.job(job_id, full=False)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return job

    async def healthz(request: web.Request) -> web.Response:
        providers = parts.registry.summary(parts.verifier.summary)
        return web.json_response(
            {
                "ok": True,
                "peer_id": parts.peer_id,
                "addrs": parts.addrs,
                "providers": sum(1 for p in providers if p["pool"] != "dead"),
                "models": len(serving.plans),
            }
        )

    async def swarm(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "broker": {"peer_id": parts.peer_id, "addrs": parts.addrs},
                "heartbeat_timeout_s": parts.config.heartbeat_timeout_s,
                "providers": parts.registry.summary(parts.verifier.summary),
                "models": [serving.describe(name) for name in sorted(serving.plans)],
            }
        )

    async def providers(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "providers": parts.registry.summary(parts.verifier.summary),
                "quarantined": parts.verifier.quarantined_list(),
            }
        )

    async def list_models(request: web.Request) -> web.Response:
        return web.json_response({"models": [serving.describe(n) for n in sorted(serving.plans)]})

    async def add_model(request: web.Request) -> web.Response:
        body = await request.read()
        stored = await parts.add_model(body)
        return web.json_response(serving.describe(stored.name), status=201)

    async def get_model(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in serving.plans:
            raise NotFound(f"no model named {name!r}")
        return web.json_response(serving.describe(name))

    async def get_manifest(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in serving.plans:
            raise NotFound(f"no model named {name!r}")
        body = serving.plans[name].model.manifest_bytes
        return web.Response(body=body, content_type="application/json")

    async def put_artifact(request: web.Request) -> web.Response:
        sha = request.match_info["sha"]
        size = await parts.models.receive(sha, request.content.iter_chunked(1 << 20))
        return web.json_response({"sha256": sha, "size": size}, status=201)

    async def get_artifact(request: web.Request) -> web.StreamResponse:
        path = parts.models.artifact_path(request.match_info["sha"])
        if path is None:
            raise NotFound("no such artifact")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def submit(request: web.Request) -> web.Response:
        job = await jobs.submit(await json_body(request))
        return web.json_response(job_json(job, 0), status=201)

    async def list_jobs(request: web.Request) -> web.Response:
        limit = int_param(request, "limit", 100, 1, 1000)
        rows = store.jobs(limit=limit)
        return web.json_response({"jobs": [job_json(j, store.count_done(j.id)) for j in rows]})

    async def get_job(request: web.Request) -> web.Response:
        """A job's state; with `wait=S`, a job still going is answered once its state or
        progress changes, or after S seconds (a long poll: no polling loop needed)."""
        job = job_or_404(request.match_info["id"])
        hold = float_param(request, "wait", 0.0, 0.0, MAX_JOB_WAIT_S)
        done = store.count_done(job.id)
        seen, loop = (job.state, done), asyncio.get_running_loop()
        end = loop.time() + hold
        while job.state not in TERMINAL and not parts.stopping():
            left = end - loop.time()
            if left <= 0:
                break
            await parts.events.wait(left)  # progress and state changes are events
            job = store.job(job.id, full=False) or job
            done = store.count_done(job.id)
            if (job.state, done) != seen:
                break
        return web.json_response(job_json(job, done))

    async def cancel(request: web.Request) -> web.Response:
        job = jobs.cancel(request.match_info["id"])
        return web.json_response(job_json(job, store.count_done(job.id)))

    async def results(request: web.Request) -> web.Response:
        offset = int_param(request, "offset", 0, 0, 10**9)
        limit = int_param(request, "limit", 10_000, 1, 10_000)
        return web.json_response(jobs.results(request.match_info["id"], offset, limit))

    async def adapter(request: web.Request) -> web.StreamResponse:
        path, row = parts.finetunes.adapter_path(request.match_info["id"])
        return web.FileResponse(
            path,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{row["job"]}.safetensors"',
                "X-Content-SHA256": row["sha256"],
            },
        )

    async def delete_results(request: web.Request) -> web.Response:
        job = job_or_404(request.match_info["id"])
        removed = store.delete_results(job.id)
        parts.events.emit("job_results_deleted", job=job.id, microbatches=removed)
        return web.json_response({"job": job.id, "deleted": removed})

    async def story(request: web.Request) -> web.Response:
        job = job_or_404(request.match_info["id"])
        events = [e.to_json() for e in store.story(job.id)]
        return web.json_response({"job": job_json(job, store.count_done(job.id)), "events": events})

    async def events(request: web.Request) -> web.Response:
        since = int_param(request, "since", 0, 0, 2**62)
        limit = int_param(request, "limit", 1000, 1, 10_000)
        rows = store.events(since=since, limit=limit)
        return web.json_response({"events": [e.to_json() for e in rows]})

    async def job_events(request: web.Request) -> web.StreamResponse:
        """A job's events as they happen; once it has succeeded, its results in blocks of up
        to 1000 rows (`results` events), then `end`."""
        job = job_or_404(request.match_info["id"])
        return await event_stream(request, lambda response: _job_events(response, job))

    async def _job_events(response: web.StreamResponse, job: JobRow) -> None:
        since = 0
        current: JobRow | None = job
        while not parts.stopping():
            current = store.job(job.id, full=False)  # (read first: no event is missed)
            while rows := store.events(since=since, limit=1000, job=job.id):
                for row in rows:
                    since = row.id
                    await sse(response, row.kind, row.to_json())
            if current is None or current.state in TERMINAL:
                break
            await parts.events.wait(KEEPALIVE_S)
            await response.write(b": waiting\n\n")
        if current is not None and current.state == "succeeded" and current.kind != "finetune":
            offset, first = 0, 0
            while True:  # a few microbatches at a time, encoded off the event loop
                stored = store.results_from(job.id, first, RESULT_ROWS)
                if not stored:
                    break
                block = await asyncio.to_thread(results_event, job.id, offset, stored)
                await response.write(block)
                first = stored[-1][0] + 1
                offset += sum(shape[0] for _, shape, _ in stored)
        final = job_json(current, store.count_done(job.id)) if current is not None else None
        await sse(response, "end", final)
        await response.write_eof()

    def snapshot() -> dict[str, Any]:
        rows = store.jobs(limit=50)
        return {
            "broker": {"peer_id": parts.peer_id, "addrs": parts.addrs},
            "providers": parts.registry.summary(parts.verifier.summary),
            "models": [serving.describe(n) for n in sorted(serving.plans)],
            "jobs": [job_json(j, store.count_done(j.id)) for j in rows],
        }

    async def stream(request: web.Request) -> web.StreamResponse:
        """The dashboard's feed: a `snapshot` whenever the swarm changes (at most one per
        `interval` seconds) and each new `event`."""
        interval = int_param(request, "interval_ms", 500, 100, 60_000) / 1000
        return await event_stream(request, lambda response: _stream(response, interval))

    async def _stream(response: web.StreamResponse, interval: float) -> None:
        last: str | None = None
        since = max(0, store.last_event_id() - 50)  # the page starts with recent history
        quiet = 0.0
        while not parts.stopping():
            for row in store.events(since=since, limit=200):
                since = row.id
                await sse(response, "event", row.to_json())
            current = json.dumps(snapshot(), default=str)
            if current != last:
                await response.write(sse_bytes("snapshot", current))
                last, quiet = current, 0.0
            elif quiet >= KEEPALIVE_S:
                await response.write(b": idle\n\n")
                quiet = 0.0
            await asyncio.sleep(interval)
            quiet += interval
            await parts.events.wait(max(0.0, 2.0 - interval))  # load changes without events

    async def embeddings(request: web.Request) -> web.Response:
        return await gateway.embeddings(await json_body(request))

    async def completions(request: web.Request) -> web.StreamResponse:
        return await gateway.completions(request, await json_body(request))

    async def prometheus(request: web.Request) -> web.Response:
        body = metrics.render()  # on the loop: it reads the registry and the store
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def openapi(request: web.Request) -> web.FileResponse:
        return web.FileResponse(OPENAPI, headers={"Content-Type": "application/json"})

    async def dashboard(request: web.Request) -> web.FileResponse:
        return web.FileResponse(DASHBOARD / "index.html")

    files = {p.name for p in DASHBOARD.iterdir() if p.is_file()}  # nothing else is served

    async def dashboard_file(request: web.Request) -> web.FileResponse:
        name = request.match_info["path"]
        if name not in files:
            raise NotFound(f"no dashboard file {name!r}")
        return web.FileResponse(DASHBOARD / name)

    app.router.add_get("/", dashboard)
    app.router.add_get("/dashboard/{path}", dashboard_file)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/stream", stream, allow_head=False)
    app.router.add_get("/v1/jobs/{id}/events", job_events, allow_head=False)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/swarm", swarm)
    app.router.add_get("/v1/providers", providers)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/models", add_model)
    app.router.add_get("/v1/models/{name}", get_model)
    app.router.add_get("/v1/models/{name}/route", get_model)
    app.router.add_get("/v1/models/{name}/manifest", get_manifest)
    app.router.add_post("/v1/models/{name}/pick", sessions.pick)
    app.router.add_post("/v1/providers/{peer}/report", sessions.report)
    app.router.add_put("/v1/artifacts/{sha}", put_artifact)
    app.router.add_get("/v1/artifacts/{sha}", get_artifact)
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{id}", get_job)
    app.router.add_post("/v1/jobs/{id}/cancel", cancel)
    app.router.add_get("/v1/jobs/{id}/results", results)
    app.router.add_delete("/v1/jobs/{id}/results", delete_results)
    app.router.add_get("/v1/jobs/{id}/adapter", adapter)
    app.router.add_get("/v1/jobs/{id}/story", story)
    app.router.add_get("/v1/events", events)
    return app
