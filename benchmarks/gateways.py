"""Gateways in front of the broker: who pays for the client side of HTTP sessions.

    python benchmarks/gateways.py [--streams 64] [--tokens 32]

Prints one JSON object. The swarm is the concurrency benchmark's: its decoder (a random
8-block Llama, hidden 256, no end-of-sequence token) cut into 3 provider stages on 3 provider
processes (one compute thread each, `--max-batch 32`: 96 batch slots, so every stream is
admitted), a broker with an admin key, and two `fusionai gateway` processes holding a gateway
key, all on this machine. In the same run, `--streams` concurrent streamed greedy completions
of `--tokens` tokens each, started together, go

    broker        to the broker's own `/v1/completions` (it runs the client side),
    gateway_1     to one gateway,
    gateway_2     half to each of two gateways,

each an object with `tokens_s` (all streams' tokens over the wall time from the first request
to the last chunk), `chunk_ms_p50` (gaps between a stream's chunks), and
`broker_cpu_s_per_1k_tokens` (the broker process's user + system CPU seconds over the run,
per 1,000 tokens). `broker_cpu_ratio` is gateway_2's broker CPU per token over the broker's
own (target <= 0.2); `gateway_1_cpu_ratio` the same for one gateway. On this machine every
process shares the same few cores, so aggregate tokens/s does not grow with gateways here;
what moves off the broker is its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.procs: the child-process helper the tests use

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from concurrency import build_decoder, prompts  # noqa: E402

from tests.procs import Proc, broker_command, fusionai, provider_command, wait_until  # noqa: E402

ADMIN = "fai-bench-admin-key-0123456789"


def _call(http: str, method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(http + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {ADMIN}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


async def streams(urls: list[str], key: str, n: int, tokens: int) -> tuple[float, list[float]]:
    """(wall seconds, chunk gaps in ms) of `n` streams spread over `urls`, started together."""
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"}

    async def one(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> list[float]:
        body = {"model": "decoder", "prompt": prompt, "max_tokens": tokens, "stream": True}
        arrivals: list[float] = []
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    assert b'"error"' not in line, line
                    arrivals.append(time.monotonic())
        return arrivals

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in urls:
            await one(session, url, prompts(1)[0])  # warm: the gateway loads the client side
        start = time.monotonic()
        times = await asyncio.gather(
            *(one(session, urls[i % len(urls)], p) for i, p in enumerate(prompts(n)))
        )
    end = max(t[-1] for t in times)
    gaps = np.concatenate([np.diff(t) for t in times if len(t) > 1]) * 1e3
    return end - start, [float(g) for g in gaps]


def measure(
    broker: psutil.Process, urls: list[str], key: str, n: int, tokens: int
) -> dict[str, float]:
    c0 = broker.cpu_times()
    wall, gaps = asyncio.run(streams(urls, key, n, tokens))
    c1 = broker.cpu_times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {
        "tokens_s": round(n * tokens / wall, 1),
        "chunk_ms_p50": round(float(np.percentile(gaps, 50)), 2),
        "broker_cpu_s_per_1k_tokens": round(cpu / (n * tokens) * 1e3, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fusionai-gateways-"))
    procs: list[Proc] = []
    try:
        package = build_decoder(tmp / "decoder")
        env = {"FUSIONAI_THREADS": "1"}
        broker = Proc(broker_command(tmp / "broker", "--admin-key", ADMIN, heartbeat_s=0.5), env)
        procs.append(broker)
        started = broker.wait_for("broker_started", timeout=60)
        http = started["http"]
        for i in range(3):
            command = provider_command(
                started["addrs"][0], tmp / f"provider-{i}", "--max-memory", "2", "--max-batch", "32"
            )
            procs.append(Proc(command, env))
            procs[-1].wait_for("listening", timeout=120)
        wait_until(
            "3 providers", lambda: len(_call(http, "GET", "/v1/providers")["providers"]) >= 3, 60
        )
        from client import Client

        with Client(http, ADMIN, timeout=120) as fa:
            fa.add_model(package)
        wait_until("decoder served", lambda: _call(http, "GET", "/v1/models/decoder")["ready"], 180)
        user = _call(http, "POST", "/v1/keys", {"name": "bench"})["key"]
        gw_key = _call(http, "POST", "/v1/keys", {"name": "gw", "role": "gateway"})["key"]
        urls = []
        for name in ("gw-a", "gw-b"):
            gw = Proc(
                fusionai("gateway", "--broker", http, "--api-key", gw_key, "--name", name,
                         "--http", "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0",
                         "--cache-dir", str(tmp / name), "--json"), env,
            )  # fmt: skip
            procs.append(gw)
            urls.append(gw.wait_for("gateway_ready", timeout=60)["http"])
        cpu = psutil.Process(broker.proc.pid)
        out: dict[str, Any] = {"streams": args.streams, "tokens": args.tokens}
        for label, targets in (("broker", [http]), ("gateway_1", urls[:1]), ("gateway_2", urls)):
            out[label] = measure(cpu, targets, user, args.streams, args.tokens)
            print(f"{label}: {out[label]}", file=sys.stderr, flush=True)
        own = out["broker"]["broker_cpu_s_per_1k_tokens"]
        for label, key in (("gateway_2", "broker_cpu_ratio"), ("gateway_1", "gateway_1_cpu_ratio")):
            out[key] = round(out[label]["broker_cpu_s_per_1k_tokens"] / own, 3)
        out["target"] = {"broker_cpu_ratio": 0.2}
        out["cpus"] = os.cpu_count()
        print(json.dumps(out, indent=2))
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
