"""From a GGUF file's metadata and tensor names to a transformers config and parameter names.

llama.cpp writes its own names (`blk.3.attn_q.weight`), permutes the rows of Llama's query and
key projections for its RoPE kernel, stores Gemma's norms as (1 + w), and leaves out what its
code hard-codes (Gemma's attention scale and window pattern, Gemma 3's local RoPE base). This
module undoes all of it, following the converter in llama.cpp (`convert_hf_to_gguf.py`) and its
loader (`src/llama-model.cpp`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ir.gguf.reader import GGUFError, GGUFModel

# GGUF architecture -> (transformers class of its config, of the model)
ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),  # Mistral too: it has no arch of its own
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
GEMMA = ("gemma2", "gemma3")


def hf_config(g: GGUFModel) -> Any:
    """The transformers config the file describes (a GGUFError names what is missing)."""
    import transformers

    arch = g.arch
    if arch not in ARCHES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHES))}"
        )

    def need(key: str) -> Any:
        value = g.get(key)
        if value is None:
            raise GGUFError(f"{g.files[0].name} lacks {arch}.{key}")
        if isinstance(value, list):
            raise GGUFError(f"{arch}.{key} varies per layer; that is not supported")
        return value

    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.files[0].name} has no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv = g.get("attention.head_count_kv", heads)
    if isinstance(kv, list):
        raise GGUFError(f"{arch}.attention.head_count_kv varies per layer; that is not supported")
    head_dim = int(g.get("attention.key_length", hidden // heads))
    eps = g.get("attention.layer_norm_rms_epsilon")
    theta = float(g.get("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0))
    args: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "intermediate_size": int(need("feed_forward_length")),
        "vocab_size": g.tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": int(g.get("context_length", 4096)),
        "rms_norm_eps": float(eps) if eps is not None else 1e-6,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": g.meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": g.meta.get("tokenizer.ggml.padding_token_id"),
    }
    rope = _rope_parameters(g, theta)
    window = int(g.get("attention.sliding_window", 0) or 0) or None
    cls = ARCHES[arch][0]
    if arch == "llama" and window is not None:
        cls, args["sliding_window"] = "MistralConfig", window
    if arch in ("qwen2", "qwen3"):
        args["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    if arch == "phi3":
        rot = int(g.get("rope.dimension_count", head_dim))
        rope["partial_rotary_factor"] = rot / head_dim
        args["sliding_window"] = window
        if "rope_factors_long.weight" in g.tensors:
            orig = int(need("rope.scaling.original_context_length"))
            rope.update(
                rope_type="longrope",
                long_factor=g.read("rope_factors_long.weight").ravel().tolist(),
                short_factor=g.read("rope_factors_short.weight").ravel().tolist(),
                original_max_position_embeddings=orig,
            )
            if g.get("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = float(g.get("rope.scaling.attn_factor"))
            args["original_max_position_embeddings"] = orig
    if arch in GEMMA:
        # llama.cpp scales queries by 1/sqrt(head_dim), but by 1/sqrt(hidden/heads) for the
        # two 27B models (46 and 62 layers); Gemma 2 windows every other layer, Gemma 3 five
        # of six, unless the file says otherwise
        wide = args["num_hidden_layers"] in (46, 62)
        args["query_pre_attn_scalar"] = hidden // heads if wide else head_dim
        args["sliding_window"] = window or 4096
        n = args["num_hidden_layers"]
        pattern = g.get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):  # per layer: true means sliding
            if len(pattern) != n:
                raise GGUFError(
                    f"{arch}.attention.sliding_window_pattern has {len(pattern)} layers, not {n}"
                )
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [bool((i + 1) % max(int(pattern), 1)) for i in range(n)]
        args["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        final = g.get("final_logit_softcapping")
        args["final_logit_softcapping"] = float(final) if final else None
        if arch == "gemma2":
            attn = g.get("attn_logit_softcapping")
            args["attn_logit_softcapping"] = float(attn) if attn else None
            args["rope_parameters"] = rope
        else:
            local = {
                "rope_type": "default",
                "rope_theta": float(g.get("rope.freq_base_swa", 10000.0)),
            }
            args["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    else:
        args["rope_parameters"] = rope
    try:
        return getattr(transformers, cls)(**args)
    except (ValueError, TypeError, KeyError) as exc:
        raise GGUFError(f"the file's hyper-parameters do not make a {cls}: {exc}") from None


def _rope_parameters(g: GGUFModel, theta: float) -> dict[str, Any]:
    kind = g.get("rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": float(g.get("rope.scaling.factor")),
        }
    if kind == "longrope" or g.arch == "phi3":
        return {"rope_type": "default", "rope_theta": theta}  # phi3: factor tensors decide
    raise GGUFError(f"RoPE scaling {kind!r} is not supported; supported: none, linear, llama3")


def llama3_inv_freq(g: GGUFModel, inv_freq: Any) -> Any:
    """llama3 RoPE: the file keeps per-frequency divisors (`rope_freqs`)."""
    import torch

    if "rope_freqs.weight" not in g.tensors:
        return inv_freq
    divisors = torch.from_numpy(g.read("rope_freqs.weight").ravel())
    if divisors.shape != inv_freq.shape:
        raise GGUFError(f"rope_freqs has {divisors.numel()} values, not {inv_freq.numel()}")
    return inv_freq / divisors


def gguf_name(hf: str, arch: str) -> str:
    """The GGUF tensor holding a transformers parameter (`model.layers.3.mlp.up_proj.weight`)."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        raise GGUFError(f"no GGUF tensor for {hf}")
    layer, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    norm_after_attention = "post_attention_norm" if arch in GEMMA else "ffn_norm"
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": norm_after_attention,
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.qkv_proj": "attn_qkv",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.gate_up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if module not in names:
        raise GGUFError(f"no GGUF tensor for {hf}")
    return f"blk.{layer}.{names[module]}.{leaf}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Llama query/key projection (weights or bias)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def fixer(config: Any, arch: str) -> Callable[[str, np.ndarray], np.ndarray]:
    """What turns a GGUF tensor back into the transformers parameter `hf`."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads

    def fix(hf: str, w: np.ndarray) -> np.ndarray:
        if arch == "llama" and ".self_attn.q_proj." in hf:
            return unpermute(w, heads)
        if arch == "llama" and ".self_attn.k_proj." in hf:
            return unpermute(w, kv)
        if arch in GEMMA and "norm" in hf:
            return w - 1.0
        return w

    return fix
