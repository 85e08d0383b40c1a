"""Per-block cost figures of a model: what the DAG builders, cost model and placement need.

Figures come from an IR manifest (the broker converts one) or, for models not exported here
(Llama-2 7B/13B/70B in the simulator), from the architecture's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    layer_flops_per_token: float  # forward FLOPs of one block's weights per token
    layer_attn_flops_per_token_per_context: float  # extra FLOPs per token per context token
    layer_param_bytes: float  # bytes of one block's weights
    layer_kv_bytes_per_token: float  # KV-cache bytes one block keeps per token of context
    hidden_bytes_per_token: float  # activation bytes a stage sends on per token
    client_param_bytes: float = 0.0  # embedding + head, kept by the client
    head_flops_per_token: float = 0.0  # the client's output head per token
    # a block's weight matrices (rows, columns) and its vector weights' values (norms,
    # biases): what a low-rank gradient compressor sees (the simulator's pre-training)
    layer_matrices: tuple[tuple[int, int], ...] = ()
    layer_vector_values: int = 0

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"{self.name}: a model needs at least one block")
        for field in ("layer_flops_per_token", "layer_param_bytes", "hidden_bytes_per_token"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.name}: {field} must not be negative")

    @classmethod
    def transformer(
        cls,
        name: str,
        *,
        hidden: int,
        layers: int,
        heads: int,
        kv_heads: int | None = None,
        intermediate: int | None = None,
        vocab: int = 32000,
        gated_mlp: bool = True,
        dtype_bytes: int = 2,
    ) -> ModelSpec:
        """A decoder from its shapes (Llama: gated MLP, grouped-query attention)."""
        kv_heads = kv_heads or heads
        intermediate = intermediate or 4 * hidden
        head_dim = hidden // heads
        kv_dim = kv_heads * head_dim
        attn_params = hidden * (hidden + 2 * kv_dim) + hidden * hidden
        mlp_params = (3 if gated_mlp else 2) * hidden * intermediate
        params = attn_params + mlp_params
        attn = ((hidden, hidden), (kv_dim, hidden), (kv_dim, hidden), (hidden, hidden))
        up = 2 if gated_mlp else 1  # gate and up, or up alone
        return cls(
            name=name,
            n_layers=layers,
            layer_flops_per_token=2.0 * params,
            layer_attn_flops_per_token_per_context=4.0 * hidden,
            layer_param_bytes=float(params * dtype_bytes),
            layer_kv_bytes_per_token=float(2 * kv_dim * dtype_bytes),
            hidden_bytes_per_token=float(hidden * dtype_bytes),
            client_param_bytes=float(2 * vocab * hidden * dtype_bytes),
            head_flops_per_token=2.0 * vocab * hidden,
            layer_matrices=(*attn, *[(intermediate, hidden)] * up, (hidden, intermediate)),
            layer_vector_values=2 * hidden,  # the two norms' weights
        )


# Published shapes of the Llama-2 family (hidden, layers, heads, kv heads, MLP width).
LLAMA2_7B = ModelSpec.transformer(
    "llama2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008
)
LLAMA2_13B = ModelSpec.transformer(
    "llama2-13b", hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824
)
LLAMA2_70B = ModelSpec.transformer(
    "llama2-70b", hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672
)
