"""Fine-tuning benchmark: LoRA-FA's memory, the swarm's step time, snapshots and recovery.

    python benchmarks/finetune.py [--steps 12]

Prints one JSON object:
    act_mem_ratio          bytes saved for backward (counted with
                           torch.autograd.graph.saved_tensors_hooks; weights and adapters
                           left out, each storage counted once) by one provider stage's
                           forward under plain LoRA over the same under LoRA-FA, same model,
                           batch and rank. Target >= 1.2.
    act_mem_bytes_*        the two counts behind it.
    step_ratio             median step time of a 3-stage swarm (a broker and 4 provider
                           processes, one compute thread each, no snapshots) over the median
                           step time of the same training in this process (2 threads).
    step_s_swarm, step_s_local
    snapshot_overhead      (median step time with a snapshot every `--every` steps - without)
                           / without. Target <= 0.10.
    snapshot_s             mean wall time of one snapshot (encode, push n shards; it runs
                           alongside the next step), snapshot_bytes its state size.
    recovery_s             the broker's recovery of a killed provider's stage (replacement
                           picked, state rebuilt from shards, every stage rolled back), from
                           its own event.
    recovery_wall_s        kill -> the next finished step.
    losses_match           the swarm's per-step losses equal the single-process run within
                           1e-3 relative (the no-snapshot run).
The model is a random 6-block Llama (hidden 256), adapters on every linear layer of its blocks
(q, k, v, o, gate, up, down; rank 8), batch 8 x
64 tokens in 2 microbatches, trained on the sample data shipped with fusionai.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e import Swarm  # noqa: E402
from tests.procs import wait_until  # noqa: E402

NAME = "bench-llama"
SETTINGS: dict[str, Any] = {
    "batch": 8,
    "microbatches": 2,
    "seq_len": 64,
    "rank": 8,
    "lr": 0.02,
    "seed": 1,
}


def _package(tmp: Path) -> Path:
    import torch
    import transformers

    from cli.demo_models import CORPUS, bpe_tokenizer
    from client.data import SAMPLE_DATA, read_texts
    from ir.export import build_package
    from ir.families import AdapterConfig

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=6,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=1024,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    tokenizer = tmp / "tokenizer.json"
    bpe_tokenizer(CORPUS + read_texts(SAMPLE_DATA), tokenizer, 1024)
    out = tmp / NAME
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(
            model,
            3,
            out,
            name=NAME,
            tokenizer_file=tokenizer,
            adapters=AdapterConfig(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=8),
        )
    return out


def _request(steps: int, **extra: Any) -> Any:
    from broker.finetune import FinetuneRequest
    from client.data import SAMPLE_DATA, read_texts

    return FinetuneRequest(
        model=NAME, texts=read_texts(SAMPLE_DATA), steps=steps, **{**SETTINGS, **extra}
    )


def act_mem(package: Path) -> dict[str, int]:
    """Bytes saved for backward by the middle stage's forward, per method."""
    import numpy as np

    from broker.finetune import LocalFinetune
    from ir.training import saved_bytes

    out = {}
    for method in ("lora", "lora-fa"):
        local = LocalFinetune(package, _request(1, method=method))
        ids, _ = local.data.microbatch(1, 0)
        positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
        inputs = {"hidden_states": local.client.embed(ids), "position_ids": positions}
        out[method] = saved_bytes(local.trainers[1], 1, 0, inputs)
    return out


def local_steps(package: Path, steps: int) -> list[float]:
    import torch

    from broker.finetune import LocalFinetune

    torch.set_num_threads(2)
    local = LocalFinetune(package, _request(steps))
    times: list[float] = []
    last = time.perf_counter()

    def tick(step: int, loss: float) -> None:
        nonlocal last
        now = time.perf_counter()
        times.append(now - last)
        last = now

    losses = local.run(progress=tick)
    local_steps.losses = losses  # type: ignore[attr-defined]
    return times


def swarm_run(swarm: Swarm, steps: int, every: int, kill_after: int | None = None) -> Any:
    from client import Client
    from client.data import SAMPLE_DATA, read_texts

    with Client(swarm.http, timeout=120) as fa:
        body = {
            "kind": "finetune",
            "model": NAME,
            "texts": read_texts(SAMPLE_DATA),
            "steps": steps,
            "snapshot_every": every,
            **SETTINGS,
        }
        job = fa.submit(body).id
        killed_at = None
        if kill_after is not None:
            route = wait_until("start", lambda: _event(swarm.http, job, "finetune_started"), 120)
            wait_until(
                "steps",
                lambda: any(
                    e["step"] >= kill_after for e in _events(swarm.http, job, "finetune_step")
                ),
                300,
            )
            swarm.peers[route["route"][1]].signal(signal.SIGKILL)
            killed_at = time.time()
        fa.wait(job, timeout=600)
        steps_done = fa.finetune_steps(job)
    return job, steps_done, killed_at


def _events(http: str, job: str, kind: str) -> list[dict[str, Any]]:
    import urllib.request

    with urllib.request.urlopen(f"{http}/v1/jobs/{job}/story", timeout=30) as resp:
        return [e for e in json.loads(resp.read())["events"] if e["kind"] == kind]


def _event(http: str, job: str, kind: str) -> dict[str, Any] | None:
    found = _events(http, job, kind)
    return found[0] if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=5, help="snapshot every N steps")
    args = parser.parse_args()
    os.environ["FUSIONAI_THREADS"] = "1"
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fusionai-bench-ft-") as tmp_name:
        tmp = Path(tmp_name)
        package = _package(tmp)
        mem = act_mem(package)
        out["act_mem_bytes_lora"] = mem["lora"]
        out["act_mem_bytes_lora_fa"] = mem["lora-fa"]
        out["act_mem_ratio"] = round(mem["lora"] / mem["lora-fa"], 3)

        local = local_steps(package, args.steps)
        expected = local_steps.losses  # type: ignore[attr-defined]
        swarm = Swarm(tmp, "ft", 4)
        try:
            swarm.add(package)
            _, plain, _ = swarm_run(swarm, args.steps, 0)
            job, snap, _ = swarm_run(swarm, args.steps, args.every)
            snaps = _events(swarm.http, job, "snapshot")
            job_k, _, killed = swarm_run(swarm, args.steps, 2, kill_after=5)
            recovered = _events(swarm.http, job_k, "finetune_recovered")
            after = [
                e
                for e in _events(swarm.http, job_k, "finetune_step")
                if killed is not None and e["at"] > killed
            ]
        finally:
            swarm.stop()
    skip = 2  # warm-up steps
    step_local = statistics.median(local[skip:])
    step_plain = statistics.median(s.seconds for s in plain[skip:])
    step_snap = statistics.median(s.seconds for s in snap[skip:])
    out["step_s_local"] = round(step_local, 4)
    out["step_s_swarm"] = round(step_plain, 4)
    out["step_ratio"] = round(step_plain / step_local, 3)
    out["snapshot_overhead"] = round((step_snap - step_plain) / step_plain, 4)
    out["snapshot_every"] = args.every
    out["snapshot_s"] = round(statistics.mean(e["seconds"] for e in snaps), 4) if snaps else None
    out["snapshot_bytes"] = snaps[0]["bytes"] if snaps else None
    out["recovery_s"] = recovered[0]["seconds"] if recovered else None
    out["recovery_wall_s"] = round(after[0]["at"] - killed, 3) if after and killed else None
    out["losses_match"] = all(
        abs(s.loss - e) <= 1e-3 * abs(e) for s, e in zip(plain, expected, strict=True)
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
