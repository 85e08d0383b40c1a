"""Provider benchmark: the cost of serving a decode step over the p2p layer, and profiling.

    python benchmarks/provider_hop.py [--steps 300]

Prints one JSON object:
    hop_overhead_ms_p50  a 1-token decode step of a small decoder stage (Llama-style, 2 blocks,
                         hidden 256, 128 tokens cached) in a generation session served over the
                         p2p layer (provider.serving behind a Host, called by another Host over
                         TCP on 127.0.0.1), minus the same step called in-process; the p50 of
                         each, subtracted. Target <= 3.
    hop_overhead_ms_p99  the same at p99.
    step_ms_local_p50    the in-process step itself (the baseline).
    profile_s            seconds to measure the hardware profile (ORT executor), uncached.
Both hosts run in this one process (they share the GIL), which makes the hop look slower than
between two machines, not faster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from ir.executors import OrtExecutor
from ir.export import build_package
from ir.package import load_package
from p2p import Host, HostConfig, Tensor
from proto.session import SESSION, SessionOpen, SessionStep
from provider.profile import measure
from provider.serving import Server
from provider.stage import LoadedStage

LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stage(tmp: Path) -> LoadedStage:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 1, tmp, name="bench")
    loaded = load_package(tmp, stages=[1])
    info = loaded.manifest.stages[1]
    executor = OrtExecutor(loaded.models[1], inputs=info.inputs, outputs=info.outputs, threads=1)
    return LoadedStage("bench/1", info, executor, "active")


def _inputs(position: int) -> dict[str, Tensor]:
    return {
        "hidden_states": Tensor.from_numpy(np.ones((1, 1, 256), dtype=np.float32)),
        "position_ids": Tensor.from_numpy(np.array([[position]], dtype=np.int64)),
    }


def _prefill(server: Server, peer: str, session: str, context: int) -> None:
    server.session(peer, SessionOpen(session=session, stage="bench/1"))
    server.session(
        peer,
        SessionStep(
            session=session,
            stage="bench/1",
            inputs={
                "hidden_states": Tensor.from_numpy(np.ones((1, context, 256), dtype=np.float32)),
                "position_ids": Tensor.from_numpy(np.arange(context, dtype=np.int64)[None, :]),
            },
        ),
    )


async def _remote(server: Server, steps: int, context: int) -> list[float]:
    async with Host(HostConfig(listen=LOCAL)) as provider, Host(HostConfig(listen=LOCAL)) as client:
        provider.add_compute_handler(SESSION, server.session)
        await client.connect(provider.addrs[0])
        await client.request(provider.peer_id, SESSION, SessionOpen(session="r", stage="bench/1"))
        await client.request(
            provider.peer_id,
            SESSION,
            SessionStep(
                session="r",
                stage="bench/1",
                inputs={
                    "hidden_states": Tensor.from_numpy(np.ones((1, context, 256), np.float32)),
                    "position_ids": Tensor.from_numpy(np.arange(context, dtype=np.int64)[None]),
                },
            ),
        )
        samples = []
        for i in range(steps):
            step = SessionStep(session="r", stage="bench/1", inputs=_inputs(context + i))
            start = time.perf_counter()
            await client.request(provider.peer_id, SESSION, step)
            samples.append(time.perf_counter() - start)
        return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stage = _stage(Path(tmp))
        server = Server(kv_budget_bytes=1 << 30)
        server.add(stage)
        _prefill(server, "local", "l", args.context)
        local = []
        for i in range(args.steps):
            step = SessionStep(session="l", stage="bench/1", inputs=_inputs(args.context + i))
            start = time.perf_counter()
            server.session("local", step)
            local.append(time.perf_counter() - start)
        remote = asyncio.run(_remote(server, args.steps, args.context))
    start = time.perf_counter()
    measure("ort")
    profile_s = time.perf_counter() - start
    ms = 1e3
    result: dict[str, Any] = {
        "hop_overhead_ms_p50": round(
            ms * (statistics.median(remote) - statistics.median(local)), 3
        ),
        "hop_overhead_ms_p99": round(
            ms * (_percentile(remote, 0.99) - _percentile(local, 0.99)), 3
        ),
        "step_ms_local_p50": round(ms * statistics.median(local), 3),
        "step_ms_remote_p50": round(ms * statistics.median(remote), 3),
        "profile_s": round(profile_s, 2),
        "steps": args.steps,
        "context": args.context,
    }
    result["targets_met"] = {"hop_overhead_ms_p50 <= 3": result["hop_overhead_ms_p50"] <= 3}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
