"""GGUF files written from random transformers models the way llama.cpp's converter writes them
(its tensor names from the `gguf` package's own map, Llama's permuted query/key rows, Gemma's
norms as 1 + w, llama3 RoPE as `rope_freqs` divisors), for the GGUF tests and benchmark.

The `gguf` package quantizes F16, Q8_0, Q4_0 and Q4_1 but only de-quantizes K-quants, so Q4_K
and Q6_K blocks are packed here by a reference quantizer (plain min/max scales, not llama.cpp's
search); `test_gguf` checks its blocks against `gguf`'s de-quantizer. Each writer returns the
reference: the same transformers model with every weight replaced by what the file holds.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256


def q4_k(x: np.ndarray) -> np.ndarray:
    """(blocks, 256) float32 -> (blocks, 144) Q4_K bytes: 8 sub-blocks of 32, 4-bit values
    with a 6-bit scale and minimum each, under a float16 scale and minimum per block."""
    nb = x.shape[0]
    xs = x.reshape(nb, 8, 32)
    low, high = np.minimum(xs.min(-1), 0), xs.max(-1)
    scale, mins = (high - low) / 15, -low
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    ls = np.clip(np.rint(scale / np.where(df > 0, df, 1)[:, None]), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(mins / np.where(dmf > 0, dmf, 1)[:, None]), 0, 63).astype(np.uint8)
    sd, md = df[:, None] * ls, dmf[:, None] * lm
    q = np.rint((xs + md[..., None]) / np.where(sd > 0, sd, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(nb, 4, 2, 32)
    sc = np.zeros((nb, 12), np.uint8)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    head = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2)]
    return np.concatenate([*head, sc, qs], 1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """(blocks, 256) float32 -> (blocks, 210) Q6_K bytes: 16 sub-blocks of 16, 6-bit values
    with an 8-bit scale each, under a float16 scale per block."""
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    at = np.abs(xs).argmax(-1)
    sub = np.take_along_axis(xs, at[..., None], -1)[..., 0] / -32
    top = np.take_along_axis(sub, np.abs(sub).argmax(-1)[:, None], -1)[:, 0]
    iscale = np.where(top != 0, -128 / np.where(top != 0, top, 1), 0)
    scales = np.clip(np.rint(iscale[:, None] * sub), -128, 127).astype(np.int8)
    d = np.where(iscale != 0, 1 / np.where(iscale != 0, iscale, 1), 0).astype(np.float16)
    sd = d.astype(np.float32)[:, None] * scales
    q = np.clip(np.rint(xs / np.where(sd != 0, sd, 1)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(nb, 2, 4, 32)
    ql = np.concatenate(
        [
            (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
            (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4),
        ],
        -1,
    ).reshape(nb, 128)
    qh = (
        (q[:, :, 0] >> 4)
        | ((q[:, :, 1] >> 4) << 2)
        | ((q[:, :, 2] >> 4) << 4)
        | ((q[:, :, 3] >> 4) << 6)
    )
    return np.concatenate(
        [ql, qh.reshape(nb, 64), scales.view(np.uint8), d.view(np.uint8).reshape(nb, 2)], 1
    )


def quantize(w: np.ndarray, qtype: Any) -> np.ndarray:
    """What the file stores for `w` as `qtype` (float arrays for F32/F16, bytes otherwise)."""
    import gguf

    T = gguf.GGMLQuantizationType
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype in (T.Q4_K, T.Q6_K):
        blocks = (q4_k if qtype == T.Q4_K else q6_k)(w.reshape(-1, QK_K))
        return blocks.reshape(*w.shape[:-1], -1)
    return np.asarray(gguf.quants.quantize(w, qtype))


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    import gguf

    if data.dtype in (np.float32, np.float16):
        return data.astype(np.float32)
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def uniform(name: str) -> Callable[[str, int], Any]:
    """Every matrix as type `name`, vectors (norms, biases) as F32, as llama.cpp does."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    return lambda tensor, layers: qtype


def q4_k_m(tensor: str, layers: int) -> Any:
    """llama.cpp's Q4_K_M mix: Q4_K, but Q6_K for the output and for attn_v and ffn_down on
    the first and last eighth of the layers and every third between."""
    import gguf

    T = gguf.GGMLQuantizationType
    if tensor == "output.weight":
        return T.Q6_K
    if tensor.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(tensor.split(".")[1])
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return T.Q6_K if more else T.Q4_K
    return T.Q4_K


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for a Llama query/key projection (its `LlamaModel.permute`)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_divisors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """`rope_freqs`: llama.cpp's converter's per-frequency divisors for llama3 RoPE."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def bpe_from_json(path: Path) -> tuple[list[str], list[str]]:
    """(tokens by id, merges as "a b") of a tokenizers byte-level BPE file."""
    model = json.loads(path.read_text())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def write_gguf(
    model: Any,
    path: Path,
    types: Callable[[str, int], Any],
    *,
    tokenizer: Path | None = None,
    pre: str = "gpt-2",
    add_bos: bool = False,
    chat_template: str | None = None,
    eot: int | None = None,
    shard_tensors: int = 0,
) -> Any:
    """Write `model` as llama.cpp would; return the model holding what the file holds."""
    import gguf
    import torch

    c = model.config
    arch = {"mistral": "llama", "gemma3_text": "gemma3"}.get(c.model_type, c.model_type)
    n = c.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n)
    head_dim = model.model.layers[0].self_attn.head_dim
    w = gguf.GGUFWriter(path, arch, split_max_tensors=shard_tensors)
    w.add_name("tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_divisors(rope, head_dim))
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_attn_factors(model.model.rotary_emb.attention_scaling)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch in ("gemma2", "gemma3") and c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma2" and c.attn_logit_softcapping:
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if tokenizer is not None:
        tokens, merges = bpe_from_json(tokenizer)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(c.bos_token_id)
        w.add_eos_token_id(c.eos_token_id)
        w.add_add_bos_token(add_bos)
        if eot is not None:
            w.add_eot_token_id(eot)
    if chat_template:
        w.add_chat_template(chat_template)
    reference = copy.deepcopy(model)
    held = {}
    for hf, param in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        value = param.detach().float().numpy()
        if arch == "llama" and ".q_proj." in hf:
            value = permute(value, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf:
            value = permute(value, c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and "norm" in hf:
            value = value + np.float32(1)
        qtype = types(name, n) if value.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = quantize(value, qtype)
        raw = None if data.dtype in (np.float32, np.float16) else qtype
        w.add_tensor(name, data, raw_dtype=raw)
        # quantization blocks run along rows, so the permutation does not change the values
        plain = param.detach().float().numpy()
        stored = (
            dequantize(quantize(plain, qtype), qtype)
            if ".q_proj." in hf or (".k_proj." in hf)
            else dequantize(data, qtype)
        )
        if arch in ("gemma2", "gemma3") and "norm" in hf:
            stored = stored - np.float32(1)
        held[hf] = torch.from_numpy(stored.reshape(param.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reference.load_state_dict(held, strict=False)
    return reference.eval()


def write_large(path: Path, layers: int, hidden: int, intermediate: int, vocab: int = 256) -> int:
    """A Llama-architecture GGUF of random Q8_0 weights, streamed to disk: the blocks of each
    shape are drawn once (each holding a 127, as llama.cpp's quantizer writes them) and each
    tensor gets its own block scale, so no two are equal (an exporter would merge equal ones).
    Returns the model's float32 size in bytes."""
    import gguf

    rng = np.random.default_rng(0)
    Q8 = gguf.GGMLQuantizationType.Q8_0
    blocks: dict[tuple[int, int], np.ndarray] = {}

    def shape(rows: int, cols: int) -> tuple[int, int]:
        if (rows, cols) not in blocks:
            values = rng.integers(-127, 128, size=(rows * cols // 32, 34), dtype=np.int16)
            values[:, 2] = 127  # as llama.cpp quantizes: each block's largest magnitude is 127
            blocks[rows, cols] = values.astype(np.int8).view(np.uint8)
        return rows, cols // 32 * 34

    norm = np.ones(hidden, np.float32)
    plan: list[tuple[str, tuple[int, int] | None]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            plan.append((f"blk.{i}.{name}.weight", (hidden, hidden)))
        plan += [
            (f"blk.{i}.ffn_gate.weight", (intermediate, hidden)),
            (f"blk.{i}.ffn_up.weight", (intermediate, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, intermediate)),
            (f"blk.{i}.attn_norm.weight", None),
            (f"blk.{i}.ffn_norm.weight", None),
        ]
    plan += [("output_norm.weight", None), ("output.weight", (vocab, hidden))]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("large")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(hidden // 128)
    w.add_head_count_kv(hidden // 128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for name, dims in plan:
        if dims is None:
            w.add_tensor_info(name, norm.shape, norm.dtype, norm.nbytes)
        else:
            byte_shape = shape(*dims)
            w.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], Q8
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    scale = np.float16(0.002)
    for _, dims in plan:
        if dims is None:
            w.write_tensor_data(norm)
            continue
        data = blocks[dims]
        scale = np.nextafter(scale, np.float16(1))
        data[:, :2] = np.full(1, scale, dtype=np.float16).view(np.uint8)
        w.write_tensor_data(data.reshape(shape(*dims)))
    w.close()
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return 4 * (layers * per_layer + 2 * vocab * hidden + hidden)
