"""Bring your own ONNX: split an existing `.onnx` file at given tensor boundaries into stages.

Each cut is a set of tensor names; stage k computes cut k from what came before. A stage's
inputs are the tensors it needs from the previous cut, the original graph inputs (an attention
mask, say) and nothing else; `onnx.utils.extract_model` cuts it out. All stages are marked for
providers; the caller keeps whichever it wants to run itself.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnx.utils

from files.atomic import move_atomic
from ir.errors import UnsupportedModel
from ir.manifest import ModelManifest, StageInfo
from ir.package import describe_stage, write_manifest
from ir.quantize import weight_dtype_of
from ir.validate import check_graph


def _needed_inputs(
    graph: onnx.GraphProto, outputs: Sequence[str], available: set[str]
) -> list[str]:
    """Tensors in `available` that computing `outputs` needs, in graph-input order first."""
    producer = {out: node for node in graph.node for out in node.output}
    initializers = {t.name for t in graph.initializer}
    needed: set[str] = set()
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in available:
            needed.add(name)
            continue
        if name in initializers:
            continue
        node = producer.get(name)
        if node is None:
            raise UnsupportedModel(
                f"tensor {name!r} is neither produced in the graph nor available"
            )
        stack.extend(node.input)
    order = [i.name for i in graph.input]
    return sorted(needed, key=lambda n: (order.index(n) if n in order else len(order), n))


def split_onnx(
    source: Path, cuts: Sequence[Sequence[str]], out_dir: Path, *, name: str
) -> ModelManifest:
    """Split `source` at `cuts` (each a list of tensor names) into len(cuts) + 1 stages."""
    model = onnx.load(str(source))
    check_graph(model, name=source.name)
    graph = model.graph
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for cut in cuts:
        for tensor in cut:
            if tensor not in known:
                raise UnsupportedModel(f"cut tensor {tensor!r} is not in {source.name}")
    graph_inputs = [
        i.name for i in graph.input if i.name not in {t.name for t in graph.initializer}
    ]
    boundaries = [*[list(c) for c in cuts], [o.name for o in graph.output]]
    out_dir.mkdir(parents=True, exist_ok=True)
    stages: list[StageInfo] = []
    previous: list[str] = []
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".split-") as tmp:
        for index, outputs in enumerate(boundaries):
            inputs = _needed_inputs(graph, outputs, set(previous) | set(graph_inputs))
            path = Path(tmp) / f"stage{index}.onnx"
            onnx.utils.extract_model(str(source), str(path), inputs, outputs, check_model=True)
            part = onnx.load(str(path))
            info = describe_stage(
                index,
                f"part.{index}",
                "provider",
                path,
                part,
                weight_dtype=weight_dtype_of(part) or "float32",
            )
            stages.append(info)
            move_atomic(path, out_dir / info.file)
            previous = list(outputs)
    manifest = ModelManifest(
        name=name, family="onnx", config={"source": source.name}, stages=stages
    )
    write_manifest(manifest, out_dir)
    return manifest
