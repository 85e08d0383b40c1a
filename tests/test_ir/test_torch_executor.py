"""The torch executor runs the same ONNX stages as onnxruntime, with the same results."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from ir.executors.torch_exec import TorchExecutor
from ir.package import load_package
from ir.pipeline import LocalPipeline
from tests.test_ir.test_split import wire_hop

pytestmark = pytest.mark.timeout(300)


def torch_pipeline(directory: Any) -> LocalPipeline:
    package = load_package(directory)
    executors = [
        TorchExecutor(package.models[i], device="cpu") for i in range(len(package.manifest.stages))
    ]
    return LocalPipeline(package.manifest, executors, hop=wire_hop(package.manifest))


@pytest.mark.parametrize("n_stages", [1, 2, 3, 6])
def test_minilm_split_embeddings_equal_the_unsplit_model_on_torch(
    minilm: Any, minilm_batch: Any, build: Any, n_stages: int
) -> None:
    ids, mask, ref = minilm_batch
    _, directory = build(minilm[0], n_stages)
    got = torch_pipeline(directory).encode(ids, mask)
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoders_generate_the_same_tokens_on_torch(
    request: pytest.FixtureRequest, build: Any, family: str
) -> None:
    import torch

    model = request.getfixturevalue(family)
    prompt = [5, 17, 42, 7, 99, 3]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
    _, directory = build(model, 2)
    assert torch_pipeline(directory).generate_greedy(prompt, 20) == ref[0, len(prompt) :].tolist()


def test_importing_the_onnxruntime_executor_does_not_import_torch() -> None:
    code = (
        "import sys, ir.executors, ir.executors.ort, ir.package, ir.pipeline, ir.validate\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_an_unsupported_operator_is_named(tmp_path: Any) -> None:
    import onnx
    from onnx import TensorProto, helper

    from ir.errors import ExecutorError

    graph = helper.make_graph(
        [helper.make_node("Hardmax", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    with pytest.raises(ExecutorError, match=r"does not support \['Hardmax'\]"):
        TorchExecutor(model, device="cpu")


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2"])
def test_reductions_take_axes_from_their_input_in_opset_18(op: str) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ir.executors import OrtExecutor

    axes = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])],
        [axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = OrtExecutor(model).run({"x": x})["y"]
    got = TorchExecutor(model, device="cpu").run({"x": x})["y"]
    assert got.shape == want.shape == (2, 1)
    assert np.allclose(got, want)
