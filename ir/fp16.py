"""fp16 for weights (stored) and activations (on the wire), computing in fp32.

Float32 initializers are stored as float16 and cast back to float32 inside the graph, halving
file size and download; float32 graph inputs and outputs (hidden states, KV cache, logits)
become float16, halving bytes on the wire. Compute stays fp32, so the graph runs the same on
CPUs without fast fp16 and on GPUs. LoRA adapter inputs stay fp32 (fine-tuning needs them).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _keep_fp32(name: str) -> bool:
    return name.startswith("lora_")


def convert_to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    prologue: list[onnx.NodeProto] = []
    new_inits = []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT:
            new_inits.append(init)
            continue
        array = numpy_helper.to_array(init)
        half = numpy_helper.from_array(array.astype(np.float16), init.name + "__fp16")
        new_inits.append(half)
        prologue.append(helper.make_node("Cast", [half.name], [init.name], to=TensorProto.FLOAT))
    del graph.initializer[:]
    graph.initializer.extend(new_inits)

    for value in graph.input:
        t = value.type.tensor_type
        if t.elem_type == TensorProto.FLOAT and not _keep_fp32(value.name):
            inner = value.name + "__fp32"
            _rename_uses(graph, value.name, inner)
            t.elem_type = TensorProto.FLOAT16
            prologue.append(helper.make_node("Cast", [value.name], [inner], to=TensorProto.FLOAT))

    epilogue = []
    for value in graph.output:
        t = value.type.tensor_type
        if t.elem_type == TensorProto.FLOAT:
            inner = value.name + "__fp32"
            _rename_outputs(graph, value.name, inner)
            t.elem_type = TensorProto.FLOAT16
            epilogue.append(helper.make_node("Cast", [inner], [value.name], to=TensorProto.FLOAT16))

    nodes = prologue + list(graph.node) + epilogue
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    for out in graph.output:
        if out.name == old:  # an input passed straight through: keep it via the Cast
            out.name = new


def _rename_outputs(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
