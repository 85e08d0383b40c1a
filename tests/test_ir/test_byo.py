"""Bring-your-own ONNX: a whole exported MiniLM graph split at block boundaries."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ir.byo import split_onnx
from ir.errors import UnsupportedModel
from ir.executors import OrtExecutor
from ir.families.base import LoraSlots
from ir.families.bert import Blocks, Embed, MeanPool
from ir.package import load_package
from ir.pipeline import LocalPipeline

pytestmark = pytest.mark.timeout(300)


class WholeMiniLM(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed = Embed(model)
        self.blocks = Blocks(
            model, 0, model.config.num_hidden_layers, LoraSlots(None, range(0), {})
        )
        self.pool = MeanPool()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.pool(self.blocks(self.embed(input_ids), attention_mask), attention_mask)


@pytest.fixture(scope="module")
def whole_onnx(minilm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("whole") / "minilm.onnx"
    ids = torch.tensor([[101, 2023, 102, 0]])
    axes = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            WholeMiniLM(minilm[0]).eval(),
            (ids, (ids != 0).long()),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["embeddings"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "embeddings": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    return path


def _block_output(path: Path, block: int) -> str:
    import onnx

    # Each block has two LayerNorms (after attention, after the MLP); the exporter numbers
    # them in order under /blocks, so block k's output is LayerNorm_{2k + 1}.
    wanted = f"/blocks/LayerNorm_{2 * block + 1}/LayerNormalization"
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.name == wanted:
            return str(node.output[0])
    raise AssertionError(f"no output of block {block}")


def test_split_of_a_whole_graph_gives_the_unsplit_embeddings(
    whole_onnx: Path, minilm_batch: Any, tmp_path: Path
) -> None:
    ids, mask, ref = minilm_batch
    cuts = [[_block_output(whole_onnx, 1)], [_block_output(whole_onnx, 3)]]
    manifest = split_onnx(whole_onnx, cuts, tmp_path / "pkg", name="minilm-byo")
    assert len(manifest.stages) == 3
    assert [i.name for i in manifest.stages[0].inputs] == ["input_ids", "attention_mask"]
    # Later stages take the cut tensor and the mask they still need, nothing else.
    assert [i.name for i in manifest.stages[1].inputs] == ["attention_mask", cuts[0][0]]
    package = load_package(tmp_path / "pkg")
    pipeline = LocalPipeline(package.manifest, [OrtExecutor(package.models[i]) for i in range(3)])
    split = pipeline.run_chain({"input_ids": ids, "attention_mask": mask})["embeddings"]
    whole = OrtExecutor(whole_onnx).run({"input_ids": ids, "attention_mask": mask})["embeddings"]
    assert np.abs(split - whole).max() <= 1e-5
    assert np.abs(split - ref).max() <= 1e-4


def test_an_unknown_cut_tensor_is_named(whole_onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match=r"'no-such-tensor' is not in minilm\.onnx"):
        split_onnx(whole_onnx, [["no-such-tensor"]], tmp_path / "pkg", name="x")
