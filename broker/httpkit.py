"""What the HTTP API's handlers share: JSON errors (the one shape every failure takes), the
error middleware, server-sent events, request bodies and query parameters decoded into their
`proto.api` structs (a `JobError` naming the field at fault), typed answers, a job's view."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
from aiohttp import web
from aiohttp_sse import EventSourceResponse, sse_response

from broker.admission import Admission
from broker.errors import Conflict, NotFound, TooBusy, Unavailable
from broker.jobkinds import JobError, refusal
from broker.models import ModelStoreError
from broker.openapi import OPS
from broker.schema import JobRow
from proto.api import jobs as api_jobs
from proto.api.common import Error, ErrorDetail

log = logging.getLogger("fusionai.broker")

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str, field: str | None = None) -> web.Response:
    return answer(Error(ErrorDetail(message, field)), status)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON error; nothing a client sends crashes the broker."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            return error(exc.status, exc.reason if not exc.text else exc.text)
        raise
    except JobError as exc:
        return error(400, str(exc), exc.field)
    except ModelStoreError as exc:
        return error(400, str(exc))
    except NotFound as exc:
        return error(404, str(exc))
    except Conflict as exc:
        return error(409, str(exc))
    except TooBusy as exc:
        response = error(429, str(exc))
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return response
    except Unavailable as exc:
        return error(503, str(exc))
    except Exception:  # a bug: logged with its traceback, answered without one
        log.exception("%s %s failed", request.method, request.path)
        return error(500, "internal error; the broker's log has the details")


DASHBOARD = Path(__file__).parent / "dashboard"
# the dashboard's files: nothing but this origin's scripts, styles, images and API (no inline
# script or style, so text from providers or users can never run), not framed elsewhere
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# no key needed: the operations marked public (and what is below /dashboard/)
PUBLIC = frozenset(op.path for op in OPS if op.public and "{" not in op.path)
BIG_BODY = 64 * 1024  # bodies larger than this are decoded off the event loop
_encoder = msgspec.json.Encoder(enc_hook=str)  # (event fields of other types: as text)
KEY_NEEDED = "a valid API key is needed: Authorization: Bearer KEY (or X-API-Key: KEY)"
KEEPALIVE_S = 15.0  # a comment line this often keeps idle streams open through proxies


RESULT_ROWS = 8  # microbatches per `results` event of a job's stream


def results_event(job: str, offset: int, rows: list[tuple[int, list[int], bytes]]) -> str:
    """A `results` event's JSON: a few microbatches' rows of an embed job from `offset`."""
    embeddings: list[Any] = []
    for _, shape, data in rows:
        embeddings.extend(np.frombuffer(data, dtype=np.float32).reshape(shape).tolist())
    return _encoder.encode({"job": job, "offset": offset, "embeddings": embeddings}).decode()


def public_path(path: str) -> bool:
    return path in PUBLIC or path.startswith("/dashboard/")


def site_url(site: web.TCPSite, host: str, tls: bool = False) -> str:
    """The URL of a site that has started (the port it bound; 127.0.0.1 for a wildcard)."""
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def presented_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("X-API-Key")


async def event_stream(
    request: web.Request, body: Callable[[EventSourceResponse], Awaitable[None]]
) -> web.StreamResponse:
    """A server-sent event stream (aiohttp-sse: it pings idle streams, so proxies keep them
    open, and drops a client that stops reading) written by `body` until it returns or the
    client leaves."""
    async with sse_response(
        request,
        sep="\n",
        ping_interval=KEEPALIVE_S,
        headers={"Cache-Control": "no-cache"},
        allow_all_methods=True,
    ) as response:
        try:
            await body(response)
        except ConnectionResetError:  # the client went away
            pass
        except TimeoutError:
            if request.transport is not None:
                raise
            # it stopped reading: aiohttp-sse's send timed out and dropped the connection
            log.info("%s %s: the client stopped reading; dropped", request.method, request.path)
    return response


async def sse(response: EventSourceResponse, event: str | None, data: Any) -> None:
    """One event; `data` a `proto.api` struct, JSON-able data, or JSON text as it is."""
    text = data if isinstance(data, str) else _encoder.encode(data).decode()
    await response.send(text, event=event)


# a \uXXXX escape of a UTF-16 surrogate: JSON text may pair them, never leave one alone
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _parse(raw: bytes, kind: Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise refusal(exc) from None
    except msgspec.DecodeError as exc:
        if _SURROGATE.search(raw):  # (msgspec's own words for it say "truncated")
            raise JobError(
                "body",
                f"not valid JSON text: it escapes an unpaired UTF-16 surrogate ({exc}); "
                f"send text as UTF-8, or escape characters outside the BMP as a surrogate pair",
            ) from None
        raise JobError("body", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise JobError("body", "JSON nested too deeply") from None


ADMISSION = web.AppKey("admission", Admission)  # the bytes of bodies being read, bounded


async def body_as(request: web.Request, kind: type[T]) -> T:
    """The request's JSON body as `kind` (a `proto.api` struct); `JobError` naming the field
    at fault. Over the size limit: 413, answered by the middleware. While the broker reads
    and decodes more bodies than its `Admission` allows in bytes: 429, before reading."""
    admission = request.app.get(ADMISSION)
    reading: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if admission is not None:  # a chunked body counts as the largest it may be
        reading = admission.reading(request.content_length or admission.limits.largest_body)
    with reading:
        raw = await request.read()
        if len(raw) > BIG_BODY:
            value: T = await asyncio.to_thread(_parse, raw, kind)
        else:
            value = _parse(raw, kind)
        del raw
    return value


def query_as(request: web.Request, kind: type[T]) -> T:
    """The query parameters as `kind` (numbers from their text); `JobError` naming one."""
    try:
        return msgspec.convert(dict(request.query), kind, strict=False)
    except msgspec.ValidationError as exc:
        raise refusal(exc) from None


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def answer(value: Any, status: int = 200) -> web.Response:
    """A JSON answer: a `proto.api` struct (or JSON-able data)."""
    return web.Response(body=_encoder.encode(value), status=status, content_type="application/json")


def job_view(job: JobRow, done: int) -> api_jobs.Job:
    return api_jobs.Job(
        id=job.id,
        kind=job.kind,
        model=job.model,
        state=job.state,  # type: ignore[arg-type]  # (the store keeps only these)
        microbatches=job.microbatches,
        done=done,
        progress=round(done / job.microbatches, 4) if job.microbatches else 1.0,
        created=job.created,
        updated=job.updated,
        error=job.error or None,
    )
