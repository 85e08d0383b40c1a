"""GPT-2-style decoders: embed (tokens + positions) | blocks with KV cache ... | ln_f + lm_head.

A block stage takes hidden states, an attention mask over the past and new keys (padding
for batches of sessions of different lengths, `PaddedKeys`) and, per block, the past keys and
values (batch, heads, past, head_dim); it returns new hidden states and this step's keys and
values (`new_*`, which the caller writes into its cache), so after the prompt each step sends
one token's hidden state.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from ir.families.base import (
    AdapterConfig,
    LoraSlots,
    PaddedKeys,
    StageModule,
    eos_of,
    head_stage,
    heads,
    merge_heads,
    split_layers,
)

BATCH, SEQ, PAST, TOTAL = "batch", "sequence", "past", "total"


def config_of(model: Any) -> dict[str, int | float | str]:
    c = model.config
    return {
        "hidden_size": c.n_embd,
        "num_layers": c.n_layer,
        "num_heads": c.n_head,
        "num_kv_heads": c.n_head,
        "head_dim": c.n_embd // c.n_head,
        "vocab_size": c.vocab_size,
        "max_positions": c.n_positions,
        "layer_norm_eps": c.layer_norm_epsilon,
        **eos_of(c),
    }


class Embed(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.wte, self.wpe = model.transformer.wte, model.transformer.wpe

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wte(input_ids) + self.wpe(position_ids)
        return out


class Blocks(nn.Module):
    def __init__(self, model: Any, start: int, end: int, lora: LoraSlots) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.transformer.h[start:end])
        self.start = start
        self.n_heads = model.config.n_head
        self.hidden = model.config.n_embd
        self.head_dim = self.hidden // self.n_heads
        self.lora = lora

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        n = len(self.blocks)
        past, adapters = rest[: 2 * n], rest[2 * n :]
        keys = PaddedKeys(attention_mask, hidden.shape[1])
        mask = keys.mask()
        scale = 1.0 / math.sqrt(self.head_dim)
        new_kv: list[torch.Tensor] = []  # each block's new keys and values
        for i, block in enumerate(cast(Any, self.blocks)):
            layer = self.start + i
            h = block.ln_1(hidden)
            qkv = self.lora.apply(block.attn.c_attn, h, layer, "qkv", adapters)
            q, k, v = qkv.split(self.hidden, dim=2)
            q = heads(q, self.n_heads, self.head_dim)
            k = heads(k, self.n_heads, self.head_dim)
            v = heads(v, self.n_heads, self.head_dim)
            new_k, new_v, ctx = keys.attend(q, (past[2 * i], k), (past[2 * i + 1], v), mask, scale)
            new_kv += [new_k, new_v]
            ctx = merge_heads(ctx)
            hidden = hidden + self.lora.apply(block.attn.c_proj, ctx, layer, "o", adapters)
            mlp = block.mlp
            hidden = hidden + mlp.c_proj(mlp.act(mlp.c_fc(block.ln_2(hidden))))
        return (hidden, *new_kv)


def kv_names(layers: range) -> tuple[list[str], list[str]]:
    past = [f"past_{kind}.{i}" for i in layers for kind in ("key", "value")]
    new = [f"new_{kind}.{i}" for i in layers for kind in ("key", "value")]  # the new tokens'
    return past, new


def decoder_stages(
    model: Any,
    n_stages: int,
    adapters: AdapterConfig | None,
    *,
    n_layers: int,
    hidden_size: int,
    kv_heads: int,
    head_dim: int,
    lora_shapes: dict[str, tuple[int, int]],
    blocks: Any,
    extra_inputs: list[tuple[str, torch.Tensor, dict[int, str]]],
) -> list[StageModule]:
    """Provider stages of a decoder: `blocks(model, start, end, lora)` makes each module."""
    batch, seq, past_len = 1, 4, 3
    hidden = torch.randn(batch, seq, hidden_size)
    # which keys hold tokens (1) and which pad (0): sessions of different lengths run as one
    # batch (`provider/batching.py`)
    mask = (
        "attention_mask",
        torch.ones(batch, past_len + seq, dtype=torch.int64),
        {0: BATCH, 1: TOTAL},
    )
    extra_inputs = [*extra_inputs, mask]
    stages = []
    for start, end in split_layers(n_layers, n_stages):
        lora = LoraSlots(adapters, range(start, end), lora_shapes)
        past_names, new_names = kv_names(range(start, end))
        past = tuple(torch.randn(batch, kv_heads, past_len, head_dim) for _ in past_names)
        axes: dict[str, dict[int, str]] = {
            "hidden_states": {0: BATCH, 1: SEQ},
            "hidden_states_out": {0: BATCH, 1: SEQ},
            **{n: {0: BATCH, 2: PAST} for n in past_names},
            **{n: {0: BATCH, 2: SEQ} for n in new_names},
            **{name: ax for name, _, ax in extra_inputs},
            **lora.dynamic_axes(),
        }
        stages.append(
            StageModule(
                name=f"layers.{start}-{end - 1}",
                placement="provider",
                module=blocks(model, start, end, lora),
                input_names=[
                    "hidden_states",
                    *[n for n, _, _ in extra_inputs],
                    *past_names,
                    *lora.input_names,
                ],
                output_names=["hidden_states_out", *new_names],
                example_inputs=(
                    hidden,
                    *[t for _, t, _ in extra_inputs],
                    *past,
                    *lora.example_inputs(),
                ),
                dynamic_axes=axes,
                layers=(start, end),
                adapters=lora.infos,
                kv_bytes_per_token=(end - start) * 2 * kv_heads * head_dim * 4,
                attention_flops_per_token_per_context=(end - start) * 4 * hidden_size,
                activation_bytes_per_token=hidden_size * 4,
            )
        )
    return stages


def plan(model: Any, n_stages: int, adapters: AdapterConfig | None) -> list[StageModule]:
    c = model.config
    ids = torch.tensor([[5, 17, 3, 9]])
    positions = torch.arange(3, 7).unsqueeze(0)
    seq = {0: BATCH, 1: SEQ}
    embed = StageModule(
        name="embed",
        placement="client",
        module=Embed(model),
        input_names=["input_ids", "position_ids"],
        output_names=["hidden_states"],
        example_inputs=(ids, positions),
        dynamic_axes={"input_ids": seq, "position_ids": seq, "hidden_states": seq},
        activation_bytes_per_token=c.n_embd * 4,
    )
    middle = decoder_stages(
        model,
        n_stages,
        adapters,
        n_layers=c.n_layer,
        hidden_size=c.n_embd,
        kv_heads=c.n_head,
        head_dim=c.n_embd // c.n_head,
        lora_shapes={"qkv": (c.n_embd, 3 * c.n_embd), "o": (c.n_embd, c.n_embd)},
        blocks=Blocks,
        extra_inputs=[],
    )
    head = head_stage(model.transformer.ln_f, model.lm_head, c.n_embd)
    return [embed, *middle, head]
