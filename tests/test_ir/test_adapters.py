"""LoRA adapters as graph inputs: one ONNX file serves the base model and any adapter."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ir.executors import OrtExecutor
from ir.executors.torch_exec import TorchExecutor
from ir.families import AdapterConfig
from ir.package import load_package
from ir.pipeline import LocalPipeline

pytestmark = pytest.mark.timeout(300)
RANK = 4


class LoraLinear(nn.Module):
    """Reference LoRA on a transformers linear layer, written independently of ir/."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.base, self.a, self.b = base, a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def random_adapters(stage: Any, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in stage.adapters:
        feeds[info.a_input] = (rng.standard_normal((RANK, info.in_features)) * 0.1).astype(
            np.float32
        )
        feeds[info.b_input] = (rng.standard_normal((info.out_features, RANK)) * 0.1).astype(
            np.float32
        )
    return feeds


def reference_embeddings(
    model: Any, ids: np.ndarray, mask: np.ndarray, adapters: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The unsplit transformers model with LoRA patched into query and value, mean-pooled."""
    originals = {}
    for i, layer in enumerate(model.encoder.layer):
        sa = layer.attention.self
        for short, attr in (("q", "query"), ("v", "value")):
            key = f"layers.{i}.{short}"
            originals[(i, attr)] = getattr(sa, attr)
            setattr(
                sa,
                attr,
                LoraLinear(getattr(sa, attr), adapters[f"lora_A.{key}"], adapters[f"lora_B.{key}"]),
            )
    try:
        hidden = model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
        ).last_hidden_state
    finally:
        for (i, attr), original in originals.items():
            setattr(model.encoder.layer[i].attention.self, attr, original)
    m = torch.from_numpy(mask).unsqueeze(-1).float()
    return nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=1)


@pytest.fixture(scope="module")
def adapted(minilm: Any, build: Any) -> Any:
    manifest, directory = build(minilm[0], 1, adapters=AdapterConfig(targets=("q", "v"), rank=RANK))
    return manifest, load_package(directory)


def test_zero_adapters_equal_the_base_stage(
    minilm: Any, minilm_batch: Any, build: Any, adapted: Any
) -> None:
    ids, mask, _ = minilm_batch
    manifest, package = adapted
    stage = manifest.provider_stages()[0]
    assert len(stage.adapters) == 12  # 6 blocks x (q, v)
    _, base_dir = build(minilm[0], 1)
    base = load_package(base_dir)
    hidden = OrtExecutor(base.models[0]).run({"input_ids": ids})["hidden_states"]
    feeds = {"hidden_states": hidden, "attention_mask": mask}
    plain = OrtExecutor(base.models[1]).run(feeds)["hidden_states_out"]
    from ir.pipeline import zero_adapters

    with_zero = OrtExecutor(package.models[1]).run({**feeds, **zero_adapters(stage, rank=RANK)})[
        "hidden_states_out"
    ]
    assert np.abs(plain - with_zero).max() <= 1e-5


@pytest.mark.parametrize("executor", ["ort", "torch"])
def test_random_adapters_equal_transformers_with_lora(
    minilm: Any, minilm_batch: Any, adapted: Any, executor: str
) -> None:
    ids, mask, _ = minilm_batch
    manifest, package = adapted
    stage = manifest.provider_stages()[0]
    feeds = random_adapters(stage, seed=3)
    make = (
        (lambda m: OrtExecutor(m))
        if executor == "ort"
        else (lambda m: TorchExecutor(m, device="cpu"))
    )
    pipeline = LocalPipeline(
        manifest, [make(package.models[i]) for i in range(3)], adapters={stage.index: feeds}
    )
    got = pipeline.encode(ids, mask)
    with torch.no_grad():
        ref = reference_embeddings(
            minilm[0], ids, mask, {k: torch.from_numpy(v) for k, v in feeds.items()}
        ).numpy()
    plain = LocalPipeline(manifest, [make(package.models[i]) for i in range(3)]).encode(ids, mask)
    assert np.abs(got - plain).max() > 1e-3  # the adapters really change the output
    assert np.abs(got - ref).max() <= 1e-4


def test_gradients_wrt_b_through_the_torch_executor_equal_torch_autograd(
    minilm: Any, minilm_batch: Any, adapted: Any
) -> None:
    ids, mask, _ = minilm_batch
    manifest, package = adapted
    stage = manifest.provider_stages()[0]
    feeds = random_adapters(stage, seed=4)
    probe = torch.from_numpy(
        np.random.default_rng(5).standard_normal((ids.shape[0], 384)).astype(np.float32)
    )

    # Through the ONNX stage on the torch executor (client stages included, all differentiable).
    executors = [TorchExecutor(package.models[i], device="cpu") for i in range(3)]
    a = {k: torch.from_numpy(v) for k, v in feeds.items() if k.startswith("lora_A")}
    b = {
        k: torch.from_numpy(v).requires_grad_() for k, v in feeds.items() if k.startswith("lora_B")
    }
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    hidden = executors[0].forward(input_ids=t_ids)["hidden_states"]
    hidden = executors[1].forward(hidden_states=hidden, attention_mask=t_mask, **a, **b)[
        "hidden_states_out"
    ]
    emb = executors[2].forward(hidden_states=hidden, attention_mask=t_mask)["embeddings"]
    (emb * probe).sum().backward()

    # The same loss through transformers with LoRA patched in.
    b_ref = {
        k: torch.from_numpy(v).requires_grad_() for k, v in feeds.items() if k.startswith("lora_B")
    }
    ref = reference_embeddings(minilm[0], ids, mask, {**a, **b_ref})
    (ref * probe).sum().backward()

    for name in b:
        got, want = b[name].grad, b_ref[name].grad
        assert got is not None and want is not None and want.norm() > 0
        assert ((got - want).norm() / want.norm()).item() <= 1e-4, name
