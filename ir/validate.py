"""Validation of ONNX stage files before anything runs them.

A provider runs graphs from strangers, so on load: the SHA-256 must match the manifest, the file
must parse and pass `onnx.checker`, every operator must come from the standard ONNX domains (no
custom ops, which would mean native code), external data must stay inside the package, and
sizes must stay under limits. Each failure is a typed `IRError` saying what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx.checker
import onnx.defs
from onnx import TensorProto, external_data_helper

from files.digest import sha256_file
from ir.errors import CorruptModel, ForbiddenOperator, HashMismatch, TooLarge, UnsafeExternalData

STANDARD_DOMAINS = frozenset({"", "ai.onnx"})


@dataclass(frozen=True)
class Limits:
    # Largest ONNX file accepted; bytes.
    max_file_bytes: int = 8 * 1024**3
    # Largest external-data total accepted per stage; bytes.
    max_external_bytes: int = 64 * 1024**3
    # Most nodes accepted in one graph; nodes.
    max_nodes: int = 200_000


def validate_onnx_file(
    path: Path,
    *,
    sha256: str | None,
    package_dir: Path,
    limits: Limits | None = None,
    weight_dtype: str | None = None,
) -> onnx.ModelProto:
    """Check one stage file as described above; returns the parsed model (weights loaded).
    `weight_dtype`: what the manifest says most of its weights are; the file must agree."""
    limits = limits or Limits()
    if not path.is_file():
        raise CorruptModel(f"{path.name} is missing from the package; fetch it again")
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise TooLarge(f"{path.name} has {size} bytes; the limit is {limits.max_file_bytes}")
    if sha256 is not None:
        actual = sha256_file(path)
        if actual != sha256:
            raise HashMismatch(
                f"{path.name}: SHA-256 is {actual}, the manifest says {sha256}; the file is "
                f"corrupt or was altered: delete it and fetch it again"
            )
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise CorruptModel(f"{path.name} is not a readable ONNX file: {exc}") from None
    check_graph(model, name=path.name, limits=limits)
    _check_external_data(model, path.name, package_dir, limits)
    try:  # on the path, so models whose weights are external (over 2 GB) are checked too
        onnx.checker.check_model(str(path))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptModel(f"{path.name} fails the ONNX checker: {first}") from None
    if any(_is_external(t) for t in external_data_helper._get_all_tensors(model)):
        try:
            onnx.load_external_data_for_model(model, str(package_dir))
        except Exception as exc:
            raise CorruptModel(f"{path.name}: cannot read its external data: {exc}") from None
    if weight_dtype is not None:
        from ir.quantize import weight_dtype_of

        held = weight_dtype_of(model)
        if held is not None and held != weight_dtype:
            raise CorruptModel(
                f"{path.name}: the manifest says its weights are {weight_dtype}, but they are "
                f"{held}; the package is inconsistent: build it again"
            )
    return model


def check_graph(model: onnx.ModelProto, *, name: str, limits: Limits | None = None) -> None:
    """Reject custom domains and non-standard operators, including inside functions."""
    for opset in model.opset_import:
        if opset.domain not in STANDARD_DOMAINS:
            raise ForbiddenOperator(
                f"{name} imports operator set {opset.domain!r}; only the standard ONNX domain "
                f"is accepted (custom operators would run native code)"
            )
    if model.functions:
        raise ForbiddenOperator(f"{name} defines local functions; export without them")
    limits = limits or Limits()
    nodes = list(_all_nodes(model.graph))
    if len(nodes) > limits.max_nodes:
        raise TooLarge(f"{name} has {len(nodes)} nodes; the limit is {limits.max_nodes}")
    for node in nodes:
        if not isinstance(node.op_type, str) or not isinstance(node.domain, str):
            # (protobuf hands over invalid UTF-8 in these string fields as bytes)
            raise CorruptModel(f"{name}: a node's operator or domain name is not valid text")
        if node.domain not in STANDARD_DOMAINS:
            raise ForbiddenOperator(
                f"{name}: node {node.name or node.op_type!r} uses operator "
                f"{node.domain}::{node.op_type}, outside the standard ONNX domain"
            )
        if not onnx.defs.has(node.op_type, node.domain):
            raise ForbiddenOperator(f"{name}: {node.op_type} is not a standard ONNX operator")


def _all_nodes(graph: onnx.GraphProto):  # type: ignore[no-untyped-def]
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            for sub in attr.graphs:
                yield from _all_nodes(sub)


def _is_external(tensor: TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == TensorProto.EXTERNAL


def _check_external_data(
    model: onnx.ModelProto, name: str, package_dir: Path, limits: Limits
) -> None:
    root = package_dir.resolve()
    total = 0
    for tensor in external_data_helper._get_all_tensors(model):  # Constants and subgraphs too
        if not _is_external(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        target = (root / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(root):
            raise UnsafeExternalData(
                f"{name}: tensor {tensor.name!r} keeps its data at {location!r}, outside the "
                f"package directory; refusing to read it"
            )
        if not target.is_file():
            raise CorruptModel(f"{name}: external data file {location!r} is missing")
        total += int(info.get("length", target.stat().st_size))
    if total > limits.max_external_bytes:
        raise TooLarge(f"{name}: {total} bytes of external data; limit {limits.max_external_bytes}")
