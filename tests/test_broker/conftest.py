"""A real broker process and real provider processes on 127.0.0.1, and HTTP helpers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import ROOT, Proc, broker_command, provider_command, wait_until

HEARTBEAT_S = 0.5  # fast heartbeats keep failure detection within a second or two


def free_port() -> int:
    """A port the OS says is free now (for a broker that must restart on the same one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class BrokerProc:
    proc: Proc
    addr: str  # p2p multiaddr with the peer id
    http: str  # base URL of the HTTP API


def api(http: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> Any:
    """(status, JSON) of one request to the broker's HTTP API."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(http + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def pools(http: str) -> dict[str, str]:
    _, out = api(http, "GET", "/v1/providers")
    return {p["peer_id"]: p["pool"] for p in out["providers"]}


def wait_joined(http: str, peers: Iterable[str], timeout: float = 60.0) -> None:
    """Until the broker lists every one of `peers`. A provider that is listening may not have
    joined yet, and a model added then would be placed without it."""
    wanted = set(peers)
    wait_until(f"{len(wanted)} providers joined", lambda: wanted <= set(pools(http)), timeout)


def add_model(http: str, package: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "model",
            "add",
            str(package),
            "--broker",
            http,
            "--json",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    model: dict[str, Any] = json.loads(done.stdout)
    return model


def wait_ready(http: str, model: str, backups: int = 0, timeout: float = 90.0) -> dict[str, Any]:
    """The model's route once every stage is served (and has `backups` warm backups)."""

    def check() -> dict[str, Any] | None:
        _, out = api(http, "GET", f"/v1/models/{model}")
        ok = out["ready"] and all(len(s["backups"]) >= backups for s in out["stages"])
        return out if ok else None

    result: dict[str, Any] = wait_until(f"{model} served", check, timeout)
    return result


def wait_job(http: str, job: str, timeout: float = 180.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        status, out = api(http, "GET", f"/v1/jobs/{job}")
        if status == 200 and out["state"] in ("succeeded", "failed", "cancelled"):
            return out
        return None

    result: dict[str, Any] = wait_until(f"job {job} to end", check, timeout)
    return result


def local_embeddings(package: Path, texts: list[str]) -> np.ndarray[Any, Any]:
    """The same texts through the whole package in this process (the reference)."""
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline
    from tests.test_ir.test_split import wire_hop

    pkg = load_package(package)
    stages = ClientStages(package)
    ids, mask = stages.tokenize(texts)
    executors = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    pipeline = LocalPipeline(pkg.manifest, executors, hop=wire_hop(pkg.manifest))
    out: np.ndarray[Any, Any] = pipeline.encode(ids, mask)
    return out


@pytest.fixture
def broker(spawn: Callable[..., Proc], tmp_path: Path) -> Callable[..., BrokerProc]:
    def _broker(
        *extra: str, data_dir: Path | None = None, port: int = 0, http_port: int = 0
    ) -> BrokerProc:
        data = data_dir or tmp_path / "broker"
        proc = spawn(
            broker_command(data, *extra, port=port, http_port=http_port, heartbeat_s=HEARTBEAT_S)
        )
        started = proc.wait_for("broker_started", timeout=30)
        return BrokerProc(proc, started["addrs"][0], started["http"])

    return _broker


@pytest.fixture
def provider(spawn: Callable[..., Proc], tmp_path: Path) -> Callable[..., Proc]:
    count = [0]

    def _provider(addr: str, *extra: str, data_dir: Path | None = None) -> Proc:
        count[0] += 1
        data = data_dir or tmp_path / f"provider-{count[0]}"
        return spawn(provider_command(addr, data, "--max-memory", "2", "--drain", "5", *extra))

    return _provider


def documented(http: str, method: str, path: str, template: str, body: Any = None) -> Any:
    """One call's JSON answer, checked against the schema `/openapi.json` documents for its
    operation (`template`: the path as documented, e.g. /v1/models/{name})."""
    import jsonschema_rs

    from broker.openapi import document

    status, out = api(http, method, path, body)
    doc = document()
    responses = doc["paths"][template][method.lower()]["responses"]
    assert str(status) in responses and status < 300, (method, path, status, out)
    schema = responses[str(status)]["content"]["application/json"]["schema"]
    errors = list(jsonschema_rs.validator_for({**schema, "components": doc["components"]})
                  .iter_errors(out))  # fmt: skip
    assert not errors, (method, path, [str(e)[:300] for e in errors[:3]])
    return out
