"""The torch executor: runs an ONNX stage as a torch module, on CUDA, MPS or CPU, with autograd.

The graph is interpreted node by node with torch operations (the standard operators our stages
and common exported graphs use), so the same declarative ONNX file a provider validated is what
runs: no code from the model's author. Weights are frozen buffers (or, for pre-training, float32
parameters); gradients flow to any input that requires them (for LoRA-FA, the adapters' B
matrices).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ir.errors import ExecutorError
from ir.executors.base import check_feeds
from ir.manifest import TensorInfo

Tensor = torch.Tensor
Op = Callable[[onnx.NodeProto, list[Any]], Any]

_DTYPES: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}


def choose_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _ints(t: Tensor | None) -> list[int]:
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


def _tensor(value: onnx.TensorProto) -> Tensor:
    array = np.asarray(numpy_helper.to_array(value))
    if value.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        array = array.astype(np.int8 if value.data_type == onnx.TensorProto.INT4 else np.uint8)
    return torch.from_numpy(np.array(array))


def _dequantize(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    """DequantizeLinear: per-tensor, per-axis or blocked (`block_size` along `axis`)."""
    q, scale = x[0], x[1]
    zero = x[2] if len(x) > 2 and x[2] is not None else None
    a = _attrs(node)
    axis, block = a.get("axis", 1) % max(q.dim(), 1), a.get("block_size", 0)

    def spread(t: Tensor) -> Tensor:
        if t.dim() == 0:
            return t
        if block:
            return t.repeat_interleave(block, dim=axis)
        shape = [1] * q.dim()
        shape[axis] = -1
        return t.reshape(shape)

    values = q.to(torch.float32)
    if zero is not None:
        values = values - spread(zero.to(torch.float32))
    return (values * spread(scale.to(torch.float32))).to(scale.dtype)


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> Op:
    return lambda node, x: fn(x[0], x[1])


def _unary(fn: Callable[[Tensor], Tensor]) -> Op:
    return lambda node, x: fn(x[0])


def _div(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    a, b = x
    if a.is_floating_point() or b.is_floating_point():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


def _constant(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    attrs = _attrs(node)
    if "value" in attrs:
        return _tensor(attrs["value"])
    for key, dtype in (("value_float", torch.float32), ("value_int", torch.int64)):
        if key in attrs:
            return torch.tensor(attrs[key], dtype=dtype)
    for key, dtype in (("value_floats", torch.float32), ("value_ints", torch.int64)):
        if key in attrs:
            return torch.tensor(list(attrs[key]), dtype=dtype)
    raise ExecutorError(f"Constant {node.name}: unsupported attribute {list(attrs)}")


def _constant_of_shape(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    value = _attrs(node).get("value")
    fill = _tensor(value).reshape(()) if value is not None else torch.tensor(0.0)
    return torch.full(_ints(x[0]), fill.item(), dtype=fill.dtype, device=x[0].device)


def _gather(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    data, idx = x
    axis = _attrs(node).get("axis", 0) % data.dim()
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    out = data.index_select(axis, idx.reshape(-1))
    return out.reshape((*data.shape[:axis], *idx.shape, *data.shape[axis + 1 :]))


def _gemm(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    a = _attrs(node)
    left = x[0].transpose(0, 1) if a.get("transA", 0) else x[0]
    right = x[1].transpose(0, 1) if a.get("transB", 0) else x[1]
    out = a.get("alpha", 1.0) * torch.matmul(left, right)
    if len(x) > 2 and x[2] is not None:
        out = out + a.get("beta", 1.0) * x[2]
    return out


def _layer_norm(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    a = _attrs(node)
    data = x[0]
    axis = a.get("axis", -1) % data.dim()
    bias = x[2] if len(x) > 2 else None
    return torch.nn.functional.layer_norm(
        data, data.shape[axis:], x[1], bias, a.get("epsilon", 1e-5)
    )


def _reduce(fn: Callable[..., Tensor]) -> Op:
    """Reductions take `axes` as an attribute (before opset 18; ReduceSum before 13) or as
    their second input."""

    def op(node: onnx.NodeProto, x: list[Any]) -> Tensor:
        a = _attrs(node)
        has_input = len(x) > 1 and x[1] is not None
        axes = _ints(x[1]) if has_input else list(a.get("axes", []))
        keep = bool(a.get("keepdims", 1))
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return x[0]
            axes = list(range(x[0].dim()))
        return fn(x[0], dim=axes, keepdim=keep)

    return op


def _reshape(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    data, shape = x[0], _ints(x[1])
    if not _attrs(node).get("allowzero", 0):
        shape = [data.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return data.reshape(shape)


def _shape(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    a = _attrs(node)
    dims = list(x[0].shape)[a.get("start", 0) : a.get("end", None)]
    return torch.tensor(dims, dtype=torch.int64)


def _slice(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    data = x[0]
    starts, ends = _ints(x[1]), _ints(x[2])
    axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = _ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * data.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step <= 0:
            raise ExecutorError(f"Slice {node.name}: only positive steps are supported")
        size = data.shape[axis]
        start = max(0, min(size, start + size if start < 0 else start))
        end = max(0, min(size, end + size if end < 0 else end))
        index[axis % data.dim()] = slice(start, end, step)
    return data[tuple(index)]


def _split(node: onnx.NodeProto, x: list[Any]) -> tuple[Tensor, ...]:
    axis = _attrs(node).get("axis", 0)
    sizes = _ints(x[1]) if len(x) > 1 and x[1] is not None else None
    if sizes is None:
        n = len(node.output)
        sizes = [x[0].shape[axis] // n] * n
    return tuple(torch.split(x[0], sizes, dim=axis))


def _squeeze(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    axes = _ints(x[1]) if len(x) > 1 and x[1] is not None else list(_attrs(node).get("axes", []))
    if not axes:
        return x[0].squeeze()
    out = x[0]
    for axis in sorted((a % out.dim() for a in axes), reverse=True):
        out = out.squeeze(axis)
    return out


def _unsqueeze(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    axes = _ints(x[1]) if len(x) > 1 else list(_attrs(node).get("axes", []))
    out = x[0]
    rank = out.dim() + len(axes)
    for axis in sorted(a % rank for a in axes):
        out = out.unsqueeze(axis)
    return out


def _transpose(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    perm = _attrs(node).get("perm") or list(reversed(range(x[0].dim())))
    return x[0].permute(*perm)


def _softmax(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    return torch.softmax(x[0], dim=_attrs(node).get("axis", -1))


def _concat(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    return torch.cat([t for t in x if t is not None], dim=_attrs(node)["axis"])


def _range(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    start, limit, delta = x
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


def _clip(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    low = x[1] if len(x) > 1 and x[1] is not None else None
    high = x[2] if len(x) > 2 and x[2] is not None else None
    return torch.clamp(x[0], low, high)


def _expand(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    shape = _ints(x[1])
    target = torch.broadcast_shapes(tuple(x[0].shape), tuple(shape))
    return x[0].expand(target)


def _cumsum(node: onnx.NodeProto, x: list[Any]) -> Tensor:
    a = _attrs(node)
    axis = _ints(x[1])[0]
    values = x[0].flip(axis) if a.get("reverse") else x[0]
    out = torch.cumsum(values, dim=axis)
    if a.get("exclusive"):
        out = out - values
    return out.flip(axis) if a.get("reverse") else out


OPS: dict[str, Op] = {
    "Add": _binary(torch.add),
    "Sub": _binary(torch.sub),
    "Mul": _binary(torch.mul),
    "Div": _div,
    "Pow": _binary(torch.pow),
    "MatMul": _binary(torch.matmul),
    "Equal": _binary(torch.eq),
    "Less": _binary(torch.lt),
    "LessOrEqual": _binary(torch.le),
    "Greater": _binary(torch.gt),
    "GreaterOrEqual": _binary(torch.ge),
    "And": _binary(torch.logical_and),
    "Or": _binary(torch.logical_or),
    "Max": lambda node, x: torch.stack(torch.broadcast_tensors(*x)).amax(0),
    "Min": lambda node, x: torch.stack(torch.broadcast_tensors(*x)).amin(0),
    "Neg": _unary(torch.neg),
    "Not": _unary(torch.logical_not),
    "Sqrt": _unary(torch.sqrt),
    "Reciprocal": _unary(torch.reciprocal),
    "Exp": _unary(torch.exp),
    "Log": _unary(torch.log),
    "Erf": _unary(torch.erf),
    "Tanh": _unary(torch.tanh),
    "Sigmoid": _unary(torch.sigmoid),
    "Relu": _unary(torch.relu),
    "Sin": _unary(torch.sin),
    "Cos": _unary(torch.cos),
    "Identity": _unary(lambda t: t),
    "Dropout": lambda node, x: x[0],
    "Cast": lambda node, x: x[0].to(_DTYPES[_attrs(node)["to"]]),
    "DequantizeLinear": _dequantize,
    "Clip": _clip,
    "Concat": _concat,
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "CumSum": _cumsum,
    "Expand": _expand,
    "Gather": _gather,
    "Gemm": _gemm,
    "LayerNormalization": _layer_norm,
    "Range": _range,
    "ReduceL2": _reduce(
        lambda t, dim, keepdim: torch.linalg.vector_norm(t, dim=dim, keepdim=keepdim)
    ),
    "ReduceMean": _reduce(torch.mean),
    "ReduceMax": _reduce(torch.amax),
    "ReduceSum": _reduce(torch.sum),
    "Reshape": _reshape,
    "Shape": _shape,
    "Slice": _slice,
    "Softmax": _softmax,
    "Split": _split,
    "Squeeze": _squeeze,
    "Tile": lambda node, x: x[0].repeat(*_ints(x[1])),
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
    "Where": lambda node, x: torch.where(x[0], x[1], x[2]),
}


class OnnxModule(torch.nn.Module):
    """An ONNX graph as a torch module: `forward(**inputs) -> {output name: tensor}`."""

    def __init__(self, model: onnx.ModelProto, *, trainable: bool = False) -> None:
        """`trainable`: the graph's float initializers become parameters (for training all
        weights, as pre-training does), named in `parameter_names` by their ONNX names."""
        super().__init__()
        graph = model.graph
        missing = sorted(
            {
                n.op_type
                for n in graph.node
                if n.op_type not in OPS or n.domain not in ("", "ai.onnx")
            }
        )
        if missing:
            raise ExecutorError(
                f"the torch executor does not support {missing}; run this stage with the "
                f"onnxruntime executor"
            )
        self._names: dict[str, str] = {}
        self.parameter_names: dict[str, str] = {}  # ONNX initializer name -> attribute
        stored = {init.name: init for init in graph.initializer}
        # Quantized weights are de-quantized once, here: the buffers hold float weights.
        ready = {
            node.output[0]: node
            for node in graph.node
            if node.op_type == "DequantizeLinear" and all(n in stored for n in node.input if n)
        }
        needed = {n for node in graph.node if node.output[0] not in ready for n in node.input}
        only_quantized = {n for node in ready.values() for n in node.input} - needed
        for i, init in enumerate(graph.initializer):
            if init.name not in only_quantized:
                key, value = f"w{i}", _tensor(init)
                self._names[init.name] = key
                if trainable and value.dtype == torch.float32:
                    self.register_parameter(key, torch.nn.Parameter(value))
                    self.parameter_names[init.name] = key
                else:
                    self.register_buffer(key, value, persistent=False)
        for name, node in ready.items():
            key = f"d{len(self._names)}"
            self._names[name] = key
            args = [_tensor(stored[n]) if n else None for n in node.input]
            self.register_buffer(key, _dequantize(node, args), persistent=False)
        # Constants become buffers too, so they move to the module's device with it.
        self.nodes = []
        for node in graph.node:
            if node.output[0] in ready:
                continue
            if node.op_type == "Constant" and len(node.output) == 1:
                key = f"c{len(self._names)}"
                self._names[node.output[0]] = key
                self.register_buffer(key, _constant(node, []), persistent=False)
            else:
                self.nodes.append(node)
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)
        self.input_names = [i.name for i in graph.input if i.name not in self._names]
        self.output_names = [o.name for o in graph.output]

    def forward(self, **inputs: Tensor) -> dict[str, Tensor]:
        env: dict[str, Any] = {name: getattr(self, key) for name, key in self._names.items()}
        env.update(inputs)
        device = self._anchor.device
        for node in self.nodes:
            args = [env[name] if name else None for name in node.input]
            result = OPS[node.op_type](node, args)
            if isinstance(result, tuple):
                for name, value in zip(node.output, result, strict=False):
                    env[name] = value
            else:
                # Ops that make new tensors (Shape, Range, ConstantOfShape) make them on the
                # CPU; keep every value on the module's device.
                env[node.output[0]] = result if result.device == device else result.to(device)
        return {name: env[name] for name in self.output_names}


class TorchExecutor:
    """Runs one ONNX stage with torch. `run` takes and returns numpy; `forward` keeps autograd."""

    def __init__(
        self,
        model: onnx.ModelProto,
        *,
        device: str | None = None,
        inputs: list[TensorInfo] | None = None,
        outputs: list[TensorInfo] | None = None,
    ) -> None:
        from ir.package import tensor_infos

        self.device = choose_device(device)
        self.module = OnnxModule(model).to(self.device).eval()
        self.name = f"torch:{self.device.type}"
        self.inputs = inputs or tensor_infos(model.graph.input)
        self.outputs = outputs or tensor_infos(model.graph.output)

    def forward(self, **inputs: Tensor) -> dict[str, Tensor]:
        """Run with autograd: gradients reach every input tensor that requires them."""
        check_feeds(self.inputs, inputs)
        return self.module(**{k: v.to(self.device) for k, v in inputs.items()})

    def run(self, feeds: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        check_feeds(self.inputs, feeds)
        with torch.no_grad():
            out = self.module(
                **{
                    k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
                    for k, v in feeds.items()
                }
            )
        return {k: v.detach().cpu().numpy() for k, v in out.items()}
