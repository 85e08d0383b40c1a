"""A gateway process: the OpenAI-style endpoints over HTTP, and its report loop.

    GET  /healthz                  liveness: the gateway's name and its broker
    GET  /metrics                  this gateway's counters (Prometheus); the broker's
                                   `/metrics` has every gateway's, from their reports
    GET  /v1/models                the broker's model list (cached `MODELS_TTL_S`)
    POST /v1/embeddings            as the broker's (`broker.gateway`)
    POST /v1/completions
    POST /v1/chat/completions

Every request but `/healthz` needs a key the broker accepts (the decision is cached for the
`ttl_s` the broker states); each embeddings, completion or chat request holds a lease from the
broker while it runs (`gateway.remote`). Every `REPORT_EVERY_S` the gateway reports its
leases (so they live on) and its traffic. Killed, its streams end at once (their connections
close) and the broker frees its leases `LEASE_TTL_S` after its last report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.admission import Limits
from broker.gateway import Gateway
from broker.httpkit import (
    ADMISSION,
    KEY_NEEDED,
    Handler,
    answer,
    body_as,
    error,
    errors,
    presented_key,
    site_url,
)
from broker.leases import REPORT_EVERY_S
from client.api import AsyncClient
from client.errors import FusionAIError
from gateway.remote import KeyRefused, RemoteBackend, broker_call
from proto.api.keys import GatewayReport, ReportAck
from proto.api.openai import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

log = logging.getLogger("fusionai.gateway")
MODELS_TTL_S = 5.0


class _Counters(Collector):
    def __init__(self, backend: RemoteBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        labels = ["model"]
        tokens = CounterMetricFamily(
            "fusionai_generated_tokens", "Tokens generated for completions", labels=labels
        )
        requests = CounterMetricFamily("fusionai_gateway_requests", "Requests", labels=labels)
        for model, t in sorted(self.backend.traffic.report().items()):
            tokens.add_metric([model], t.tokens)
            requests.add_metric([model], t.requests)
        yield tokens
        yield requests
        yield CounterMetricFamily(
            "fusionai_gateway_refused", "Requests refused", value=self.backend.traffic.refused
        )
        yield GaugeMetricFamily(
            "fusionai_leases", "Requests in progress", value=len(self.backend.leases)
        )


def make_app(backend: RemoteBackend, gateway: Gateway) -> web.Application:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Counters(backend))
    models: list[tuple[float, bytes]] = []

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/healthz":
            return await handler(request)
        try:
            decision = await backend.decision(presented_key(request))
        except KeyRefused as exc:  # the gateway's own key: not the user's to fix
            log.error("the broker refuses this gateway's key: %s", exc)
            return error(503, "this gateway cannot reach its broker's decisions; try again later")
        if not decision.valid:
            backend.traffic.refused += 1
            response = error(401, KEY_NEEDED)
            response.headers["WWW-Authenticate"] = 'Bearer realm="fusionai"'
            return response
        try:
            return await handler(request)
        except KeyRefused as exc:  # revoked since the decision was cached
            return error(401, str(exc))

    app = web.Application(middlewares=[errors, auth], client_max_size=backend.limits.largest_body)
    app[ADMISSION] = gateway.admission

    async def healthz(request: web.Request) -> web.Response:
        return answer({"ok": True, "gateway": backend.name, "broker": backend.sdk.url})

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def list_models(request: web.Request) -> web.Response:
        if not models or models[0][0] < time.monotonic():
            out = await broker_call(backend.sdk._request("GET", "/v1/models", raw=True))
            models[:] = [(time.monotonic() + MODELS_TTL_S, out)]
        return web.Response(body=models[0][1], content_type="application/json")

    async def embeddings(request: web.Request) -> web.Response:
        body = await body_as(request, EmbeddingRequest)
        return answer(await gateway.embeddings(request, body))

    async def completions(request: web.Request) -> web.StreamResponse:
        return await gateway.completions(request, await body_as(request, CompletionRequest))

    async def chat(request: web.Request) -> web.StreamResponse:
        return await gateway.chat(request, await body_as(request, ChatCompletionRequest))

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def report_loop(backend: RemoteBackend, stop: asyncio.Event) -> None:
    """Report leases and traffic every `REPORT_EVERY_S` (or as the broker asks) until `stop`."""
    every = REPORT_EVERY_S
    while not stop.is_set():
        report = GatewayReport(
            backend.name, sorted(backend.leases), backend.traffic.report(), backend.traffic.refused
        )
        try:
            ack = await backend.sdk._call(
                "POST", "/v1/gateway/report", ReportAck, report, retry="never", timeout=every * 2
            )
            every = min(max(ack.report_every_s, 0.5), 30.0)
            if ack.lost:
                log.warning("the broker no longer holds leases %s", ", ".join(ack.lost[:5]))
        except FusionAIError as exc:
            log.warning("report to the broker failed: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def serve(
    sdk: AsyncClient,
    name: str,
    host: str,
    port: int,
    limits: Limits,
    stop: asyncio.Event,
    ready: Callable[[str], None] = lambda url: None,
    verify_share: float = 0.21,
    batching: bool = True,
) -> None:
    """Run a gateway until `stop` is set; `ready` gets its URL once it listens; the broker
    checks `verify_share` of its answers against their providers' commitments; `batching`:
    its answers' client side in batches (`Gateway`)."""
    backend = RemoteBackend(sdk, name, limits, verify_share=verify_share)
    await broker_call(backend.decision(None))  # the broker is there, and takes our key
    await backend.start()
    gateway = Gateway(backend, batching)
    runner = web.AppRunner(make_app(backend, gateway), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        ready(site_url(site, host))
        await report_loop(backend, stop)
    finally:
        backend.close()  # open streams end with a clean error event
        await runner.cleanup()
        await sdk.aclose()
