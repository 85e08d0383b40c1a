"""Each rotary decoder family, split into provider stages, generates transformers' own greedy
tokens, with its special features taking effect (each is first shown to change the logits)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ir.errors import UnsupportedModel
from tests.test_ir.test_split import _hf_greedy, ort_pipeline
from tests.test_ir.test_torch_executor import torch_pipeline
from tests.tiny_models import FAMILIES, family_model

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 42, 7, 99, 3]
NEW = 24


def switched_off(model: Any, family: str, feature: str) -> Any:
    """The same weights with one feature off."""
    change = FAMILIES[family][2][feature]
    off = family_model(family, **change)
    off.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in off.model.layers:
            sa = layer.self_attn
            if feature == "qkv bias":
                for proj in (sa.q_proj, sa.k_proj, sa.v_proj):
                    proj.bias.zero_()
            if feature == "q/k norms":
                sa.q_norm, sa.k_norm = torch.nn.Identity(), torch.nn.Identity()
    return off.eval()


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([ids])).logits[0]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_generates_transformers_tokens_with_its_features_in_effect(
    build: Any, family: str
) -> None:
    model = family_model(family)
    reference = _hf_greedy(model, PROMPT, NEW)
    assert len(set(reference)) > 4, "the reference output is degenerate; the test would be weak"
    full = logits(model, PROMPT + reference)
    top2 = full[len(PROMPT) - 1 : -1].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "a near tie: float noise could flip a token"
    for feature in FAMILIES[family][2]:
        delta = (logits(switched_off(model, family, feature), PROMPT + reference) - full).abs()
        assert delta.max() > 1e-3, f"{feature} does not change {family}'s logits: untested"

    manifest, directory = build(model, 2)
    assert manifest.family == family and len(manifest.provider_stages()) == 2
    pipeline = ort_pipeline(directory)
    assert pipeline.generate_greedy(PROMPT, NEW) == reference
    assert pipeline.generate_greedy(PROMPT, NEW, use_cache=False) == reference
    assert torch_pipeline(directory).generate_greedy(PROMPT, NEW) == reference  # torch executor


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    import transformers

    from ir.families import plan_stages

    config = transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64
    )
    with pytest.raises(UnsupportedModel, match=r"GPTNeoXForCausalLM is not supported.*Qwen3"):
        plan_stages(transformers.GPTNeoXForCausalLM(config), 1)
    dynamic = family_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="dynamic"):
        plan_stages(dynamic, 2)
