"""GGUF files, written here from random models as llama.cpp writes them, split into provider
stages: each generates the tokens transformers gives for the weights the file holds; the file's
tokenizer encodes as transformers' GGUF tokenizer does; bad files are clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gguf_files import q4_k, q4_k_m, q6_k, uniform, write_gguf
from tests.test_ir.test_split import _hf_greedy, ort_pipeline
from tests.tiny_models import family_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 42, 7, 99, 3]
NEW = 24
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def gguf_llama() -> Any:
    """A Llama whose matrices all have rows of 256 values (K-quant blocks), llama3 RoPE."""
    return family_model(
        "llama",
        seed=5,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_hidden_layers=3,
        vocab_size=512,
        initializer_range=0.06,
    )


@pytest.fixture(scope="module")
def llama256() -> Any:
    return gguf_llama()


def split(path: Path, out: Path, n_stages: int = 2, keep: bool = False) -> Any:
    """Float stages unless `keep`: the file's own quantization (int8/int4 blocks)."""
    from ir.gguf.split import build_gguf

    return build_gguf(path, n_stages, out, keep_quantization=keep)


def greedy_matches(reference: Any, out: Path) -> list[int]:
    expected = _hf_greedy(reference, PROMPT, NEW)
    assert len(set(expected)) > 4, "the reference output is degenerate; the test would be weak"
    assert ort_pipeline(out).generate_greedy(PROMPT, NEW) == expected
    return expected


def test_the_reference_k_quantizer_agrees_with_gguf_s_dequantizer() -> None:
    T = gguf.GGMLQuantizationType
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    for pack, qtype, bits in ((q4_k, T.Q4_K, 4), (q6_k, T.Q6_K, 6)):
        blocks = pack(x)
        assert blocks.shape == (8, gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(blocks, qtype)
        # within a few steps of each sub-block's grid: a wrong layout would scramble values
        step = (x.max() - x.min()) / (2**bits - 1)
        assert np.abs(back - x).max() < 2 * step
        assert np.corrcoef(back.ravel(), x.ravel())[0, 1] > (0.99 if bits == 4 else 0.999)


@pytest.mark.parametrize("kind", [*TYPES, "Q4_K_M"])
def test_each_tensor_type_splits_and_generates_transformers_tokens(
    llama256: Any, tmp_path: Path, kind: str
) -> None:
    types = q4_k_m if kind == "Q4_K_M" else uniform(kind)
    path = tmp_path / f"tiny-{kind}.gguf"
    reference = write_gguf(llama256, path, types)
    stored = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    want = {"Q4_K", "Q6_K", "F32"} if kind == "Q4_K_M" else {kind, "F32"}
    assert stored == want
    manifest = split(path, tmp_path / "pkg")
    assert manifest.family == "llama" and len(manifest.provider_stages()) == 2
    greedy_matches(reference, tmp_path / "pkg")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_each_family_s_gguf_architecture_splits_and_generates_transformers_tokens(
    tmp_path: Path, family: str
) -> None:
    # llama.cpp has no window for Qwen2 files (its loader ignores them): one without
    model = family_model(family, **({"use_sliding_window": False} if family == "qwen2" else {}))
    path = tmp_path / f"{family}.gguf"
    reference = write_gguf(model, path, uniform("Q8_0"))
    manifest = split(path, tmp_path / "pkg")
    assert manifest.family == family
    greedy_matches(reference, tmp_path / "pkg")


@pytest.mark.parametrize(("kind", "dtype"), [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_q8_0_and_q4_0_blocks_stay_8_and_4_bit_and_give_the_same_tokens(
    llama256: Any, tmp_path: Path, kind: str, dtype: str
) -> None:
    path = tmp_path / f"tiny-{kind}.gguf"
    reference = write_gguf(llama256, path, uniform(kind))
    manifest = split(path, tmp_path / "pkg", keep=True)
    assert [s.weight_dtype for s in manifest.provider_stages()] == [dtype, dtype]
    greedy_matches(reference, tmp_path / "pkg")  # the blocks carried over exactly


def test_shards_and_a_folder_of_them_split_like_one_file(llama256: Any, tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    reference = write_gguf(llama256, folder / "tiny.gguf", uniform("Q8_0"), shard_tensors=10)
    shards = sorted(p.name for p in folder.iterdir())
    assert shards == [f"tiny-0000{i}-of-00004.gguf" for i in range(1, 5)]
    expected = greedy_matches(reference, _split_to(folder / shards[0], tmp_path / "a"))
    assert ort_pipeline(_split_to(folder, tmp_path / "b")).generate_greedy(PROMPT, NEW) == expected
    (folder / shards[2]).unlink()
    from ir.gguf import GGUFError

    with pytest.raises(GGUFError, match=r"tiny-00003-of-00004\.gguf is missing"):
        split(folder / shards[0], tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _split_to(path: Path, out: Path) -> Path:
    split(path, out)
    return out


STRINGS = [
    "Hello world!",
    "The swarm runs each stage on a gaming PC.",
    "  leading spaces and trailing ones   ",
    "numbers 1234567 and 3.14159, 42nd",
    "don't won't it's we're they'll I'd you've",
    "tabs\tand\nnew\n\nlines\r\n",
    "émigré café naïve — déjà vu",
    "日本語のテキストと中文",
    "emoji 🚀🔥 and symbols #$%&*()",
    "<|endoftext|> a special token inside text",
    "CamelCaseWords and snake_case_words",
    "URL: https://example.com/path?q=1&x=2",
    "a",
    "",
    "   ",
    "Mixed123Numbers456",
    "Ünïcödé ÀÉÎÕÜ",
    "x" * 50,
    'json: {"key": [1, 2, 3]}',
    "Providers join and leave at will; a backup takes over.",
]


@pytest.mark.parametrize(
    ("pre", "add_bos"), [("gpt-2", False), ("llama-bpe", True), ("qwen2", False)]
)
def test_the_file_s_tokenizer_encodes_as_transformers_gguf_tokenizer(
    llama256: Any, tmp_path: Path, pre: str, add_bos: bool
) -> None:
    import transformers
    from tokenizers import Tokenizer

    from ir.gguf.reader import GGUFModel
    from ir.gguf.tokenizer import tokenizer_json
    from tests.tiny_models import tiny_tokenizer

    tiny_tokenizer(tmp_path / "tok.json", 512)
    path = tmp_path / "tok.gguf"
    write_gguf(
        llama256, path, uniform("Q8_0"), tokenizer=tmp_path / "tok.json", pre=pre, add_bos=add_bos
    )
    ours = Tokenizer.from_str(str(tokenizer_json(GGUFModel(path))))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for s in STRINGS:
        assert ours.encode(s).ids == theirs(s)["input_ids"], s
        assert ours.decode(ours.encode(s).ids, skip_special_tokens=False) == theirs.decode(
            theirs(s)["input_ids"]
        ), s
    assert (ours.encode("hi").ids[0] == llama256.config.bos_token_id) == add_bos


def test_a_package_from_gguf_carries_its_tokenizer_chat_template_and_end_of_turn_ids(
    llama256: Any, tmp_path: Path
) -> None:
    """The template, the named special tokens, and the end-of-turn ids: eos and eot as the
    file declares them, then the vocabulary's usual end-of-turn tokens (<|endoftext|>)."""
    from ir.package import load_package
    from tests.tiny_models import tiny_tokenizer

    tiny_tokenizer(tmp_path / "tok.json", 512)
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    write_gguf(
        llama256,
        tmp_path / "t.gguf",
        uniform("F16"),
        tokenizer=tmp_path / "tok.json",
        chat_template=template,
        eot=7,
    )
    manifest = split(tmp_path / "t.gguf", tmp_path / "pkg")
    assert manifest.chat_template == template and manifest.name == "tiny"
    assert load_package(tmp_path / "pkg").manifest.tokenizer is not None
    eos, bos = llama256.config.eos_token_id, llama256.config.bos_token_id
    assert manifest.config["eos_token_id"] == eos
    tokens = json.loads((tmp_path / "tok.json").read_text())["model"]["vocab"]
    names = {i: t for t, i in tokens.items()}
    assert manifest.special_tokens == {"bos_token": names[bos], "eos_token": names[eos]}
    ends = [eos, 7] + [tokens["<|endoftext|>"]] * (tokens["<|endoftext|>"] not in (eos, 7))
    assert manifest.stop_token_ids == ends


def _cli(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    from cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["ir", "split", *args])
    return code, err.getvalue()


def test_bad_files_are_clear_errors_and_nothing_is_written(llama256: Any, tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_gguf(llama256, good, uniform("Q8_0"))
    data = good.read_bytes()
    reader = gguf.GGUFReader(good)
    first_tensor = min(t.data_offset for t in reader.tensors)
    cases: dict[str, tuple[bytes | Path, str]] = {
        "mid-tensor": (data[: first_tensor + 1000], "truncated"),
        "mid-header": (data[:600], "not a readable GGUF file"),
        "not-gguf": (b"hello, this is no model" * 10, "not a readable GGUF file"),
    }
    unknown = tmp_path / "unknown.gguf"
    w = gguf.GGUFWriter(unknown, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cases["unknown architecture"] = (unknown, "'mamba' is not supported; supported: gemma2")
    wrong = tmp_path / "wrong.gguf"
    shape_model = gguf_llama()
    shape_model.config.intermediate_size = 768  # what the metadata will say; the tensors: 512
    write_gguf(shape_model, wrong, uniform("Q8_0"))
    cases["shape"] = (wrong, r"blk.0.ffn_gate.weight has shape \[512, 256\], but the file's")
    for label, (content, message) in cases.items():
        path = content if isinstance(content, Path) else tmp_path / f"{label}.gguf"
        if not isinstance(content, Path):
            path.write_bytes(content)
        out = tmp_path / f"out-{label}"
        code, err = _cli(str(path), "--out", str(out))
        assert code == 1, (label, err)
        assert err.startswith("error: ") and "Traceback" not in err, (label, err)
        assert re.search(message, err), (label, err)
        assert not out.exists(), label
