"""End-to-end benchmark: the swarm against one process, on this machine.

    python benchmarks/e2e.py [--microbatches 12] [--tokens 64]

Prints one JSON object:
    embed_ratio_fp32      texts/s of all-MiniLM-L6-v2 (batches of 32 x 128 tokens) through a
                          3-stage swarm (a broker and 3 provider processes, one compute thread
                          each) over texts/s of the same stages in this process with 2 threads
                          (the baseline, measured in the same run). Target: the better of the
                          two ratios >= 0.7.
    embed_ratio_fp16      the same with fp16 activations on the wire (`ir split --fp16`).
    embed_ratio_fp32_star the fp32 ratio with `broker start --relay star`: each stage's
                          activations there and back through the broker, instead of from
                          provider to provider (the default, `--relay chain`).
    embed_texts_s_*       the throughputs behind the ratios (swarm fp32, swarm fp16, local).
    transport_cpu_s       CPU seconds the broker and providers spent beyond the stage
                          computation itself during the fp32 run: their process CPU time minus
                          the CPU the same stage runs (and client stages) take in this process.
                          That is what moving activations costs: encoding, the p2p transport,
                          decoding, scheduling.
    transport_cpu_share   transport_cpu_s over the swarm processes' whole CPU time.
    transport_cpu_s_star  the same for the `--relay star` run.
    token_ms_swarm        p50 time per generated token (greedy, batch 1) through a decoder cut
                          into 4 provider stages on 4 providers, the client SDK driving the
                          session over p2p (4 round trips per token).
    token_ms_local        p50 of one decoding step in this process (all stages, one thread),
                          over `--tokens` steps (the swarm figure: over `--tokens` / 2).
    token_ms_target       token_ms_local + 3 ms per hop (target: token_ms_swarm <= it).
    failover_stall_s      the longest gap between tokens when the provider serving the last
                          stage dies mid-generation (`--fault die-at-step`); a fifth provider
                          stands by. Target <= 2.
The decoder is a random 8-block Llama (hidden 256) with no end-of-sequence token, so every run
generates `--tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.procs: the child-process helper the tests use

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from tests.procs import Proc, broker_command, provider_command, wait_until  # noqa: E402

BATCH, SEQ = 32, 128
DECODER_STAGES = 4


def decoder_model() -> Any:
    """The benchmarks' decoder: a random 8-block Llama of hidden 256 (seed 0), no
    end-of-sequence token."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=1024,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _packages(tmp: Path) -> dict[str, Path]:
    from cli.demo_models import build_minilm
    from ir.export import Encoding, build_package

    llama = decoder_model()
    out = {name: tmp / name for name in ("minilm", "minilm-fp16", "decoder")}
    build_minilm(out["minilm"], 3, name="minilm")
    build_minilm(out["minilm-fp16"], 3, name="minilm-fp16", encoding=Encoding(fp16=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(llama, DECODER_STAGES, out["decoder"], name="decoder")
    return out


def _ids(n: int, vocab: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, size=(n, SEQ), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return ids


def _local(package: Path, threads: int) -> Any:
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    os.environ["FUSIONAI_THREADS"] = str(threads)
    pkg = load_package(package)
    runs = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
    return LocalPipeline(pkg.manifest, runs)


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


class Swarm:
    def __init__(
        self,
        tmp: Path,
        name: str,
        providers: int,
        *extra: str,
        relay: str = "chain",
        broker_args: tuple[str, ...] = (),
    ) -> None:
        """A broker (`broker_args` added to its command) and `providers` providers (each
        with `extra`)."""
        self.procs: list[Proc] = []
        self.peers: dict[str, Proc] = {}
        try:
            env = {"FUSIONAI_THREADS": "1", "FUSIONAI_CACHE_DIR": str(tmp / "client-cache")}
            data = tmp / f"{name}-{relay}"
            command = broker_command(data, "--relay", relay, *broker_args, heartbeat_s=0.5)
            self.broker = Proc(command, env)
            self.procs.append(self.broker)
            started = self.broker.wait_for("broker_started", timeout=60)
            self.http = started["http"]
            for i in range(providers):
                data = tmp / f"{name}-provider-{i}"
                args = provider_command(started["addrs"][0], data, "--max-memory", "2", *extra)
                proc = Proc(args)
                self.procs.append(proc)
                self.peers[proc.wait_for("listening", timeout=120)["peer_id"]] = proc
            # Every provider joined before a model is added: one still joining would be left
            # out of the placement (a spare), and the pipeline would have fewer stages.
            wait_until(f"{providers} providers joined", lambda: _joined(self.http) >= providers, 60)
        except BaseException:
            self.stop()
            raise

    def add(self, package: Path) -> None:
        from client import Client

        with Client(self.http, timeout=120) as fa:
            name = fa.add_model(package).model
        wait_until(f"{name} served", lambda: _ready(self.http, name), 180)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _get(http: str, path: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(http + path, timeout=30) as resp:
        return json.loads(resp.read())


def _joined(http: str) -> int:
    return len(_get(http, "/v1/providers")["providers"])


def _ready(http: str, name: str) -> bool:
    return bool(_get(http, f"/v1/models/{name}")["ready"])


def embed_swarm(
    tmp: Path, packages: dict[str, Path], name: str, mbs: int, relay: str = "chain"
) -> dict[str, float]:
    """texts/s of `mbs` microbatches of 32 x 128 through a 3-stage swarm, and its CPU time."""
    from client import Client

    swarm = Swarm(tmp, name, 3, relay=relay)
    try:
        swarm.add(packages[name])
        ids = _ids(BATCH * mbs, 30522, seed=1).tolist()
        pids = [p.proc.pid for p in swarm.procs]
        with Client(swarm.http, timeout=600) as fa:
            warm = fa.submit({"model": name, "token_ids": ids[:BATCH], "microbatch": BATCH})
            fa.wait(warm.id)
            cpu0, start = _cpu(pids), time.perf_counter()
            job = fa.submit({"model": name, "token_ids": ids, "microbatch": BATCH})
            fa.wait(job.id)
            seconds = time.perf_counter() - start
            cpu = _cpu(pids) - cpu0
        return {"texts_s": BATCH * mbs / seconds, "cpu_s": cpu, "seconds": seconds}
    finally:
        swarm.stop()


def embed_local(package: Path, mbs: int, threads: int) -> tuple[float, float]:
    """(texts/s, CPU seconds) of the same microbatches in this process."""
    pipe = _local(package, threads)
    ids = _ids(BATCH * mbs, 30522, seed=1)
    mask = np.ones_like(ids)
    pipe.encode(ids[:BATCH], mask[:BATCH])  # warm up
    proc = psutil.Process()
    c0, start = proc.cpu_times(), time.perf_counter()
    for i in range(mbs):
        pipe.encode(ids[i * BATCH : (i + 1) * BATCH], mask[i * BATCH : (i + 1) * BATCH])
    seconds = time.perf_counter() - start
    c1 = proc.cpu_times()
    return BATCH * mbs / seconds, (c1.user - c0.user) + (c1.system - c0.system)


def token_local(package: Path, tokens: int) -> float:
    pipe = _local(package, 1)
    cache = pipe.new_cache()
    prompt = list(range(1, 9))
    pipe.step(np.array([prompt], dtype=np.int64), 0, cache)
    times, fed, token = [], len(prompt), 5
    for _ in range(tokens):
        start = time.perf_counter()
        logits = pipe.step(np.array([[token]], dtype=np.int64), fed, cache)
        token = int(np.argmax(logits[0, -1]))
        times.append(time.perf_counter() - start)
        fed += 1
    return statistics.median(times) * 1e3


def token_swarm(tmp: Path, package: Path, tokens: int) -> tuple[float, float, list[str]]:
    """(p50 ms per token without failures, longest gap in a run where the last stage's
    provider dies, the failover reasons)."""
    from client import Client

    # The last stage's provider serves 2 x 5 warm-up steps, `tokens // 2` clean ones, then
    # dies at step `die_at` of the timed run. Its replacement counts from zero: it gets
    # 2 + tokens - die_at steps, below the limit of `before + die_at`.
    die_at = tokens // 2 + 4
    before = 2 * 5 + tokens // 2
    fault = f"die-at-step={before + die_at},on=decoder/{DECODER_STAGES}"
    swarm = Swarm(tmp, "decoder", DECODER_STAGES + 1, "--fault", fault)
    try:
        swarm.add(package)
        prompt = list(range(1, 9))
        with Client(swarm.http, timeout=10, cache_dir=tmp / "client-cache") as fa:
            for _ in range(2):  # connections and sessions warm
                fa.generate(prompt, 5, stream=False, model="decoder")
            clean = fa.generate(prompt, tokens // 2, stream=False, model="decoder")
            # (the local figure's steps run at contexts 9..9+tokens: a similar range)
            gaps = np.diff(clean.token_times) * 1e3
            failing = fa.generate(prompt, tokens, stream=False, model="decoder")
            stall = float(np.diff(failing.token_times).max())
            reasons = [f"stage {f.stage}: {f.reason}" for f in failing.failovers]
        return float(np.median(gaps)), stall, reasons
    finally:
        swarm.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=12, help="of 32 x 128 per run")
    parser.add_argument("--tokens", type=int, default=64, help="generated per timed run")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fusionai-e2e-"))
    try:
        packages = _packages(tmp)
        local_s, _ = embed_local(packages["minilm"], args.microbatches, threads=2)
        _, local_cpu_1 = embed_local(packages["minilm"], args.microbatches, threads=1)
        fp32 = embed_swarm(tmp, packages, "minilm", args.microbatches)
        fp16 = embed_swarm(tmp, packages, "minilm-fp16", args.microbatches)
        star = embed_swarm(tmp, packages, "minilm", args.microbatches, relay="star")
        local_ms = token_local(packages["decoder"], args.tokens)
        swarm_ms, stall, reasons = token_swarm(tmp, packages["decoder"], args.tokens)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    transport = max(fp32["cpu_s"] - local_cpu_1, 0.0)
    print(
        json.dumps(
            {
                "embed_ratio_fp32": round(fp32["texts_s"] / local_s, 3),
                "embed_ratio_fp16": round(fp16["texts_s"] / local_s, 3),
                "embed_ratio_fp32_star": round(star["texts_s"] / local_s, 3),
                "embed_texts_s_swarm_fp32": round(fp32["texts_s"], 1),
                "embed_texts_s_swarm_fp16": round(fp16["texts_s"], 1),
                "embed_texts_s_local": round(local_s, 1),
                "microbatches": args.microbatches,
                "transport_cpu_s": round(transport, 2),
                "transport_cpu_share": round(transport / fp32["cpu_s"], 3),
                "transport_cpu_s_star": round(max(star["cpu_s"] - local_cpu_1, 0.0), 2),
                "token_ms_swarm": round(swarm_ms, 2),
                "token_ms_local": round(local_ms, 2),
                "token_ms_target": round(local_ms + 3 * DECODER_STAGES, 2),
                "hops": DECODER_STAGES,
                "failover_stall_s": round(stall, 3),
                "failovers": reasons,
                "cpus": os.cpu_count(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
