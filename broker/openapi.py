"""The HTTP API's operations, one table: the router is built from it (`broker/http.py`) and
the OpenAPI 3.1 document served at `/openapi.json` is generated from it and from the typed
bodies of `proto/api/`, so neither can drift from the other."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from ir.manifest import ModelManifest
from proto.api import common, jobs, keys, openai, swarm

JSON = "application/json"
SSE = "text/event-stream"
BINARY = "application/octet-stream"


@dataclass(frozen=True)
class Op:
    """One operation. `body` and `answer` are types of `proto.api` (or unions of them, or
    `bytes` with their media type); `query` a struct whose fields are the query parameters."""

    method: str
    path: str
    tag: str
    summary: str
    answer: Any = None
    status: int = 200
    body: Any = None
    body_media: str = JSON
    media: str = JSON  # of the answer
    query: Any = None
    streams: bool = False  # it may answer with server-sent events instead (`stream: true`)
    public: bool = False  # no API key needed
    admin: bool = False  # an admin key needed (with keys configured; 403 for other keys)
    gateway: bool = False  # a gateway's key (or an admin key) needed, as for `admin`
    errors: tuple[int, ...] = (400, 401, 404)


M = "/v1/models/{name}"
J = "/v1/jobs/{id}"
OPS: tuple[Op, ...] = (
    Op("GET", "/", "dashboard", "The dashboard page", bytes, media="text/html", public=True,
       errors=()),
    Op("GET", "/dashboard/{path}", "dashboard", "The dashboard's static files", bytes,
       media="text/plain", public=True, errors=(404,)),
    Op("GET", "/openapi.json", "swarm", "This document", dict, public=True, errors=()),
    Op("GET", "/healthz", "swarm", "Liveness and a short summary", common.Health, public=True,
       errors=()),
    Op("GET", "/metrics", "swarm", "Prometheus metrics", bytes, media="text/plain",
       errors=(401,)),
    Op("GET", "/v1/swarm", "swarm", "Providers and models", swarm.Swarm, errors=(401,)),
    Op("GET", "/v1/providers", "swarm", "Providers with pool, hardware, load, health and "
       "reputation; quarantined providers", swarm.ProviderList, errors=(401,)),
    Op("POST", "/v1/providers/{peer}/report", "swarm", "A client's request to this provider "
       "failed (the broker pings it and declares it lost if it does not answer), or, with "
       "wrong_output, its answer disagreed with a shadow step (the broker probes it and "
       "quarantines it if its answer is wrong)", swarm.Report, body=swarm.ReportRequest),
    Op("GET", "/v1/stream", "swarm", "The dashboard feed: `snapshot`, `event` and `sample` "
       "server-sent events", bytes, media=SSE, query=common.StreamQuery),
    Op("GET", "/v1/metrics/history", "swarm", "The dashboard's charts: the swarm sampled every "
       "few seconds (tokens/s, requests/s and queues per model, providers' utilisation and "
       "stage latency, gateways' traffic, failovers, verification results), the last hour",
       swarm.History, query=swarm.HistoryQuery, errors=(401,)),
    Op("GET", "/v1/events", "swarm", "The event log", common.EventList, query=common.EventsQuery),
    Op("GET", "/v1/models", "models", "The models, in OpenAI's list shape, with whether the "
       "swarm serves each", swarm.ModelList, errors=(401,)),
    Op("POST", "/v1/models", "models", "Register (or replace) a model: its manifest.json, once "
       "its files are uploaded (admin key)", swarm.Model, status=201, body=ModelManifest,
       admin=True, errors=(400, 401, 403, 404)),
    Op("GET", M, "models", "A model's stages and route", swarm.Model),
    Op("GET", M + "/route", "models", "The providers serving each stage (for clients opening "
       "sessions)", swarm.Model),
    Op("GET", M + "/manifest", "models", "A model's manifest.json (clients fetch their own "
       "stages and tokenizer by it)", ModelManifest),
    Op("POST", M + "/pick", "models", "A provider for one stage of a client's generation "
       "session (waits for one up to `timeout` s)", swarm.Picked, body=swarm.PickRequest,
       errors=(400, 401, 404, 503)),
    Op("POST", M + "/verify", "models", "Check a generation: the broker runs the model over "
       "the tokens it fed in one pass and compares each provider session's signed "
       "commitments; the first stage whose commitments it does not reproduce has its "
       "providers quarantined", swarm.Verdict, body=swarm.VerifyRequest,
       errors=(400, 401, 404)),
    Op("PUT", "/v1/artifacts/{sha}", "models", "Upload an artifact; kept only if its SHA-256 "
       "matches (admin key)", common.Stored, status=201, body=bytes, body_media=BINARY,
       admin=True, errors=(400, 401, 403, 413)),
    Op("GET", "/v1/artifacts/{sha}", "models", "Download an artifact (range requests "
       "supported); providers use their assignment's link (`peer` and `token`) instead of a "
       "key", bytes, media=BINARY, query=common.ArtifactQuery),
    Op("GET", "/v1/jobs", "jobs", "Recent jobs", jobs.JobList, query=jobs.JobsQuery),
    Op("POST", "/v1/jobs", "jobs", "Submit a batch job (`kind`: embed, the default, "
       "finetune or train)", jobs.Job, status=201, body=jobs.JobRequest),
    Op("GET", J, "jobs", "A job's state and progress (optionally waiting for the next "
       "change)", jobs.Job, query=jobs.JobQuery),
    Op("POST", J + "/cancel", "jobs", "Cancel a job", jobs.Job),
    Op("GET", J + "/results", "jobs", "A job's results: an embed job's embeddings once it has "
       "succeeded; a fine-tune or train job's steps, in any state", jobs.Results,
       query=jobs.ResultsQuery, errors=(400, 401, 404, 409)),
    Op("DELETE", J + "/results", "jobs", "Forget a job's results", jobs.Deleted),
    Op("GET", J + "/adapter", "jobs", "A succeeded fine-tune job's trained adapter "
       "(safetensors: every stage's lora_A.* and lora_B.* tensors, with the model, method and "
       "rank in its metadata)", bytes, media=BINARY, errors=(401, 404, 409)),
    Op("GET", J + "/story", "jobs", "The events that tell what happened to a job", jobs.Story),
    Op("GET", J + "/events", "jobs", "A job's events as they happen, then `results` blocks and "
       "`end` (server-sent events)", bytes, media=SSE),
    Op("POST", "/v1/embeddings", "openai", "OpenAI-style embeddings", openai.EmbeddingList,
       body=openai.EmbeddingRequest, errors=(400, 401, 404, 429, 503)),
    Op("POST", "/v1/completions", "openai", "OpenAI-style completions; `stream: true` answers "
       "with server-sent events of the same shape, ending in `data: [DONE]`",
       openai.Completion, body=openai.CompletionRequest, streams=True,
       errors=(400, 401, 404, 429, 503)),
    Op("POST", "/v1/chat/completions", "openai", "OpenAI-style chat completions: the messages "
       "through the model's chat template; `stream: true` answers with `chat.completion.chunk` "
       "server-sent events, ending in `data: [DONE]`",
       openai.ChatCompletion, body=openai.ChatCompletionRequest, streams=True,
       errors=(400, 401, 404, 429, 503)),
    Op("GET", "/v1/keys", "keys", "The managed API keys (never the keys themselves)",
       keys.KeyList, admin=True, errors=(401, 403)),
    Op("POST", "/v1/keys", "keys", "Add a managed API key with a role and optional limits; "
       "the key is in this answer alone", keys.KeyCreated, status=201, body=keys.KeyRequest,
       admin=True, errors=(400, 401, 403)),
    Op("DELETE", "/v1/keys/{id}", "keys", "Revoke a managed key (gateways refuse it within "
       "the `ttl_s` of their cached decision)", keys.KeyInfo, admin=True,
       errors=(401, 403, 404)),
    Op("POST", "/v1/gateway/keys", "gateway", "A key's decision, for a gateway to cache for "
       "`ttl_s`", keys.Decision, body=keys.KeyQuery, gateway=True, errors=(400, 401, 403)),
    Op("POST", "/v1/gateway/admit", "gateway", "A lease on one request of a user's key, under "
       "its limits and the model's batch slots (429 with Retry-After when over one)",
       keys.Admitted, body=keys.AdmitRequest, gateway=True, errors=(400, 401, 403, 429)),
    Op("POST", "/v1/gateway/release", "gateway", "End a lease", keys.Released,
       body=keys.Release, gateway=True, errors=(400, 401, 403)),
    Op("POST", "/v1/gateway/report", "gateway", "A gateway's leases still held (renewed) and "
       "its traffic counters", keys.ReportAck, body=keys.GatewayReport, gateway=True,
       errors=(400, 401, 403)),
)  # fmt: skip

PARAMS = {"name": "the model's name", "id": "the job's or the key's id", "sha": "SHA-256 (hex)",
          "peer": "the provider's peer id", "path": "a file name"}  # fmt: skip
WHY = {400: "bad input; `field` names it", 401: "no valid API key",
       403: "an admin (or for /v1/gateway, a gateway) key is needed", 404: "no such thing",
       409: "not yet possible", 413: "too large", 429: "too many requests in progress",
       503: "no provider in time"}  # fmt: skip


def _media(kind: Any, media: str, refs: dict[Any, Any]) -> dict[str, Any]:
    if kind is bytes:
        schema: dict[str, Any] = {"type": "string", "format": "binary"}
        if media == SSE:
            schema = {"type": "string", "description": "server-sent events"}
    elif kind is dict:
        schema = {"type": "object"}
    elif isinstance(kind, types.UnionType):  # one of several structs (by a field's value)
        schema = {"oneOf": [refs[k] for k in typing.get_args(kind)]}
    else:
        schema = refs[kind]
    return {media: {"schema": schema}}


def _query(kind: Any) -> list[dict[str, Any]]:
    if kind is None:
        return []
    (ref,), components = msgspec.json.schema_components([kind])
    props = components[ref["$ref"].rsplit("/", 1)[1]]["properties"]
    out = []
    for name, schema in props.items():
        schema = dict(schema)
        description = schema.pop("description", None)
        if "anyOf" in schema:  # `T | None`: the parameter is optional; its schema is T's
            (schema,) = [dict(s) for s in schema.pop("anyOf") if s.get("type") != "null"]
            description = schema.pop("description", description)
        param = {"name": name, "in": "query", "required": False, "schema": schema}
        if description:
            param["description"] = description
        out.append(param)
    return out


def _tidy(schema: Any) -> None:
    """Where a type spells its schema out (`oneOf`), drop the one msgspec derived (`anyOf`);
    a constant field (OpenAI's `object`) is always present."""
    if isinstance(schema, dict):
        if "oneOf" in schema and "anyOf" in schema:
            del schema["anyOf"]
        props = schema.get("properties", {})
        if "object" in props and len(props["object"].get("enum", ())) == 1:
            schema["required"] = sorted({*schema.get("required", ()), "object"})
        for value in schema.values():
            _tidy(value)
    elif isinstance(schema, list):
        for value in schema:
            _tidy(value)


@cache
def document() -> dict[str, Any]:
    """The API as an OpenAPI 3.1 document."""
    kinds = [k for op in OPS for k in (op.body, op.answer) if k not in (None, bytes, dict)]
    kinds = [m for k in kinds for m in typing.get_args(k) or (k,)] + [common.Error]
    unique = list(dict.fromkeys(kinds))
    schemas, components = msgspec.json.schema_components(
        unique, ref_template="#/components/schemas/{name}"
    )
    refs = dict(zip(unique, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for op in OPS:
        params = [
            {"name": p, "in": "path", "required": True, "description": PARAMS[p],
             "schema": {"type": "string"}}
            for p in (s[1:-1] for s in op.path.split("/") if s.startswith("{"))
        ]  # fmt: skip
        content = _media(op.answer, op.media, refs)
        if op.streams:
            content |= _media(bytes, SSE, refs)
        responses: dict[str, Any] = {str(op.status): {"description": "OK", "content": content}}
        for code in op.errors:
            responses[str(code)] = {"$ref": f"#/components/responses/E{code}"}
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": "_".join(
                [op.method.lower(), *(p.strip("{}") for p in op.path.split("/") if p)]
            ).replace(".", "_"),
            "tags": [op.tag],
            "parameters": params + _query(op.query),
            "responses": responses,
        }
        if op.body is not None:
            content = _media(op.body, op.body_media, refs)
            entry["requestBody"] = {"required": True, "content": content}
        if op.public:
            entry["security"] = []
        if op.admin:
            entry["x-admin"] = True  # (the same schemes; the key must be an admin key)
        if op.gateway:
            entry["x-gateway"] = True  # (a gateway's key or an admin key)
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    for schema in components.values():
        _tidy(schema)
    error = {"application/json": {"schema": refs[common.Error]}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "FusionAI broker API",
            "version": "1",
            "description": "The broker's HTTP API: the swarm, models, batch jobs, OpenAI-style "
            "embeddings and completions, metrics and the dashboard. With API keys configured "
            "every operation but those with empty `security` needs `Authorization: Bearer "
            "KEY` or `X-API-Key: KEY`, those marked `x-admin` (managing keys, adding or "
            "replacing a model, uploading an artifact) an admin key, and those marked "
            "`x-gateway` a gateway's or an admin key: other keys get 403 there. Every "
            'error is `{"error": {"message", "field"?}}`.',
        },
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": paths,
        "components": {
            "schemas": components,
            "responses": {f"E{c}": {"description": d, "content": error} for c, d in WHY.items()},
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key given to the broker with --api-key, "
                    "--admin-key or --api-keys-file, or added with `fusionai keys add`",
                },
                "apiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-API-Key",
                    "description": "the same keys, in this header instead",
                },
            },
        },
    }


@cache
def document_bytes() -> bytes:
    return json.dumps(document(), indent=1).encode()
