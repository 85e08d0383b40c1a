"""Cost figures of a stage, read from its ONNX graph."""

from __future__ import annotations

import math

import onnx
from onnx import numpy_helper

FOUR_BIT = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


def parameter_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the stored weights (4-bit ones packed two to a byte)."""
    total = 0
    for t in model.graph.initializer:
        n = math.prod(t.dims)
        if t.data_type in FOUR_BIT:
            total += (n + 1) // 2
        else:
            total += n * numpy_helper.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def weight_flops_per_token(model: onnx.ModelProto) -> int:
    """2 x multiply-adds per token of every MatMul/Gemm whose weight is a stored initializer."""
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    # Weights reached through a Transpose or Cast of an initializer count too.
    for node in model.graph.node:
        if (
            node.op_type in ("Transpose", "Cast", "DequantizeLinear")
            and node.input
            and node.input[0] in weights
        ):
            weights[node.output[0]] = weights[node.input[0]]
    flops = 0
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm"):
            for name in node.input[:2]:
                dims = weights.get(name)
                if dims is not None and len(dims) == 2:
                    flops += 2 * dims[0] * dims[1]
                    break
    return flops
