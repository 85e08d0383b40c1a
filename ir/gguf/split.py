"""Split a GGUF model into a package, one stage's weights in memory at a time.

The transformers model is built on the `meta` device (shapes, no memory) from the file's
metadata, and everything is checked before anything is written: the architecture, every
parameter's tensor present with the shape the metadata implies and a type that can be read.
Each stage's weights are then read and de-quantized just before its export and dropped after,
so the split's memory follows the largest stage, not the model.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ir.chat import Chat
from ir.export import Encoding, write_package
from ir.families import AdapterConfig, StageModule, plan_stages
from ir.gguf.arch import ARCHES, fixer, gguf_name, hf_config, llama3_inv_freq
from ir.gguf.reader import GGUFError, GGUFModel, readable
from ir.gguf.tokenizer import tokenizer_json
from ir.manifest import ModelManifest


def meta_model(g: GGUFModel) -> Any:
    """The transformers model the file describes, on the meta device, with its RoPE tables
    (small buffers) computed on the CPU."""
    import torch
    import transformers

    config = hf_config(g)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    rotary = type(model.model.rotary_emb)(config)
    if g.arch == "llama":
        rotary.original_inv_freq = llama3_inv_freq(g, rotary.original_inv_freq)
    model.model.rotary_emb = rotary
    return model.eval()


def check_tensors(g: GGUFModel, model: Any) -> dict[str, str]:
    """transformers parameter -> GGUF tensor, after checking each is there, has the shape the
    metadata implies and a type this version reads."""
    names = {}
    tied = model.config.tie_word_embeddings
    for hf, param in model.state_dict().items():
        name = "token_embd.weight" if hf == "lm_head.weight" and tied else gguf_name(hf, g.arch)
        ref = g.tensors.get(name)
        if ref is None:
            raise GGUFError(f"{g.files[0].name} lacks tensor {name} (for {hf})")
        if ref.shape != tuple(param.shape):
            raise GGUFError(
                f"tensor {name} has shape {list(ref.shape)}, but the file's hyper-parameters "
                f"make it {list(param.shape)}"
            )
        if not readable(ref.qtype):
            raise GGUFError(f"tensor {name} is {ref.type_name}, which cannot be read yet")
        names[hf] = name
    return names


def attach_loaders(g: GGUFModel, model: Any, stages: list[StageModule]) -> None:
    """Give each stage hooks that load its weights from the file and drop them again."""
    import torch

    names = check_tensors(g, model)
    fix = fixer(model.config, g.arch)

    def prepare(owns: list[str]) -> None:
        for prefix in owns:
            sub = model.get_submodule(prefix)
            state = {
                key: torch.from_numpy(fix(f"{prefix}.{key}", g.read(names[f"{prefix}.{key}"])))
                for key in sub.state_dict()
            }
            sub.load_state_dict(state, strict=True, assign=True)
            if hasattr(sub, "scalar_embed_scale"):  # Gemma's embedding scale, not a weight
                sub.register_buffer(
                    "embed_scale", torch.tensor(sub.scalar_embed_scale), persistent=False
                )
            left = [n for n, t in [*sub.named_parameters(), *sub.named_buffers()] if t.is_meta]
            if left:
                raise GGUFError(f"no weights for {prefix}: {', '.join(left)}")

    def release(owns: list[str]) -> None:
        for prefix in owns:
            model.get_submodule(prefix).to("meta")

    for stage in stages:
        owns = list(stage.owns)
        stage.prepare = lambda owns=owns: prepare(owns)
        stage.release = lambda owns=owns: release(owns)


# the stage quantization closest to a file's: (bits, rows per block) by its matrices' type
KEPT = {
    "Q8_0": (8, 32),
    "Q6_K": (8, 16),
    "Q5_0": (8, 32),
    "Q5_1": (8, 32),
    "Q5_K": (8, 32),
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q4_K": (4, 32),
    "Q3_K": (4, 16),
    "Q2_K": (4, 16),
}


def kept_quantization(g: GGUFModel) -> tuple[int, int] | None:
    """How the file's block matrices are mostly stored, as stage quantization (None: float).
    Q8_0 and Q4_0 blocks carry over exactly; the others are re-quantized from their values."""
    counts: dict[str, int] = {}
    for ref in g.tensors.values():
        if ref.name.startswith("blk.") and len(ref.shape) == 2:
            counts[ref.type_name] = counts.get(ref.type_name, 0) + ref.shape[0] * ref.shape[1]
    if not counts:
        return None
    return KEPT.get(max(counts, key=lambda t: counts[t]))


def build_gguf(
    path: Path,
    n_stages: int,
    out_dir: Path,
    *,
    name: str | None = None,
    adapters: AdapterConfig | None = None,
    encoding: Encoding | None = None,
    keep_quantization: bool = True,
    progress: Callable[[str], None] | None = None,
) -> ModelManifest:
    """Split the GGUF model at `path` (a file, a first shard, or a folder) into a package.
    Unless `encoding` asks for fp16 or a quantization, provider stages keep the file's
    quantization as far as blocked int8/int4 weights can (`keep_quantization=False`: float32
    stages)."""
    encoding = encoding or Encoding()

    g = GGUFModel(path)
    model = meta_model(g)
    family, config, stages = plan_stages(model, n_stages, adapters)
    attach_loaders(g, model, stages)
    if encoding.quantize is None and keep_quantization and not encoding.fp16:
        encoding = dataclasses.replace(encoding, quantize=kept_quantization(g))
    quantize = encoding.quantize
    tokenizer = tokenizer_json(g)
    if progress:
        types = sorted({t.type_name for t in g.tensors.values()})
        progress(
            f"{g.files[0].name}: {g.arch} ({family}), {model.config.num_hidden_layers} layers, "
            f"{len(g.files)} file(s), tensor types {', '.join(types)}; provider stages "
            + (f"int{quantize[0]} (blocks of {quantize[1]})" if quantize else "float")
        )
    default = g.meta.get("general.name") or g.files[0].name.removesuffix(".gguf")
    with tempfile.TemporaryDirectory(prefix="fusionai-tok-") as tmp:
        tok_file = None
        if tokenizer is not None:
            tok_file = Path(tmp) / "tokenizer.json"
            tok_file.write_text(tokenizer, encoding="utf-8")
        return write_package(
            family,
            config,
            stages,
            out_dir,
            name=name or str(default),
            tokenizer_file=tok_file,
            chat=chat_of(g),
            encoding=encoding,
            progress=progress,
        )


# end-of-turn tokens a file may not declare, stopped at when its vocabulary has them (as
# llama.cpp does)
END_OF_TURN = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)
SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id",  # (llama.cpp's spelling)
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def chat_of(g: GGUFModel) -> Chat:
    """The file's chat template, its named special tokens, and its end-of-turn ids: eos,
    eot and eom as declared, and the usual end-of-turn tokens of its vocabulary."""
    tokens = g.meta.get("tokenizer.ggml.tokens") or []
    special = {
        name: str(tokens[i])
        for name, key in SPECIAL_IDS.items()
        if isinstance(i := g.meta.get(key), int) and 0 <= i < len(tokens)
    }
    stops: list[int] = []
    for key in ("eos", "eot", "eom"):
        i = g.meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens) and i not in stops:
            stops.append(i)
    known = {str(t): i for i, t in enumerate(tokens) if str(t) in END_OF_TURN}
    stops += [i for t, i in sorted(known.items()) if i not in stops]
    template = g.meta.get("tokenizer.chat_template")
    return Chat(str(template) if template else None, special, tuple(stops))


__all__ = ["ARCHES", "GGUFError", "build_gguf"]
