"""Transport benchmark: round trips and bulk throughput between two processes on loopback.

    python benchmarks/transport.py [--count 2000] [--sizes 1,16,100]

Prints one JSON object. Baselines are measured in the same run, because these machines are
shared and noisy: `trio_rtt_p50_ms` is a plain py-libp2p request/response inside trio (no
facade, no framing), and `tcp_mb_s` / `http_mb_s` are raw asyncio TCP and aiohttp HTTP.
Sizes are in MB of 2**20 bytes; speeds in MB/s of 2**20 bytes.

    trio_rtt_p50_ms           plain py-libp2p, 3 KB echo on one long-lived stream, in trio
    rtt_p50_ms, rtt_p99_ms    3 KB typed request to a control handler, from asyncio
    hop_rtt_p50_ms, _p99_ms   the same to a compute handler (the activation hot path)
    hop_rtt_p99_ms_under_bulk the hot path while a 100 MB transfer runs on another stream
    libp2p_mb_s, tcp_mb_s, http_mb_s   bulk one-way transfer, keyed by payload size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from p2p import Host
from p2p.testing import (
    ECHO_COMPUTE,
    ECHO_CONTROL,
    LOCAL,
    SINK,
    Chunk,
    Echo,
    raw_rtt_samples,
    serve_raw_echo,
    serve_test_protocols,
)

MB = 1 << 20
REQUEST_BYTES = 3000


# ---- the serving process --------------------------------------------------------------------


async def _tcp_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            header = await reader.readexactly(8)
        except asyncio.IncompleteReadError:
            return
        remaining = int.from_bytes(header, "big")
        while remaining:
            data = await reader.read(min(remaining, 4 * MB))
            if not data:
                return
            remaining -= len(data)
        writer.write(b"k")
        await writer.drain()


async def serve() -> None:
    from aiohttp import web

    async def http_sink(request: web.Request) -> web.Response:
        total = 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
        return web.Response(text=str(total))

    app = web.Application(client_max_size=1 << 31)
    app.router.add_post("/sink", http_sink)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = runner.addresses[0][1]
    tcp = await asyncio.start_server(_tcp_sink, "127.0.0.1", 0)
    tcp_port = tcp.sockets[0].getsockname()[1]
    async with Host(LOCAL) as host:
        serve_test_protocols(host)
        serve_raw_echo(host)
        print(json.dumps({"addr": host.addrs[0], "tcp": tcp_port, "http": http_port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    tcp.close()
    await runner.cleanup()


# ---- the measuring process ------------------------------------------------------------------


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e3, 3)


async def _rtts(host: Host, peer: str, spec: Any, count: int) -> list[float]:
    msg = Echo(data=b"\x01" * REQUEST_BYTES)
    for _ in range(50):  # warm up: stream open, caches
        await host.request(peer, spec, msg)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await host.request(peer, spec, msg)
        samples.append(time.perf_counter() - start)
    return samples


async def _libp2p_bulk(host: Host, peer: str, size_mb: int) -> float:
    chunk = b"\x02" * MB
    start = time.perf_counter()
    async with await host.open_stream(peer, SINK) as stream:
        for seq in range(size_mb):
            await stream.send(Chunk(seq=seq, data=chunk))
        await stream.close()
        got = (await stream.recv()).seq
    elapsed = time.perf_counter() - start
    assert got == size_mb * MB, got
    return size_mb / elapsed


async def _tcp_bulk(port: int, size_mb: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = b"\x03" * MB
    start = time.perf_counter()
    writer.write((size_mb * MB).to_bytes(8, "big"))
    for _ in range(size_mb):
        writer.write(chunk)
        await writer.drain()
    assert await reader.readexactly(1) == b"k"
    elapsed = time.perf_counter() - start
    writer.close()
    await writer.wait_closed()
    return size_mb / elapsed


async def _http_bulk(session: Any, port: int, size_mb: int) -> float:
    chunk = b"\x04" * MB

    async def body() -> Any:
        for _ in range(size_mb):
            yield chunk

    start = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/sink", data=body()) as resp:
        got = int(await resp.text())
    elapsed = time.perf_counter() - start
    assert got == size_mb * MB, got
    return size_mb / elapsed


async def measure(info: dict[str, Any], count: int, sizes: list[int]) -> dict[str, Any]:
    import aiohttp

    result: dict[str, Any] = {"count": count, "request_bytes": REQUEST_BYTES}
    raw = await asyncio.to_thread(raw_rtt_samples, info["addr"], REQUEST_BYTES, count + 50)
    result["trio_rtt_p50_ms"] = _pct(raw[50:], 0.5)
    result["trio_rtt_p99_ms"] = _pct(raw[50:], 0.99)
    async with Host(LOCAL) as host, aiohttp.ClientSession() as session:
        peer = await host.connect(info["addr"])
        control = await _rtts(host, peer, ECHO_CONTROL, count)
        result["rtt_p50_ms"], result["rtt_p99_ms"] = _pct(control, 0.5), _pct(control, 0.99)
        hop = await _rtts(host, peer, ECHO_COMPUTE, count)
        result["hop_rtt_p50_ms"], result["hop_rtt_p99_ms"] = _pct(hop, 0.5), _pct(hop, 0.99)

        bulk = asyncio.create_task(_libp2p_bulk(host, peer, 100))
        await asyncio.sleep(0.05)
        under: list[float] = []
        msg = Echo(data=b"\x01" * REQUEST_BYTES)
        while not bulk.done():
            start = time.perf_counter()
            await host.request(peer, ECHO_COMPUTE, msg)
            under.append(time.perf_counter() - start)
        await bulk
        result["hop_rtt_p50_ms_under_bulk"] = _pct(under, 0.5)
        result["hop_rtt_p99_ms_under_bulk"] = _pct(under, 0.99)
        result["hop_requests_under_bulk"] = len(under)

        for name, fn in (
            ("libp2p_mb_s", lambda n: _libp2p_bulk(host, peer, n)),
            ("tcp_mb_s", lambda n: _tcp_bulk(info["tcp"], n)),
            ("http_mb_s", lambda n: _http_bulk(session, info["http"], n)),
        ):
            speeds = {}
            for size in sizes:
                runs = [await fn(size) for _ in range(3 if size < 100 else 1)]
                speeds[str(size)] = round(statistics.median(runs), 1)
            result[name] = speeds
    result["hop_over_trio_ms"] = round(result["hop_rtt_p50_ms"] - result["trio_rtt_p50_ms"], 3)
    result["targets_met"] = {
        "hop_rtt_p50_ms <= 3": result["hop_rtt_p50_ms"] <= 3,
        "hop_rtt_p50_ms <= trio_rtt_p50_ms + 0.6": result["hop_over_trio_ms"] <= 0.6,
        'libp2p_mb_s["100"] >= 80': result["libp2p_mb_s"].get("100", 0) >= 80,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="round trips per measurement")
    parser.add_argument("--sizes", default="1,16,100", help="bulk sizes in MB, comma-separated")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return 0
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        info = json.loads(server.stdout.readline())
        sizes = [int(s) for s in args.sizes.split(",")]
        result = asyncio.run(measure(info, args.count, sizes))
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=30)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
