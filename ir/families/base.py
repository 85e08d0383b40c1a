"""What every family shares: stage descriptions, layer splitting, LoRA-aware linear layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ir.errors import UnsupportedModel
from ir.manifest import AdapterInfo

NEG = torch.finfo(torch.float32).min  # additive mask value for positions that may not attend


@dataclass(frozen=True)
class AdapterConfig:
    """Which linear layers of each block get LoRA adapter inputs, and the example rank."""

    targets: tuple[str, ...] = ("q", "v")  # family-specific short names of linear layers
    rank: int = 8  # rank of the example tensors used for export (the graph accepts any rank)


@dataclass
class StageModule:
    """One stage ready for export: the module, its example inputs and their names."""

    name: str
    placement: str  # "client" or "provider"
    module: nn.Module
    input_names: list[str]
    output_names: list[str]
    example_inputs: tuple[torch.Tensor, ...]
    dynamic_axes: dict[str, dict[int, str]]
    layers: tuple[int, int] | None = None
    adapters: list[AdapterInfo] = field(default_factory=list)
    kv_bytes_per_token: int = 0
    attention_flops_per_token_per_context: int = 0
    activation_bytes_per_token: int = 0
    # the source model's submodules this stage computes with (e.g. "model.layers.3"), and
    # hooks a builder runs around the export: load their weights, then free them
    owns: list[str] = field(default_factory=list)
    prepare: Callable[[], None] | None = None
    release: Callable[[], None] | None = None


class NormHead(nn.Module):
    """A decoder's client-side head: final norm, then the output projection to logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out


def head_stage(norm: nn.Module, lm_head: nn.Module, hidden_size: int) -> StageModule:
    """The client-side `head` stage of a decoder: hidden states in, logits out."""
    seq = {0: "batch", 1: "sequence"}
    return StageModule(
        name="head",
        placement="client",
        module=NormHead(norm, lm_head),
        input_names=["hidden_states"],
        output_names=["logits"],
        example_inputs=(torch.randn(1, 4, hidden_size),),
        dynamic_axes={"hidden_states": seq, "logits": seq},
    )


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous, balanced block ranges: 6 layers in 4 stages -> (0,2),(2,4),(4,5),(5,6)."""
    if not 1 <= n_stages <= n_layers:
        raise UnsupportedModel(
            f"cannot split {n_layers} blocks into {n_stages} stages; use 1 to {n_layers}"
        )
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class LoraSlots:
    """Maps (block, target) to positions of adapter tensors among a stage's inputs."""

    def __init__(
        self,
        config: AdapterConfig | None,
        layers: range,
        shapes: dict[str, tuple[int, int]],
    ) -> None:
        self.infos: list[AdapterInfo] = []
        self._index: dict[tuple[int, str], int] = {}
        if config is None:
            return
        unknown = set(config.targets) - set(shapes)
        if unknown:
            raise UnsupportedModel(
                f"unknown adapter targets {sorted(unknown)}; this family has {sorted(shapes)}"
            )
        for layer in layers:
            for target in config.targets:
                in_f, out_f = shapes[target]
                key = f"layers.{layer}.{target}"
                self._index[(layer, target)] = len(self.infos)
                self.infos.append(
                    AdapterInfo(
                        target=key,
                        a_input=f"lora_A.{key}",
                        b_input=f"lora_B.{key}",
                        in_features=in_f,
                        out_features=out_f,
                    )
                )
        self.rank = config.rank

    @property
    def input_names(self) -> list[str]:
        return [n for info in self.infos for n in (info.a_input, info.b_input)]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        for info in self.infos:
            out.append(torch.randn(self.rank, info.in_features) * 0.01)
            out.append(torch.zeros(info.out_features, self.rank))
        return tuple(out)

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes: dict[str, dict[int, str]] = {}
        for info in self.infos:
            axes[info.a_input] = {0: "lora_rank"}
            axes[info.b_input] = {1: "lora_rank"}
        return axes

    def apply(
        self,
        base: Any,
        x: torch.Tensor,
        layer: int,
        target: str,
        tensors: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """`base(x)`, plus `(x A^T) B^T` if this (layer, target) has an adapter."""
        return self.add(base(x), x, layer, target, tensors)

    def add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        layer: int,
        target: str,
        tensors: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """`y`, plus `(x A^T) B^T` if this (layer, target) has an adapter: also for a slice of
        a fused projection's output."""
        i = self._index.get((layer, target))
        if i is None:
            return y
        a, b = tensors[2 * i], tensors[2 * i + 1]
        return y + torch.matmul(torch.matmul(x, a.transpose(0, 1)), b.transpose(0, 1))


class PaddedKeys:
    """Attention over a KV cache padded at its end: batches of sessions of different lengths.

    `attention_mask` (batch, past + query) says which keys hold a token (1) and which pad (0);
    sessions of different lengths run as one batch with their past keys padded at the end up
    to the longest (`provider/batching.py`), the queries' own keys after them. Attention reads
    the keys in another order, the queries' own first, then the past, then one zero key,
    masked: a row's tokens come first and its padding after them, so a row sums the same
    terms in the same order whatever the batch and its result is what it would be alone
    (onnxruntime's CPU kernels add trailing zero terms exactly, whereas padding between tokens
    changes the rounding). The stage outputs only the new tokens' keys and values
    (`new_*`): the caller writes them after the row's tokens in its cache
    (`ir.pipeline.next_cache`), in place where the cache has room, so that no step copies
    the whole cache.
    """

    def __init__(self, attention_mask: torch.Tensor, query_len: Any) -> None:
        past_mask = attention_mask[:, : attention_mask.shape[1] - query_len]
        past = past_mask.sum(dim=1, keepdim=True)  # (batch, 1): tokens cached per row
        new = torch.arange(query_len).unsqueeze(0)
        self.queries = past + new  # (batch, query_len): the queries' positions
        # the keys as attention reads them: the queries' own, the past, the zero key
        self.positions = torch.cat(
            [self.queries, torch.cumsum(past_mask, dim=1) - 1, past * 0], dim=1
        )
        self.valid = torch.cat([torch.ones_like(self.queries), past_mask, past * 0], dim=1) > 0

    @staticmethod
    def attend(
        q: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor],
        values: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        scale: float,
        scores_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the new keys, the new values, softmax(q k^T * scale + mask) v) for
        (batch, heads, tokens, dim) queries and (past, new) keys and values of `kv` heads
        (grouped-query attention: query head h reads key head h // (heads / kv)).

        Attention reads the keys as `mask` orders them (new, past, zero) without copying the
        cache into that order or repeating it per query head: the scores of the new keys,
        the past and the zero key are computed apart and joined (they are a head_dim-th of
        the cache's size), and the weighted values are the new ones' plus the past's. Each
        sum thus runs over a row's tokens first and its padding after them, whatever the
        batch. `scores_fn` transforms the scaled scores before the mask (a soft-cap)."""
        (past_k, new_k), (past_v, new_v) = keys, values
        batch, n_heads, q_len, dim = q.shape
        kv = new_k.shape[1]
        grouped = q.reshape(batch, kv, -1, dim)  # (batch, kv, heads / kv * q_len, dim)
        parts = [
            torch.matmul(grouped, new_k.transpose(-1, -2)),
            torch.matmul(grouped, past_k.transpose(-1, -2)),
            torch.zeros_like(grouped[..., :1]),  # the zero key's
        ]
        scores = torch.cat(parts, dim=-1) * scale
        scores = scores.reshape(batch, n_heads, q_len, -1)
        if scores_fn is not None:
            scores = scores_fn(scores)
        probs = torch.softmax(scores + mask, dim=-1).reshape(batch, kv, grouped.shape[2], -1)
        out = torch.matmul(probs[..., :q_len], new_v) + torch.matmul(probs[..., q_len:-1], past_v)
        return new_k, new_v, out.reshape(batch, n_heads, q_len, dim)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """(batch, 1, query_len, query_len + past + 1) additive mask over the keys attention
        reads: a query sees its row's tokens up to itself (with `window`, the last `window`
        of them)."""
        k = self.positions.unsqueeze(1)
        q = self.queries.unsqueeze(2)
        allowed = self.valid.unsqueeze(1) & (k <= q)
        if window is not None:
            allowed = allowed & (k > q - window)
        return torch.where(allowed, torch.zeros(()), torch.full((), NEG)).unsqueeze(1)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over (batch, heads, seq, head_dim) tensors."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """(batch, seq, n_heads * head_dim) -> (batch, n_heads, seq, head_dim)."""
    return x.reshape(x.shape[0], x.shape[1], n_heads, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)."""
    x = x.transpose(1, 2)
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3])


def eos_of(config: Any) -> dict[str, int]:
    """The end-of-sequence token id, if the model names one (generation stops after it)."""
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, list) and eos:
        eos = eos[0]
    return {"eos_token_id": eos} if isinstance(eos, int) else {}
