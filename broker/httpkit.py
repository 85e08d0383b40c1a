"""What the HTTP API's handlers share: JSON errors (the one shape every failure takes), the
error middleware, server-sent events, the JSON body and query parameters checked, a job's
JSON view."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from broker.errors import Conflict, NotFound, TooBusy, Unavailable
from broker.jobkinds import JobError
from broker.models import ModelStoreError
from broker.schema import JobRow

log = logging.getLogger("fusionai.broker")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"message": message}
    if field is not None:
        body["field"] = field
    return web.json_response({"error": body}, status=status)


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
        response.headers["Retry-After"] = "1"
        return response
    except Unavailable as exc:
        return error(503, str(exc))
    except Exception:  # a bug: logged with its traceback, answered without one
        log.exception("%s %s failed", request.method, request.path)
        return error(500, "internal error; the broker's log has the details")


DASHBOARD = Path(__file__).parent / "dashboard"
OPENAPI = Path(__file__).parent / "openapi.json"
PUBLIC = frozenset({"/healthz", "/openapi.json", "/"})  # no key needed, nor below /dashboard/
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
KEEPALIVE_S = 15.0  # a comment line this often keeps idle streams open through proxies
MAX_JOB_WAIT_S = 30.0  # longest `GET /v1/jobs/{id}?wait=S` holds a request for a change


RESULT_ROWS = 8  # microbatches per `results` event of a job's stream


def results_event(job: str, offset: int, rows: list[tuple[int, list[int], bytes]]) -> bytes:
    embeddings: list[Any] = []
    for _, shape, data in rows:
        embeddings.extend(np.frombuffer(data, dtype=np.float32).reshape(shape).tolist())
    return sse_bytes(
        "results", json.dumps({"job": job, "offset": offset, "embeddings": embeddings})
    )


def public_path(path: str) -> bool:
    return path in PUBLIC or path.startswith("/dashboard/")


def presented_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("X-API-Key")


def sse_bytes(event: str, data: str) -> bytes:
    """One server-sent event; `data` is JSON text (one line)."""
    return f"event: {event}\ndata: {data}\n\n".encode()


async def event_stream(
    request: web.Request, body: Callable[[web.StreamResponse], Awaitable[None]]
) -> web.StreamResponse:
    """A server-sent event stream written by `body` until it returns or the client leaves."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await body(response)
    except ConnectionResetError:  # the client went away
        pass
    return response


async def sse(response: web.StreamResponse, event: str, data: Any) -> None:
    await response.write(sse_bytes(event, json.dumps(data, default=str)))


async def json_body(request: web.Request) -> Any:
    raw = await request.read()  # over client_max_size: 413, answered by the middleware
    try:
        return await asyncio.to_thread(json.loads, raw)  # up to max_body_bytes: off the loop
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JobError("body", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise JobError("body", "JSON nested too deeply") from None


def _number_param(
    request: web.Request, name: str, default: float, low: float, high: float, kind: type
) -> Any:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise JobError(name, f"must be {what}, got {raw!r}") from None
    if not low <= value <= high:  # (NaN fails this too)
        raise JobError(name, f"must be from {_plain(low)} to {_plain(high)}")
    return value


def _plain(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    value: int = _number_param(request, name, default, low, high, int)
    return value


def float_param(request: web.Request, name: str, default: float, low: float, high: float) -> float:
    value: float = _number_param(request, name, default, low, high, float)
    return value


def job_json(job: JobRow, done: int) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind,
        "model": job.model,
        "state": job.state,
        "microbatches": job.microbatches,
        "done": done,
        "progress": round(done / job.microbatches, 4) if job.microbatches else 1.0,
        "created": job.created,
        "updated": job.updated,
        "error": job.error or None,
    }
