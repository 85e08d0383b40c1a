"""Weight-only block quantization of a stage's matrix multiplications, in standard ONNX.

Each `MatMul` whose weight is a stored (K, N) float matrix gets int8 or int4 weights in blocks
of `group` rows along K, one float scale per block and column (symmetric, no zero point), read
through `DequantizeLinear(axis=0, block_size=group)` (opset 21). The graph stays in the
standard domain, so the validator's rule (no custom operators) holds, and onnxruntime fuses
each DequantizeLinear + MatMul pair into its 4-/8-bit kernel (`MatMulNBits`), keeping the
weights quantized in memory; the torch executor de-quantizes them once, on load.

    quantized = quantize_stage(onnx.load("stage1.onnx"), bits=4, group=32)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ir.errors import UnsupportedModel

OPSET = 21  # blocked DequantizeLinear and 4-bit tensors
CHUNK = 1 << 22  # values quantized at a time (16 MB of float32 per temporary)
DTYPES: dict[int, str] = {  # ONNX element type -> the weight dtype a manifest names
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "int8",
    TensorProto.INT4: "int4",
    TensorProto.UINT4: "int4",
}


def quantize_block(w: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float -> (int values (K, N) in int8 storage, scales (K / group, N) float32).

    Each block takes the scale, of those that put its largest magnitude, its most negative or
    its most positive value on an end of the grid, that reconstructs it best: blocks already on
    such a grid (a GGUF's Q8_0 and Q4_0 blocks) come back exactly."""
    k, n = w.shape
    q_out = np.empty((k, n), dtype=np.int8)
    scale_out = np.empty((k // group, n), dtype=np.float32)
    step = max(1, CHUNK // (group * n))  # block rows at a time: bounded temporaries
    for start in range(0, k // group, step):
        rows = slice(start * group, (start + step) * group)
        q, scale = _blocks(w[rows].astype(np.float32).reshape(-1, group, n), bits)
        q_out[rows] = q.reshape(-1, n)
        scale_out[start : start + step] = scale
    return q_out, scale_out


def _blocks(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    top = 2 ** (bits - 1) - 1  # 127 or 7
    # (a negative scale puts the largest positive value on the grid's -top-1 end, as
    # llama.cpp's Q4_0 does when a block's largest magnitude is positive)
    candidates = [
        np.abs(blocks).max(axis=1) / top,
        -blocks.min(axis=1) / (top + 1),
        -blocks.max(axis=1) / (top + 1),
    ]
    best_q = best_scale = best_err = None
    for scale in candidates:
        scale = np.where(scale != 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(blocks / scale[:, None, :]), -top - 1, top)
        err = ((q * scale[:, None, :] - blocks) ** 2).sum(axis=1)
        if best_q is None or best_scale is None or best_err is None:
            best_q, best_scale, best_err = q, scale, err
        else:
            better = err < best_err
            best_q = np.where(better[:, None, :], q, best_q)
            best_scale = np.where(better, scale, best_scale)
            best_err = np.minimum(err, best_err)
        if not best_err.any():  # every block exact (a GGUF's blocks): no candidate does better
            break
    assert best_q is not None and best_scale is not None
    return best_q.astype(np.int8), best_scale.astype(np.float32)


def check(bits: int, group: int) -> None:
    """Refuse a quantization this module cannot write (before any work is done)."""
    if bits not in (4, 8):
        raise UnsupportedModel(f"quantize to int8 or int4, not {bits} bits")
    if group < 16 or group & (group - 1):
        raise UnsupportedModel(f"--group-size must be a power of two of at least 16, not {group}")


def quantize_stage(model: onnx.ModelProto, bits: int, group: int = 32) -> onnx.ModelProto:
    """The stage with its MatMul weights as `bits`-bit blocks of `group` rows (in place)."""
    check(bits, group)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < OPSET:
        model = _upgraded(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if (
            weight is None
            or weight.data_type != TensorProto.FLOAT
            or len(weight.dims) != 2
            or weight.dims[0] % group
            or uses[weight.name] != 1  # shared with another node (tied weights): left alone
        ):
            nodes.append(node)
            continue
        q, scale = quantize_block(numpy_helper.to_array(weight), bits, group)
        name = weight.name
        if bits == 4:
            import ml_dtypes

            stored = numpy_helper.from_array(q.astype(ml_dtypes.int4), f"{name}.q4")
        else:
            stored = numpy_helper.from_array(q, f"{name}.q8")
        graph.initializer.remove(weight)
        graph.initializer.extend([stored, numpy_helper.from_array(scale, f"{name}.scale")])
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [stored.name, f"{name}.scale"],
                [f"{name}.dq"],
                axis=0,
                block_size=group,
            )
        )
        node.input[1] = f"{name}.dq"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def _upgraded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at opset 21, in place. The converter copies what it is given, so it gets a
    copy without the weights (inputs stand in for them); its nodes then replace the model's."""
    graph = model.graph
    stand_ins = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer
    ]
    light = helper.make_model(
        helper.make_graph(list(graph.node), graph.name, [*graph.input, *stand_ins], graph.output),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    upgraded = onnx.version_converter.convert_version(light, OPSET)
    del graph.node[:]
    graph.node.extend(upgraded.graph.node)
    graph.initializer.extend(upgraded.graph.initializer)  # any the converter added (small)
    del model.opset_import[:]
    model.opset_import.extend(upgraded.opset_import)
    model.ir_version = upgraded.ir_version
    return model


def weight_dtype_of(model: onnx.ModelProto) -> str | None:
    """The dtype most of a stage's stored weights have ("float32", "float16", "int8", ...);
    None for a stage without weights."""
    counts: dict[str, int] = {}
    for t in model.graph.initializer:
        kind = DTYPES.get(t.data_type)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + int(np.prod(t.dims, dtype=np.int64))
    return max(counts, key=lambda k: counts[k]) if counts else None
