"""The API's contract: the OpenAPI document (generated from the operations table and the typed
bodies of `proto.api`) matches the router, and no input crashes the broker."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.httpkit import PUBLIC
from broker.openapi import OPS, document
from tests.test_broker.conftest import BrokerProc, api

pytestmark = pytest.mark.timeout(180)


def spec() -> dict[str, Any]:
    return document()


async def test_openapi_document_matches_the_router(tmp_path: Path) -> None:
    from broker.config import BrokerConfig
    from broker.service import Broker

    config = BrokerConfig(data_dir=tmp_path, listen=("/ip4/127.0.0.1/tcp/0",), http_port=0)
    async with Broker(config) as broker:
        assert broker._runner is not None
        routes = set()
        for route in broker._runner.app.router.routes():
            if route.method == "HEAD":
                continue
            info = route.resource.get_info() if route.resource is not None else {}
            path = info.get("path") or info.get("formatter") or info["prefix"] + "/{path}"
            routes.add((path, route.method.lower()))
    documented = {(path, method) for path, ops in spec()["paths"].items() for method in ops}
    assert routes == documented, (routes - documented, documented - routes)
    # what needs no API key is what the document says needs none
    public = {op.path for op in OPS if op.public}
    assert public == PUBLIC | {"/dashboard/{path}"}
    for path, ops in spec()["paths"].items():
        for op in ops.values():
            assert (op.get("security") == []) == (path in public), path


def test_openapi_document_is_well_formed_and_every_body_is_typed() -> None:
    doc = spec()
    assert doc["openapi"].startswith("3.")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            ok = next(c for c in op["responses"] if c.startswith("2"))
            content = op["responses"][ok]["content"]
            if "application/json" in content and path not in ("/openapi.json",):
                schema = content["application/json"]["schema"]  # a named struct, not "object"
                assert "$ref" in schema or "oneOf" in schema, (method, path, schema)
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                assert "$ref" in body["schema"] or "oneOf" in body["schema"], (method, path)
    schemas = doc["components"]["schemas"]
    limits = schemas["FinetuneJobRequest"]["properties"]["steps"]
    assert limits["minimum"] == 1 and limits["maximum"] == 100_000
    assert schemas["EmbedJobRequest"]["additionalProperties"] is False

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if "$ref" in node else []
            return own + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):  # every reference resolves
        node: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
    for path, ops in doc["paths"].items():
        params = {p[1:-1] for p in path.split("/") if p.startswith("{")}
        for method, op in ops.items():
            assert op["responses"], (path, method)
            named = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert named == params, (path, method)


def nasty_values(rng: random.Random, depth: int = 0) -> Any:
    """Random JSON of the kinds that break parsers: wrong types, huge numbers, odd text."""
    leaves: list[Callable[[], Any]] = [
        lambda: rng.choice([None, True, False, 0, -1, 2**70, 1e308, -0.0, 3.5]),
        lambda: rng.choice(["", "x" * 10_000, "\x00\ud7ff", "💥" * 50, "minilm", "../../etc"]),
        lambda: [rng.randint(-(2**40), 2**40) for _ in range(rng.randint(0, 20))],
        lambda: [[rng.randint(-5, 10**9)] * rng.randint(0, 3)],
    ]
    if depth < 3 and rng.random() < 0.4:
        keys = [
            "model",
            "input",
            "prompt",
            "texts",
            "token_ids",
            "max_tokens",
            "stream",
            "kind",
            "microbatch",
            "temperature",
            "stop",
            "encoding_format",
            "n",
            rng.choice("abc"),
        ]
        return {rng.choice(keys): nasty_values(rng, depth + 1) for _ in range(rng.randint(0, 6))}
    return rng.choice(leaves)()


def test_nothing_a_client_sends_crashes_the_broker(broker: Callable[..., BrokerProc]) -> None:
    b = broker("--max-body-mb", "2")
    rng = random.Random(1234)
    bodies: list[bytes] = [
        b"",
        b"null",
        b"{",
        b"\xff\xfe",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "minilm", "input": "' + b"a" * 3_000_000 + b'"}',
        json.dumps({"model": "minilm", "input": ["x"] * 5000}).encode(),
        json.dumps({"model": "x", "prompt": "hi", "max_tokens": 10**12}).encode(),
    ]
    bodies += [json.dumps(nasty_values(rng)).encode() for _ in range(150)]
    targets = [
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/jobs"),
        ("POST", "/v1/models"),
        ("PUT", "/v1/artifacts/" + "0" * 64),
        ("PUT", "/v1/artifacts/../../x"),
        ("GET", "/v1/jobs?limit=-5"),
        ("GET", "/v1/events?since=abc"),
        ("GET", "/v1/jobs/%00/results?offset=1e9"),
        ("POST", "/v1/jobs/nope/cancel"),
        ("DELETE", "/v1/models"),
    ]
    statuses: dict[int, int] = {}
    for i, data in enumerate(bodies):
        method, path = targets[i % len(targets)] if i >= len(targets) else targets[i]
        for m, p in [(method, path)] if i >= 8 else targets:
            req = urllib.request.Request(b.http + p, data=data, method=m)
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    status, body = resp.status, resp.read()
            except urllib.error.HTTPError as exc:
                status, body = exc.code, exc.read()
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (m, p, data[:200], body[:500])
            if status >= 400:
                assert json.loads(body)["error"]["message"], body
    assert set(statuses) <= {200, 201, 400, 404, 405, 409, 413}, statuses
    assert statuses.get(400, 0) > 50
    with urllib.request.urlopen(b.http + "/healthz", timeout=10) as resp:
        assert json.loads(resp.read())["ok"] is True
    status, served = api(b.http, "GET", "/openapi.json")  # the document the broker serves
    assert status == 200 and served == json.loads(json.dumps(document()))
    assert b.proc.proc.poll() is None
