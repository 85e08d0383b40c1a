"""Per-architecture stage wrappers: torch modules that take and return explicit tensors.

Each family cuts a transformers model at block boundaries into a client-side embedding stage,
provider stages over contiguous block ranges, and a client-side head. The wrappers reimplement
each block's forward over the model's own submodules (weights are shared, not copied), with
KV-cache tensors as explicit inputs and outputs: driving transformers' cache objects through
the ONNX exporter is fragile, explicit tensors are not.
"""

from __future__ import annotations

from typing import Any

from ir.errors import UnsupportedModel
from ir.families.base import AdapterConfig, StageModule, split_layers


def supported() -> list[str]:
    """The transformers classes `plan_stages` splits."""
    from ir.families.decoders import DECODERS

    return sorted(["BertModel", "GPT2LMHeadModel", *DECODERS])


def plan_stages(
    model: Any, n_stages: int, adapters: AdapterConfig | None = None
) -> tuple[str, dict[str, int | float | str], list[StageModule]]:
    """(family, config, stages) for a transformers model split into `n_stages` provider stages."""
    kind = type(model).__name__
    if kind == "BertModel":
        from ir.families import bert

        return "bert", bert.config_of(model), bert.plan(model, n_stages, adapters)
    if kind == "GPT2LMHeadModel":
        from ir.families import gpt2

        return "gpt2", gpt2.config_of(model), gpt2.plan(model, n_stages, adapters)
    from ir.families import decoders

    spec = decoders.DECODERS.get(kind)
    if spec is not None:
        stages = decoders.plan(model, spec, n_stages, adapters)
        return spec.family, decoders.config_of(model, spec), stages
    raise UnsupportedModel(
        f"{kind} is not supported; supported: {', '.join(supported())} "
        f"(or export it to ONNX yourself and split it with --cut)"
    )


__all__ = ["AdapterConfig", "StageModule", "plan_stages", "split_layers", "supported"]
