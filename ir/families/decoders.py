"""Rotary decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) from one forward.

A family is a `Decoder` entry: which projections are fused, which norms there are and where,
which soft-caps, which layers attend through a sliding window and how RoPE is laid out. One
block forward (`Blocks`) reads the entry and calls the model's own submodules (norms with
Gemma's (1 + w), biases, q/k norms, the scaled embedding are inside them), with the KV cache as
explicit tensors. What transformers does outside its submodules is written here: fused splits,
sliding-window masks, soft-caps, partial and per-layer-type RoPE, longrope's switch.

embed | blocks with KV cache ... | norm + lm_head (+ soft-cap). Block stages take
`position_ids` and `attention_mask` (which cached and new keys hold tokens: a batch of
sessions pads its caches, `PaddedKeys`) besides hidden states and past keys/values of shape
(batch, kv_heads, past, head_dim), and return this step's keys and values (`new_*`: the
caller writes them into its cache). The cache keeps every past position also on sliding-window
layers; the window is a mask, which is what transformers' smaller cache computes too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ir.errors import UnsupportedModel
from ir.families.base import (
    AdapterConfig,
    LoraSlots,
    PaddedKeys,
    StageModule,
    eos_of,
    head_stage,
    heads,
    merge_heads,
)
from ir.families.gpt2 import BATCH, SEQ, decoder_stages
from ir.manifest import LONGROPE_KEY


@dataclass(frozen=True)
class Decoder:
    """What sets a rotary decoder family apart from Llama."""

    family: str  # the manifest's family name
    gguf_arch: str  # `general.architecture` of its GGUF files
    fused_qkv: bool = False  # one `self_attn.qkv_proj` (q, k, v in that order)
    fused_gate_up: bool = False  # one `mlp.gate_up_proj` (gate first)
    act: str = "act_fn"  # the MLP's activation attribute
    qk_norm: bool = False  # `self_attn.q_norm`/`k_norm` over head_dim, before RoPE
    sandwich: bool = False  # norms after attention and MLP too (Gemma)
    attn_softcap: bool = False  # tanh soft-cap on attention scores (`attn_logit_softcapping`)
    final_softcap: bool = False  # tanh soft-cap on logits (`final_logit_softcapping`)
    sliding: str = "none"  # "all": every layer (if `sliding_window`); "layer_types": per layer
    rope_by_layer_type: bool = False  # one RoPE table per layer type (Gemma 3)


DECODERS: dict[str, Decoder] = {
    "LlamaForCausalLM": Decoder("llama", "llama"),
    "MistralForCausalLM": Decoder("mistral", "llama", sliding="all"),
    "Qwen2ForCausalLM": Decoder("qwen2", "qwen2", sliding="layer_types"),
    "Qwen3ForCausalLM": Decoder("qwen3", "qwen3", qk_norm=True, sliding="layer_types"),
    "Phi3ForCausalLM": Decoder(
        "phi3", "phi3", fused_qkv=True, fused_gate_up=True, act="activation_fn", sliding="all"
    ),
    "Gemma2ForCausalLM": Decoder(
        "gemma2",
        "gemma2",
        sandwich=True,
        attn_softcap=True,
        final_softcap=True,
        sliding="layer_types",
    ),
    # transformers keeps Gemma 3's `attn_logit_softcapping` in the config but never applies it
    "Gemma3ForCausalLM": Decoder(
        "gemma3",
        "gemma3",
        sandwich=True,
        qk_norm=True,
        final_softcap=True,
        sliding="layer_types",
        rope_by_layer_type=True,
    ),
}


@dataclass(frozen=True)
class RopeTable:
    """Inverse frequencies of one RoPE layout; longrope switches to `long` past `switch_at`."""

    inv_freq: torch.Tensor
    scaling: float
    long: torch.Tensor | None = None
    switch_at: int = 0


def rope_tables(model: Any, spec: Decoder) -> dict[str, RopeTable]:
    """The model's RoPE tables by layer type ("default" unless per layer type)."""
    rotary, config = model.model.rotary_emb, model.config
    kinds = sorted(set(config.layer_types)) if spec.rope_by_layer_type else ["default"]
    tables = {}
    for kind in kinds:
        prefix = "" if kind == "default" else f"{kind}_"
        params = config.rope_parameters if kind == "default" else config.rope_parameters[kind]
        rope_type = params.get("rope_type", "default")
        if "dynamic" in rope_type:
            raise UnsupportedModel(
                f"rope_type {rope_type!r} recomputes its frequencies as the context grows; "
                "supported: default, linear, llama3, yarn, longrope"
            )
        inv = getattr(rotary, f"{prefix}original_inv_freq").detach().clone().float()
        scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
        if rope_type != "longrope":
            tables[kind] = RopeTable(inv, scaling)
            continue
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        switch = int(params["original_max_position_embeddings"])
        layer = {} if kind == "default" else {"layer_type": kind}
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=switch + 1, **layer)
        tables[kind] = RopeTable(inv, scaling, long.float(), switch)
    return tables


def windows(config: Any, spec: Decoder) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as transformers masks it."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if spec.sliding == "all":
        return [window] * n
    if spec.sliding == "layer_types" and window is not None:
        return [window if t == "sliding_attention" else None for t in config.layer_types]
    return [None] * n


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, dim: int
) -> torch.Tensor:
    """RoPE on the first `rot` of a head's `dim` features (Phi-3 rotates only part)."""
    if rot == dim:
        return x * cos + rotate_half(x) * sin
    head = x[..., :rot]
    return torch.cat([head * cos + rotate_half(head) * sin, x[..., rot:]], dim=-1)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class Embed(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed = model.model.embed_tokens  # Gemma's scales by sqrt(hidden) itself

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed(input_ids)
        return out


class Blocks(nn.Module):
    """Blocks `start..end-1` of a rotary decoder, as `spec` describes its family."""

    def __init__(self, model: Any, start: int, end: int, lora: LoraSlots, spec: Decoder) -> None:
        super().__init__()
        config = model.config
        self.blocks = nn.ModuleList(model.model.layers[start:end])
        self.start, self.spec, self.lora = start, spec, lora
        attn = model.model.layers[start].self_attn
        self.head_dim, self.scale = attn.head_dim, float(attn.scaling)
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.windows = windows(config, spec)[start:end]
        tables = rope_tables(model, spec)
        kinds = (
            config.layer_types[start:end]
            if spec.rope_by_layer_type
            else ["default"] * (end - start)
        )
        self.kinds = list(kinds)
        self.tables = {k: tables[k] for k in set(self.kinds)}
        self.rot = {k: 2 * int(t.inv_freq.numel()) for k, t in self.tables.items()}  # rotated dims
        for k, t in self.tables.items():  # buffers, so that export folds them as constants
            self.register_buffer(f"inv_{k}", t.inv_freq, persistent=False)
            if t.long is not None:
                self.register_buffer(f"long_{k}", t.long, persistent=False)
        self.attn_cap = (
            float(config.attn_logit_softcapping)
            if spec.attn_softcap and (getattr(config, "attn_logit_softcapping", None))
            else None
        )

    def _rope(self, kind: str, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables[kind]
        inv: torch.Tensor = getattr(self, f"inv_{kind}")
        if table.long is not None:  # longrope: the long set once a row's context passes the
            # switch (per row: a batch holds sessions of different lengths)
            longer = (position_ids.amax(dim=1, keepdim=True) + 1) > table.switch_at
            inv = torch.where(longer.unsqueeze(-1), getattr(self, f"long_{kind}"), inv)
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * table.scaling).unsqueeze(1), (emb.sin() * table.scaling).unsqueeze(1)

    def _qkv(
        self, sa: Any, h: torch.Tensor, layer: int, adapters: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lora = self.lora
        if not self.spec.fused_qkv:
            q = lora.apply(sa.q_proj, h, layer, "q", adapters)
            k = lora.apply(sa.k_proj, h, layer, "k", adapters)
            v = lora.apply(sa.v_proj, h, layer, "v", adapters)
        else:
            q_out, kv_out = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = torch.split(sa.qkv_proj(h), [q_out, kv_out, kv_out], dim=-1)
            q = lora.add(q, h, layer, "q", adapters)
            k = lora.add(k, h, layer, "k", adapters)
            v = lora.add(v, h, layer, "v", adapters)
        q, k = heads(q, self.n_heads, self.head_dim), heads(k, self.n_kv, self.head_dim)
        v = heads(v, self.n_kv, self.head_dim)
        if self.spec.qk_norm:
            q, k = sa.q_norm(q), sa.k_norm(k)
        return q, k, v

    def _mlp(
        self, mlp: Any, h: torch.Tensor, layer: int, adapters: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        lora = self.lora
        if self.spec.fused_gate_up:
            gate, up = torch.chunk(mlp.gate_up_proj(h), 2, dim=-1)
            gate = lora.add(gate, h, layer, "gate", adapters)
            up = lora.add(up, h, layer, "up", adapters)
        else:
            gate = lora.apply(mlp.gate_proj, h, layer, "gate", adapters)
            up = lora.apply(mlp.up_proj, h, layer, "up", adapters)
        act = getattr(mlp, self.spec.act)
        return lora.apply(mlp.down_proj, act(gate) * up, layer, "down", adapters)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *rest: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        n = len(self.blocks)
        past, adapters = rest[: 2 * n], rest[2 * n :]
        q_len = hidden.shape[1]
        ropes = {k: self._rope(k, position_ids) for k in sorted(self.tables)}
        keys = PaddedKeys(attention_mask, q_len)
        masks = {w: keys.mask(w) for w in set(self.windows)}
        cap = self.attn_cap
        capped = None if cap is None else lambda scores: softcap(scores, cap)
        new_kv: list[torch.Tensor] = []  # each block's new keys and values
        for i, block in enumerate(cast(Any, self.blocks)):
            layer = self.start + i
            sa = block.self_attn
            q, k, v = self._qkv(sa, block.input_layernorm(hidden), layer, adapters)
            cos, sin = ropes[self.kinds[i]]
            rot = self.rot[self.kinds[i]]
            q, k = rotate(q, cos, sin, rot, self.head_dim), rotate(k, cos, sin, rot, self.head_dim)
            new_k, new_v, ctx = keys.attend(
                q, (past[2 * i], k), (past[2 * i + 1], v), masks[self.windows[i]], self.scale,
                capped,
            )  # fmt: skip
            new_kv += [new_k, new_v]
            attn = self.lora.apply(sa.o_proj, merge_heads(ctx), layer, "o", adapters)
            if self.spec.sandwich:
                attn = block.post_attention_layernorm(attn)
            hidden = hidden + attn
            if self.spec.sandwich:
                mlp = block.post_feedforward_layernorm(
                    self._mlp(block.mlp, block.pre_feedforward_layernorm(hidden), layer, adapters)
                )
            else:
                mlp = self._mlp(block.mlp, block.post_attention_layernorm(hidden), layer, adapters)
            hidden = hidden + mlp
        return (hidden, *new_kv)


def config_of(model: Any, spec: Decoder) -> dict[str, int | float | str]:
    c = model.config
    attn = model.model.layers[0].self_attn
    out: dict[str, int | float | str] = {
        "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "num_kv_heads": c.num_key_value_heads,
        "head_dim": attn.head_dim,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "max_positions": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        **eos_of(c),
    }
    slid = [i for i, w in enumerate(windows(c, spec)) if w is not None]
    if slid:
        out["sliding_window"] = int(c.sliding_window)
        out["sliding_layers"] = ",".join(map(str, slid))
    if spec.final_softcap and getattr(c, "final_logit_softcapping", None):
        out["final_logit_softcapping"] = float(c.final_logit_softcapping)
    if spec.attn_softcap and getattr(c, "attn_logit_softcapping", None):
        out["attn_logit_softcapping"] = float(c.attn_logit_softcapping)
    switch = [t.switch_at for t in rope_tables(model, spec).values() if t.long is not None]
    if switch:
        # longrope changes every layer's rotation once the context passes this length: the
        # KV cache is then computed again from the whole text, as transformers does
        out[LONGROPE_KEY] = min(switch)
    return out


class CappedHead(nn.Module):
    """Final norm, output projection, then a tanh soft-cap on the logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, cap: float) -> None:
        super().__init__()
        self.norm, self.lm_head, self.cap = norm, lm_head, cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(self.norm(hidden)), self.cap)


def check(model: Any, spec: Decoder) -> None:
    """Refuse what the forward above does not compute the way transformers does."""
    c = model.config
    if getattr(c, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{spec.family} with bidirectional attention is an encoder")
    kinds = set(getattr(c, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"layer types {sorted(kinds)}; supported: full and sliding")


def plan(
    model: Any, spec: Decoder, n_stages: int, adapters: AdapterConfig | None
) -> list[StageModule]:
    check(model, spec)
    c = model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    seq = {0: BATCH, 1: SEQ}
    embed = StageModule(
        name="embed",
        placement="client",
        module=Embed(model),
        input_names=["input_ids"],
        output_names=["hidden_states"],
        example_inputs=(torch.tensor([[5, 17, 3, 9]]),),
        dynamic_axes={"input_ids": seq, "hidden_states": seq},
        activation_bytes_per_token=c.hidden_size * 4,
        owns=["model.embed_tokens"],
    )
    q_out, kv_out = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    middle = decoder_stages(
        model,
        n_stages,
        adapters,
        n_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        kv_heads=c.num_key_value_heads,
        head_dim=head_dim,
        lora_shapes={
            "q": (c.hidden_size, q_out),
            "k": (c.hidden_size, kv_out),
            "v": (c.hidden_size, kv_out),
            "o": (q_out, c.hidden_size),
            "gate": (c.hidden_size, c.intermediate_size),
            "up": (c.hidden_size, c.intermediate_size),
            "down": (c.intermediate_size, c.hidden_size),
        },
        blocks=lambda m, start, end, lora: Blocks(m, start, end, lora, spec),
        extra_inputs=[("position_ids", torch.arange(3, 7).unsqueeze(0), seq)],
    )
    for stage in middle:
        assert stage.layers is not None
        stage.owns = [f"model.layers.{i}" for i in range(*stage.layers)]
    head = head_stage(model.model.norm, model.lm_head, c.hidden_size)
    cap = getattr(c, "final_logit_softcapping", None) if spec.final_softcap else None
    if cap:
        head.module = CappedHead(model.model.norm, model.lm_head, float(cap))
    head.owns = ["model.norm", "lm_head"]
    return [embed, *middle, head]
