"""BERT-style encoders (e.g. all-MiniLM-L6-v2): embed | blocks ... | mean-pool + normalise.

The client runs the embedding (token ids never leave it) and the pooling head; providers run
blocks on hidden states and the attention mask.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from ir.families.base import (
    NEG,
    AdapterConfig,
    LoraSlots,
    StageModule,
    attention,
    heads,
    merge_heads,
    split_layers,
)

BATCH, SEQ = "batch", "sequence"


def config_of(model: Any) -> dict[str, int | float | str]:
    c = model.config
    return {
        "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "vocab_size": c.vocab_size,
        "max_positions": c.max_position_embeddings,
        "layer_norm_eps": c.layer_norm_eps,
    }


class Embed(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.emb: Any = model.embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        x = (
            self.emb.word_embeddings(input_ids)
            + self.emb.position_embeddings(positions)
            + self.emb.token_type_embeddings(torch.zeros_like(input_ids))
        )
        out: torch.Tensor = self.emb.LayerNorm(x)
        return out


class Blocks(nn.Module):
    def __init__(self, model: Any, start: int, end: int, lora: LoraSlots) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.encoder.layer[start:end])
        self.start = start
        self.n_heads = model.config.num_attention_heads
        self.head_dim = model.config.hidden_size // self.n_heads
        self.lora = lora

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, *adapters: torch.Tensor
    ) -> torch.Tensor:
        mask = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * NEG
        scale = 1.0 / math.sqrt(self.head_dim)
        for offset, block in enumerate(cast(Any, self.blocks)):
            layer = self.start + offset
            sa = block.attention.self
            q = heads(
                self.lora.apply(sa.query, hidden, layer, "q", adapters), self.n_heads, self.head_dim
            )
            k = heads(
                self.lora.apply(sa.key, hidden, layer, "k", adapters), self.n_heads, self.head_dim
            )
            v = heads(
                self.lora.apply(sa.value, hidden, layer, "v", adapters), self.n_heads, self.head_dim
            )
            ctx = merge_heads(attention(q, k, v, mask, scale))
            out: Any = block.attention.output
            attn = out.LayerNorm(self.lora.apply(out.dense, ctx, layer, "o", adapters) + hidden)
            inter = block.intermediate.intermediate_act_fn(block.intermediate.dense(attn))
            hidden = block.output.LayerNorm(block.output.dense(inter) + attn)
        return hidden


class MeanPool(nn.Module):
    """sentence-transformers' head for this model: mean over real tokens, then L2-normalise."""

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        pooled = summed / counts
        norm = pooled.norm(p=2, dim=1, keepdim=True).clamp(min=1e-12)
        return pooled / norm


def plan(model: Any, n_stages: int, adapters: AdapterConfig | None) -> list[StageModule]:
    cfg = model.config
    hidden_size = cfg.hidden_size
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 2088, 102, 0, 0]])
    mask = (ids != 0).to(torch.int64)
    hidden = torch.randn(2, 6, hidden_size)
    seq_axes = {0: BATCH, 1: SEQ}
    stages = [
        StageModule(
            name="embed",
            placement="client",
            module=Embed(model),
            input_names=["input_ids"],
            output_names=["hidden_states"],
            example_inputs=(ids,),
            dynamic_axes={"input_ids": seq_axes, "hidden_states": seq_axes},
            activation_bytes_per_token=hidden_size * 4,
        )
    ]
    shapes = {n: (hidden_size, hidden_size) for n in ("q", "k", "v", "o")}
    for start, end in split_layers(cfg.num_hidden_layers, n_stages):
        lora = LoraSlots(adapters, range(start, end), shapes)
        stages.append(
            StageModule(
                name=f"layers.{start}-{end - 1}",
                placement="provider",
                module=Blocks(model, start, end, lora),
                input_names=["hidden_states", "attention_mask", *lora.input_names],
                output_names=["hidden_states_out"],
                example_inputs=(hidden, mask, *lora.example_inputs()),
                dynamic_axes={
                    "hidden_states": seq_axes,
                    "attention_mask": seq_axes,
                    "hidden_states_out": seq_axes,
                    **lora.dynamic_axes(),
                },
                layers=(start, end),
                adapters=lora.infos,
                attention_flops_per_token_per_context=4 * hidden_size * (end - start),
                activation_bytes_per_token=hidden_size * 4,
            )
        )
    stages.append(
        StageModule(
            name="head",
            placement="client",
            module=MeanPool(),
            input_names=["hidden_states", "attention_mask"],
            output_names=["embeddings"],
            example_inputs=(hidden, mask),
            dynamic_axes={
                "hidden_states": seq_axes,
                "attention_mask": seq_axes,
                "embeddings": {0: BATCH},
            },
        )
    )
    return stages
