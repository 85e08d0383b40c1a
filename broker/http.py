"""The broker's minimal HTTP API (JSON, under `/v1`) and the artifact store over HTTP.

    GET  /healthz                         liveness and a one-line summary
    GET  /v1/swarm                        providers (pool, hardware, load) and models
    GET  /v1/providers                    the providers alone
    GET  /v1/models                       models and whether they are served
    POST /v1/models                       register a model: its manifest.json (admin key)
    GET  /v1/models/{name}                its stages and route (providers, addresses, backups)
    GET  /v1/models/{name}/route          the same, for a client opening interactive sessions
    GET  /v1/models/{name}/manifest       its manifest.json (clients fetch their stages by it)
    POST /v1/models/{name}/pick           a provider for one stage of a client's session
    POST /v1/models/{name}/verify         a generation's signed commitments, checked by a rerun
    POST /v1/providers/{peer}/report      a client's request to this provider failed
    PUT  /v1/artifacts/{sha256}           upload an artifact, verified by its name (admin key)
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
    GET  /v1/stream                       the dashboard's feed: snapshots, events, samples (SSE)
    POST /v1/embeddings                   OpenAI-style embeddings (`broker.gateway`)
    POST /v1/completions                  OpenAI-style completions, `stream` as SSE
    POST /v1/chat/completions             OpenAI-style chat, through the model's chat template
    GET|POST /v1/keys, DELETE /v1/keys/{id}   managed API keys (admin key; `broker.keys_api`)
    POST /v1/gateway/keys|admit|release|report   what gateway processes ask (a gateway's key)
    GET  /metrics                         Prometheus metrics (`broker.metrics`)
    GET  /v1/metrics/history              the dashboard's charts: a sample every 5 s, an hour
                                          of them (`broker.history`; ?since=UNIX_TIME)
    GET  /openapi.json                    this API as an OpenAPI 3.1 document
    GET  /                                the dashboard (static files in broker/dashboard/)

With API keys configured (static ones, `broker.auth`, or managed ones, `broker.keystore`),
everything but `/healthz`, `/openapi.json` and the dashboard's static files needs
`Authorization: Bearer KEY` or `X-API-Key: KEY`; managing keys, adding a model or uploading
an artifact needs an admin key, and `/v1/gateway/...` a gateway's or an admin key; providers
download artifacts with the token of their assignment's link instead. Errors are JSON
`{"error": {"message", "field"?}}` with 400 (bad input, naming the field), 401 (no valid
key), 403 (not an admin or gateway key where one is needed), 404 (unknown model or job), 409
(not yet possible), 413 (too large), 429 (too many requests in progress, or over a key's or
the model's limit: `broker.leases`) or 503 (no provider serves the model in time).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp_sse import EventSourceResponse

from broker.auth import ArtifactTokens
from broker.commitcheck import CommitmentChecks
from broker.config import BrokerConfig
from broker.errors import NotFound
from broker.events import EventLog
from broker.finetune.kind import FinetuneJobs
from broker.gateway import Gateway
from broker.history import History
from broker.httpkit import (
    ADMISSION,
    DASHBOARD,
    KEY_NEEDED,
    PAGE_HEADERS,
    Handler,
    answer,
    body_as,
    encode,
    error,
    errors,
    event_stream,
    job_view,
    presented_key,
    public_path,
    query_as,
    sse,
)
from broker.jobs import JobRunner
from broker.jobs_api import JobRoutes
from broker.keys_api import KeyRoutes
from broker.keystore import KeyStore
from broker.metrics import Metrics
from broker.models import ModelStore, StoredModel
from broker.openapi import OPS, SSE, document_bytes
from broker.registry import Registry
from broker.serving import Serving
from broker.sessions_api import SessionRoutes
from broker.store import Store
from broker.verify import Verifier
from proto import api
from proto.api import openai as oa

log = logging.getLogger("fusionai.broker")
ADMIN = frozenset((op.method, op.path) for op in OPS if op.admin)  # (an admin key's alone)
GATEWAY = frozenset((op.method, op.path) for op in OPS if op.gateway)  # (a gateway's, admin's)
# even on an open API: a key added closes it, and a lease holds capacity
ALWAYS = {k: "admin" for k in ADMIN if k[1].startswith("/v1/keys")} | dict.fromkeys(
    GATEWAY, "gateway"
)
ALWAYS_NEEDED = {
    "admin": "managing API keys needs an admin key (start the broker with --admin-key KEY, "
    "or put `admin` after a key in its --api-keys-file)",
    "gateway": "a gateway's operation: it needs a gateway's key (`fusionai keys add NAME "
    "--role gateway`) or an admin key, even on an open API",
}
LINK_REFUSED = (
    "this artifact link has expired, or is not this provider's, or its provider has left the "
    "swarm; the broker sends a fresh link with each assignment"
)
ADMIN_NEEDED = "this needs an admin key (managing keys, adding models, uploading artifacts)"
NO_ADMIN_KEY = (
    f"{ADMIN_NEEDED}, and this broker has none: start it with --admin-key KEY, or put "
    "`admin` after a key in its --api-keys-file"
)


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
    checks: CommitmentChecks  # generations' commitments, checked by a rerun
    gateway: Gateway
    keys: KeyStore
    key_routes: KeyRoutes
    tokens: ArtifactTokens
    metrics: Metrics
    history: History
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
        route = request.match_info.route.resource
        op = (request.method, route.canonical) if route is not None else None
        if op in ALWAYS:
            holder = keys.holder(presented_key(request))
            if holder is None or holder.role not in (ALWAYS[op], "admin"):
                return error(401 if holder is None else 403, ALWAYS_NEEDED[ALWAYS[op]])
            return await handler(request)
        if not keys.required or public_path(request.path) or request.method == "OPTIONS":
            return await handler(request)
        sha, query = request.match_info.get("sha"), request.query
        link = request.method in ("GET", "HEAD") and sha is not None and "token" in query
        if link:  # a provider's download: its own link, unexpired, while it is a member
            peer = query.get("peer", "")
            if tokens.valid(sha or "", peer, query["token"]) and parts.registry.alive(peer):
                return await handler(request)
        holder = keys.holder(presented_key(request))
        if holder is None:
            response = error(401, LINK_REFUSED if link else KEY_NEEDED)
            response.headers["WWW-Authenticate"] = 'Bearer realm="fusionai"'
            return response
        if op in ADMIN and holder.role != "admin":
            return error(403, ADMIN_NEEDED if keys.has_admin else NO_ADMIN_KEY)
        return await handler(request)

    app = web.Application(
        middlewares=[measure, errors, auth], client_max_size=parts.config.max_body_bytes
    )
    app[ADMISSION] = parts.gateway.admission  # bodies read at once, bounded in bytes
    store, serving = parts.store, parts.serving
    sessions = SessionRoutes(
        serving,
        parts.registry,
        parts.verifier,
        parts.inflight,
        parts.rng,
        parts.config.request_timeout_s,
    )
    job_routes = JobRoutes(store, parts.events, parts.jobs, parts.finetunes, parts.stopping)
    checks = parts.checks
    gateway = parts.gateway
    broker_info = api.BrokerInfo(parts.peer_id, parts.addrs)

    async def verify_generation(request: web.Request) -> web.Response:
        body = await body_as(request, api.swarm.VerifyRequest)
        return answer(await checks.verify(request.match_info["name"], body))

    def providers_now() -> list[api.Provider]:
        return parts.registry.summary(parts.verifier.summary)

    def model_or_404(name: str) -> StoredModel:
        if name not in serving.plans:
            raise NotFound(f"no model named {name!r}")
        return serving.plans[name].model

    async def healthz(request: web.Request) -> web.Response:
        alive = sum(1 for p in providers_now() if p.pool != "dead")
        return answer(api.Health(True, parts.peer_id, parts.addrs, alive, len(serving.plans)))

    async def swarm(request: web.Request) -> web.Response:
        models = [serving.describe(name) for name in sorted(serving.plans)]
        return answer(
            api.Swarm(broker_info, parts.config.heartbeat_timeout_s, providers_now(), models)
        )

    async def providers(request: web.Request) -> web.Response:
        return answer(api.ProviderList(providers_now(), parts.verifier.quarantined_list()))

    async def list_models(request: web.Request) -> web.Response:
        details = [serving.describe(n) for n in sorted(serving.plans)]
        # (`models`: the detail SDKs of the previous release read, for one release)
        return answer(api.ModelList([serving.card(d) for d in details], details))

    async def add_model(request: web.Request) -> web.Response:
        stored = await parts.add_model(await request.read())
        return answer(serving.describe(stored.name), status=201)

    async def get_model(request: web.Request) -> web.Response:
        return answer(serving.describe(model_or_404(request.match_info["name"]).name))

    async def get_manifest(request: web.Request) -> web.Response:
        body = model_or_404(request.match_info["name"]).manifest_bytes
        return web.Response(body=body, content_type="application/json")

    async def put_artifact(request: web.Request) -> web.Response:
        sha = request.match_info["sha"]
        size = await parts.models.receive(sha, request.content.iter_chunked(1 << 20))
        return answer(api.Stored(sha, size), status=201)

    async def get_artifact(request: web.Request) -> web.StreamResponse:
        query_as(request, api.ArtifactQuery)  # (the token was checked by `auth`)
        path = parts.models.artifact_path(request.match_info["sha"])
        if path is None:
            raise NotFound("no such artifact")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def events(request: web.Request) -> web.Response:
        query = query_as(request, api.EventsQuery)
        rows = store.events(since=query.since, limit=query.limit)
        return answer(api.EventList([e.to_json() for e in rows]))

    def snapshot() -> dict[str, Any]:
        return {
            "broker": broker_info,
            "providers": providers_now(),
            "models": [serving.describe(n) for n in sorted(serving.plans)],
            "jobs": [job_view(j, store.count_done(j.id)) for j in store.jobs(limit=50)],
            "gateways": parts.key_routes.gateways.summary(),
        }

    async def stream(request: web.Request) -> web.StreamResponse:
        """The dashboard's feed: a `snapshot` whenever the swarm changes (at most one per
        `interval` seconds) and each new `event`."""
        interval = query_as(request, api.StreamQuery).interval_ms / 1000
        return await event_stream(request, lambda response: _stream(response, interval))

    async def _stream(response: EventSourceResponse, interval: float) -> None:
        last: bytes | None = None
        since = max(0, store.last_event_id() - 50)  # the page starts with recent history
        sampled = parts.history.taken - 1  # (the page reads the history so far itself)
        while not parts.stopping() and response.is_connected():  # (pings notice a leaver)
            for row in store.events(since=since, limit=200):
                since = row.id
                await sse(response, "event", row.to_json())
            current = encode(snapshot())
            if current != last:
                await sse(response, "snapshot", current.decode())
                last = current
            for sample in parts.history.since(after=sampled).samples:
                sampled = sample.seq
                await sse(response, "sample", encode(sample).decode())
            await asyncio.sleep(interval)
            await parts.events.wait(max(0.0, 2.0 - interval))  # load changes without events

    async def embeddings(request: web.Request) -> web.Response:
        body = await body_as(request, oa.EmbeddingRequest)
        return answer(await gateway.embeddings(request, body))

    async def completions(request: web.Request) -> web.StreamResponse:
        return await gateway.completions(request, await body_as(request, oa.CompletionRequest))

    async def chat(request: web.Request) -> web.StreamResponse:
        return await gateway.chat(request, await body_as(request, oa.ChatCompletionRequest))

    async def history(request: web.Request) -> web.Response:
        query = query_as(request, api.HistoryQuery)
        return answer(parts.history.since(query.since, query.after))

    async def prometheus(request: web.Request) -> web.Response:
        body = metrics.render()  # on the loop: it reads the registry and the store
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=document_bytes(), content_type="application/json")

    async def dashboard(request: web.Request) -> web.FileResponse:
        return web.FileResponse(DASHBOARD / "index.html", headers=PAGE_HEADERS)

    files = {p.name for p in DASHBOARD.iterdir() if p.is_file()}  # nothing else is served

    async def dashboard_file(request: web.Request) -> web.FileResponse:
        name = request.match_info["path"]
        if name not in files:
            raise NotFound(f"no dashboard file {name!r}")
        return web.FileResponse(DASHBOARD / name, headers=PAGE_HEADERS)

    handlers: dict[tuple[str, str], Handler] = {
        ("GET", "/"): dashboard,
        ("GET", "/dashboard/{path}"): dashboard_file,
        ("GET", "/openapi.json"): openapi,
        ("GET", "/metrics"): prometheus,
        ("GET", "/v1/metrics/history"): history,
        ("GET", "/healthz"): healthz,
        ("GET", "/v1/swarm"): swarm,
        ("GET", "/v1/providers"): providers,
        ("POST", "/v1/providers/{peer}/report"): sessions.report,
        ("GET", "/v1/stream"): stream,
        ("GET", "/v1/events"): events,
        ("GET", "/v1/models"): list_models,
        ("POST", "/v1/models"): add_model,
        ("GET", "/v1/models/{name}"): get_model,
        ("GET", "/v1/models/{name}/route"): get_model,
        ("GET", "/v1/models/{name}/manifest"): get_manifest,
        ("POST", "/v1/models/{name}/pick"): sessions.pick,
        ("POST", "/v1/models/{name}/verify"): verify_generation,
        ("PUT", "/v1/artifacts/{sha}"): put_artifact,
        ("GET", "/v1/artifacts/{sha}"): get_artifact,
        ("GET", "/v1/jobs"): job_routes.list,
        ("POST", "/v1/jobs"): job_routes.submit,
        ("GET", "/v1/jobs/{id}"): job_routes.get,
        ("POST", "/v1/jobs/{id}/cancel"): job_routes.cancel,
        ("GET", "/v1/jobs/{id}/results"): job_routes.results,
        ("DELETE", "/v1/jobs/{id}/results"): job_routes.delete_results,
        ("GET", "/v1/jobs/{id}/adapter"): job_routes.adapter,
        ("GET", "/v1/jobs/{id}/story"): job_routes.story,
        ("GET", "/v1/jobs/{id}/events"): job_routes.events_of,
        ("POST", "/v1/embeddings"): embeddings,
        ("POST", "/v1/completions"): completions,
        ("POST", "/v1/chat/completions"): chat,
        ("GET", "/v1/keys"): parts.key_routes.list,
        ("POST", "/v1/keys"): parts.key_routes.add,
        ("DELETE", "/v1/keys/{id}"): parts.key_routes.revoke,
        ("POST", "/v1/gateway/keys"): parts.key_routes.decide,
        ("POST", "/v1/gateway/admit"): parts.key_routes.admit,
        ("POST", "/v1/gateway/release"): parts.key_routes.release,
        ("POST", "/v1/gateway/report"): parts.key_routes.report,
    }
    documented = {(op.method, op.path) for op in OPS}
    if set(handlers) != documented:  # the router is the documented operations, no more
        raise RuntimeError(f"undocumented or unrouted: {set(handlers) ^ documented}")
    for op in OPS:
        streams = op.media == SSE  # (no HEAD for event streams)
        if op.method == "GET":
            app.router.add_get(op.path, handlers["GET", op.path], allow_head=not streams)
        else:
            app.router.add_route(op.method, op.path, handlers[op.method, op.path])
    return app
