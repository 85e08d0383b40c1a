"""The provider daemon as a real process against a broker stand-in (also a real process)."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.procs import Proc

pytestmark = pytest.mark.timeout(120)


def _joined(standin: Proc, provider: Proc) -> str:
    peer: str = provider.wait_for("listening")["peer_id"]
    standin.wait_for("join", lambda e: e["peer"] == peer)
    return peer


def _stage_sha(package: Path, index: int) -> str:
    manifest = json.loads((package / "manifest.json").read_bytes())
    sha: str = manifest["stages"][index]["sha256"]
    return sha


def test_join_heartbeat_and_assignment(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    prov = provider(broker)
    peer = prov.wait_for("listening")["peer_id"]
    join = broker.wait_for("join", lambda e: e["peer"] == peer)
    profile = join["profile"]
    # Measured, not declared: FLOP/s from a real matmul, and the network to the broker.
    assert profile["executors"] and profile["executors"][0]["flops"]["float32"] > 1e8
    assert profile["rtt_s"] > 0 and profile["net_up_bytes_s"] > 0
    assert profile["memory_limit_bytes"] > 0
    broker.wait_for("heartbeat", lambda e: e["peer"] == peer and e["seq"] >= 2)
    broker.send({"cmd": "assign", "peer": peer, "key": "minilm/1", "stage": 1})
    assert broker.wait_for("assign_ack")["accepted"]
    status = broker.wait_for("status", lambda e: e["key"] == "minilm/1")
    assert status["state"] == "ready", status
    broker.wait_for("heartbeat", lambda e: e["peer"] == peer and "minilm/1" in e["loaded"])


def test_an_interrupted_download_resumes_and_verifies(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    sha = _stage_sha(minilm_package, 1)
    size = (minilm_package / f"{sha}.onnx").stat().st_size
    broker = standin(minilm_package, "--cut", f"{sha}:{size // 2}")
    prov = provider(broker)
    peer = _joined(broker, prov)
    broker.send({"cmd": "assign", "peer": peer, "key": "minilm/1", "stage": 1})
    broker.wait_for("http_cut", lambda e: e["sha"] == sha)
    resumed = broker.wait_for("http_get", lambda e: e["sha"] == sha and e["start"] > 0)
    assert resumed["start"] >= size // 4  # it asked for the rest, not the whole file again
    assert broker.wait_for("status", lambda e: e["key"] == "minilm/1")["state"] == "ready"


def test_a_corrupt_artifact_is_refused_clearly(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    prov = provider(broker)
    peer = _joined(broker, prov)
    # The manifest promises stage 1's hash; the server sends stage 2's file instead.
    broker.send(
        {
            "cmd": "assign",
            "peer": peer,
            "key": "minilm/1",
            "stage": 1,
            "sha": _stage_sha(minilm_package, 2),
        }
    )
    status = broker.wait_for("status", lambda e: e["key"] == "minilm/1")
    assert status["state"] == "failed"
    assert "SHA-256" in status["reason"] and "deleted" in status["reason"]


def test_an_oversized_stage_is_refused_before_downloading(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    prov = provider(broker, "--max-memory", "0.01")  # 10 MB; the stage is 21 MB
    peer = _joined(broker, prov)
    broker.send({"cmd": "assign", "peer": peer, "key": "minilm/1", "stage": 1})
    ack = broker.wait_for("assign_ack")
    assert not ack["accepted"] and "memory budget" in ack["reason"]
    mark = broker.mark()
    broker.wait_for("heartbeat", lambda e: e["peer"] == peer, since=mark)  # time for a GET
    broker.drain_events()
    assert not [e for e in broker.events if e["event"] == "http_get"]


def test_sigkill_then_restart_reverifies_the_cache_and_drops_a_truncated_file(
    standin: Callable[..., Proc],
    provider: Callable[..., Proc],
    minilm_package: Path,
    tmp_path: Path,
) -> None:
    broker = standin(minilm_package)
    data = tmp_path / "prov"
    prov = provider(broker, data_dir=data)
    peer = _joined(broker, prov)
    broker.send({"cmd": "assign", "peer": peer, "key": "minilm/1", "stage": 1})
    assert broker.wait_for("status", lambda e: e["key"] == "minilm/1")["state"] == "ready"
    # the daemon's heap was settled once up and after the load (`p2p.heap`)
    assert prov.wait_for("joined")["heap_settle_ms"] > 0
    assert prov.wait_for("stage_ready")["heap_settle_ms"] > 0
    prov.signal(signal.SIGKILL)
    prov.wait()
    sha = _stage_sha(minilm_package, 1)
    cached = data / "artifacts" / "objects" / sha
    with open(cached, "r+b") as f:  # as a crash mid-write or a bad disk would leave it
        f.truncate(cached.stat().st_size // 3)
    again = provider(broker, data_dir=data)
    dropped = again.wait_for("cache_dropped")
    assert dropped["artifacts"] == [sha]
    assert not cached.exists()
    again.wait_for("joined")


def test_the_provider_rejoins_a_restarted_broker_and_reannounces_its_stages(
    standin: Callable[..., Proc],
    provider: Callable[..., Proc],
    minilm_package: Path,
    tmp_path: Path,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker_dir = tmp_path / "broker"
    broker = standin(minilm_package, "--port", str(port), data_dir=broker_dir)
    prov = provider(broker)
    peer = _joined(broker, prov)
    broker.send({"cmd": "assign", "peer": peer, "key": "minilm/1", "stage": 1})
    assert broker.wait_for("status", lambda e: e["key"] == "minilm/1")["state"] == "ready"
    broker.signal(signal.SIGKILL)
    broker.wait()
    prov.wait_for("broker_unreachable")
    restarted = standin(minilm_package, "--port", str(port), data_dir=broker_dir)
    rejoin = restarted.wait_for("join", lambda e: e["peer"] == peer, timeout=60)
    assert rejoin["loaded"] == ["minilm/1"]  # what it still has, so no reload is needed
    restarted.wait_for("heartbeat", lambda e: e["peer"] == peer and e["known"])
