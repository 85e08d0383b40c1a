"""HTTP API benchmark: control-endpoint latency under open-loop load, and embeddings latency.

    python benchmarks/http_api.py [--rate 500] [--seconds 20]

Prints one JSON object:
    api_p50_ms, api_p99_ms   latency of GET /v1/swarm, /v1/jobs, /v1/models, /v1/providers and
                             /v1/jobs/{id} in turn, sent open-loop at `--rate` requests/s for
                             `--seconds` (measured from each request's scheduled time, so a
                             slow broker cannot slow the load down). Targets: p99 <= 100.
    errors                   requests that failed or did not answer 200. Target 0.
    sent, achieved_rate      requests sent, and requests/s actually issued.
    baseline_p50_ms, baseline_p99_ms   the same load on a minimal aiohttp app answering a fixed
                             JSON body, in another process, same run: what HTTP costs here.
    api_p99_ratio            api_p99_ms / baseline_p99_ms.
    embeddings_p50_ms        single-text POST /v1/embeddings (all-MiniLM-L6-v2, two provider
                             stages on two provider processes), sequential, after a warm-up.
    embeddings_local_ms      the same text through the whole model in this process (ORT).
    embeddings_ratio         embeddings_p50_ms / embeddings_local_ms.
The broker runs with three provider processes heartbeating (one a warm backup) and a few
finished jobs in its database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from benchmarks.broker_service import Swarm, _api, _package, _wait  # noqa: E402
from tests.procs import sample_texts  # noqa: E402

BASELINE = """
import asyncio, sys
from aiohttp import web
async def main():
    body = b'{"ok": true, "providers": [], "models": []}'
    async def h(request):
        return web.Response(body=body, content_type="application/json")
    app = web.Application()
    app.router.add_get("/{tail:.*}", h)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def open_loop(base: str, paths: list[str], rate: float, seconds: float) -> dict[str, Any]:
    """Send GETs at fixed times regardless of answers; latency from the scheduled time."""
    latencies: list[float] = []
    errors = 0
    count = int(rate * seconds)
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as http:

        async def one(i: int, due: float) -> None:
            nonlocal errors
            try:
                async with http.get(base + paths[i % len(paths)]) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
            latencies.append((time.perf_counter() - due) * 1e3)

        loop_start = time.perf_counter() + 0.2
        tasks = []
        for i in range(count):
            due = loop_start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        issued = time.perf_counter() - loop_start
        await asyncio.gather(*tasks)
    return {
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(_pct(latencies, 0.99), 2),
        "errors": errors,
        "sent": count,
        "achieved_rate": round(count / issued, 1),
    }


def baseline(rate: float, seconds: float) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BASELINE], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        return asyncio.run(open_loop(f"http://127.0.0.1:{port}", ["/v1/swarm"], rate, seconds))
    finally:
        proc.kill()
        proc.wait()


def embeddings(http: str, package: Path, n: int = 60) -> dict[str, float]:
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    text = sample_texts(1)[0]
    for _ in range(5):  # warm-up: sessions, connections, caches
        _api(http, "POST", "/v1/embeddings", {"model": "minilm", "input": text})
    swarm = []
    for _ in range(n):
        start = time.perf_counter()
        _api(http, "POST", "/v1/embeddings", {"model": "minilm", "input": text})
        swarm.append((time.perf_counter() - start) * 1e3)
    pkg = load_package(package)
    stages = ClientStages(package)
    pipe = LocalPipeline(
        pkg.manifest, [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    )
    local = []
    for i in range(n + 5):
        start = time.perf_counter()
        ids, mask = stages.tokenize([text])
        pipe.encode(ids, mask)
        if i >= 5:
            local.append((time.perf_counter() - start) * 1e3)
    p50, local_p50 = statistics.median(swarm), statistics.median(local)
    return {
        "embeddings_p50_ms": round(p50, 2),
        "embeddings_local_ms": round(local_p50, 2),
        "embeddings_ratio": round(p50 / local_p50, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fusionai-http-bench-") as tmp_name:
        tmp = Path(tmp_name)
        package = _package(tmp)
        swarm = Swarm(tmp, 1.0)
        try:
            swarm.start_broker(tmp / "broker")
            for n in range(3):
                swarm.provider(n).wait_for("listening", timeout=60)
            swarm.add_model(package)
            swarm.ready(backups=0)
            jobs = [
                _api(swarm.http, "POST", "/v1/jobs", {"model": "minilm", "texts": sample_texts(16)})
                for _ in range(3)
            ]
            for job in jobs:
                _wait(
                    "a job to finish",
                    lambda j=job: (
                        _api(swarm.http, "GET", f"/v1/jobs/{j['id']}")["state"] == "succeeded"
                    ),
                )
            emb = embeddings(swarm.http, package)
            paths = [
                "/v1/swarm",
                "/v1/jobs",
                "/v1/models",
                "/v1/providers",
                f"/v1/jobs/{jobs[0]['id']}",
            ]
            api = asyncio.run(open_loop(swarm.http, paths, args.rate, args.seconds))
        finally:
            swarm.close()
        base = baseline(args.rate, args.seconds)
    print(
        json.dumps(
            {
                "api_p50_ms": api["p50_ms"],
                "api_p99_ms": api["p99_ms"],
                "errors": api["errors"],
                "sent": api["sent"],
                "achieved_rate": api["achieved_rate"],
                "baseline_p50_ms": base["p50_ms"],
                "baseline_p99_ms": base["p99_ms"],
                "baseline_errors": base["errors"],
                "api_p99_ratio": round(api["p99_ms"] / max(base["p99_ms"], 1e-3), 2),
                **emb,
                "rate": args.rate,
                "seconds": args.seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
