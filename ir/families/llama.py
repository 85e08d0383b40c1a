"""Llama-style decoders: RoPE, RMSNorm, grouped-query attention, SwiGLU.

embed | blocks with KV cache ... | norm + lm_head. Block stages take `position_ids` (for RoPE)
besides hidden states and past keys/values of shape (batch, kv_heads, past, head_dim).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ir.families.base import (
    AdapterConfig,
    LoraSlots,
    StageModule,
    attention,
    causal_mask,
    eos_of,
    head_stage,
    heads,
    merge_heads,
)
from ir.families.gpt2 import BATCH, SEQ, decoder_stages


def config_of(model: Any) -> dict[str, int | float | str]:
    c = model.config
    return {
        "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "num_kv_heads": c.num_key_value_heads,
        "head_dim": model.model.layers[0].self_attn.head_dim,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "max_positions": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        **eos_of(c),
    }


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Embed(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed = model.model.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed(input_ids)
        return out


class Blocks(nn.Module):
    def __init__(self, model: Any, start: int, end: int, lora: LoraSlots) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.model.layers[start:end])
        self.start = start
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.n_heads = model.config.num_attention_heads
        self.n_kv = model.config.num_key_value_heads
        rotary = model.model.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone(), persistent=False)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.lora = lora

    def forward(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        n = len(self.blocks)
        past, adapters = rest[: 2 * n], rest[2 * n :]
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.rope_scale).to(hidden.dtype).unsqueeze(1)
        sin = (emb.sin() * self.rope_scale).to(hidden.dtype).unsqueeze(1)
        mask = causal_mask(hidden.shape[1], past[0].shape[2], hidden.dtype)
        repeat = self.n_heads // self.n_kv
        presents: list[torch.Tensor] = []
        for i, block in enumerate(cast(Any, self.blocks)):
            layer = self.start + i
            sa = block.self_attn
            h = block.input_layernorm(hidden)
            q = heads(
                self.lora.apply(sa.q_proj, h, layer, "q", adapters), self.n_heads, self.head_dim
            )
            k = heads(self.lora.apply(sa.k_proj, h, layer, "k", adapters), self.n_kv, self.head_dim)
            v = heads(self.lora.apply(sa.v_proj, h, layer, "v", adapters), self.n_kv, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = torch.cat([past[2 * i], k], dim=2)
            v = torch.cat([past[2 * i + 1], v], dim=2)
            presents += [k, v]
            if repeat > 1:
                k = torch.repeat_interleave(k, repeat, dim=1)
                v = torch.repeat_interleave(v, repeat, dim=1)
            ctx = merge_heads(attention(q, k, v, mask, self.scale))
            hidden = hidden + self.lora.apply(sa.o_proj, ctx, layer, "o", adapters)
            mlp = block.mlp
            h = block.post_attention_layernorm(hidden)
            gate = self.lora.apply(mlp.gate_proj, h, layer, "gate", adapters)
            up = self.lora.apply(mlp.up_proj, h, layer, "up", adapters)
            hidden = hidden + self.lora.apply(
                mlp.down_proj, mlp.act_fn(gate) * up, layer, "down", adapters
            )
        return (hidden, *presents)


def plan(model: Any, n_stages: int, adapters: AdapterConfig | None) -> list[StageModule]:
    c = model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    seq = {0: BATCH, 1: SEQ}
    ids = torch.tensor([[5, 17, 3, 9]])
    embed = StageModule(
        name="embed",
        placement="client",
        module=Embed(model),
        input_names=["input_ids"],
        output_names=["hidden_states"],
        example_inputs=(ids,),
        dynamic_axes={"input_ids": seq, "hidden_states": seq},
        activation_bytes_per_token=c.hidden_size * 4,
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
        blocks=Blocks,
        extra_inputs=[("position_ids", torch.arange(3, 7).unsqueeze(0), seq)],
    )
    head = head_stage(model.model.norm, model.lm_head, c.hidden_size)
    return [embed, *middle, head]
