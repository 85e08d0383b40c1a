"""Model packages: build one from a transformers model, load and validate one from disk.

manifest = build_package(model, n_stages=3, out_dir=Path("pkg"), name="minilm")
package = load_package(Path("pkg"))          # validates every file before returning
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from files.atomic import write_atomic
from files.digest import sha256_file
from ir import costs
from ir.chat import check_template
from ir.consistency import where
from ir.errors import ManifestError
from ir.manifest import MANIFEST_FILE, ModelManifest, StageInfo, TensorInfo
from ir.validate import Limits, validate_onnx_file

_ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}


def _onnx_name(elem_type: int) -> str:
    """ONNX's own name of a type this project does not carry ("int16", "string", ...)."""
    try:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return str(elem_type)


def tensor_infos(values: Any) -> list[TensorInfo]:
    """TensorInfo of graph inputs or outputs (symbolic dims kept as names)."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dims: list[int | str] = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        dtype = _ONNX_DTYPES.get(t.elem_type) or _onnx_name(t.elem_type)
        out.append(TensorInfo(v.name, dtype, dims))
    return out


def describe_stage(
    index: int, name: str, placement: str, path: Path, model: onnx.ModelProto, **figures: Any
) -> StageInfo:
    """A stage's manifest entry: identity and interface from the file and graph, weight and
    FLOP figures read off the graph, the rest (`figures`) from what built it."""
    sha = sha256_file(path)
    return StageInfo(
        index=index,
        name=name,
        placement="client" if placement == "client" else "provider",
        file=f"{sha}.onnx",
        sha256=sha,
        size_bytes=path.stat().st_size,
        inputs=tensor_infos(model.graph.input),
        outputs=tensor_infos(model.graph.output),
        opset=max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        parameter_bytes=costs.parameter_bytes(model),
        flops_per_token=costs.weight_flops_per_token(model),
        attention_flops_per_token_per_context=figures.pop(
            "attention_flops_per_token_per_context", 0
        ),
        activation_bytes_per_token=figures.pop("activation_bytes_per_token", 0),
        kv_bytes_per_token=figures.pop("kv_bytes_per_token", 0),
        **figures,
    )


def check_stage_file(info: StageInfo, model: onnx.ModelProto, path: Path) -> None:
    """What the manifest says of a stage's file against the file (`model`, read from `path`):
    its size, operator set, stored weight bytes, and each input and output (name, dtype,
    shape). Raises `ManifestError` naming the stage and the field that differs."""
    at = where(info)
    size = path.stat().st_size
    if size != info.size_bytes:
        raise ManifestError(f"{at}: size_bytes is {info.size_bytes}, but the file has {size}")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset != info.opset:
        raise ManifestError(f"{at}: opset is {info.opset}, but the file imports opset {opset}")
    weights = costs.parameter_bytes(model)
    if weights != info.parameter_bytes:
        raise ManifestError(
            f"{at}: parameter_bytes is {info.parameter_bytes}, but the file stores {weights} "
            f"bytes of weights"
        )
    for kind, declared, graph in (
        ("inputs", info.inputs, model.graph.input),
        ("outputs", info.outputs, model.graph.output),
    ):
        held = tensor_infos(graph)
        if [t.name for t in held] != [t.name for t in declared]:
            raise ManifestError(
                f"{at}: the graph's {kind} {[t.name for t in held]} differ from the manifest's "
                f"{[t.name for t in declared]}"
            )
        for mine, theirs in zip(declared, held, strict=True):
            if mine != theirs:
                raise ManifestError(
                    f"{at}: {kind[:-1]} {mine.name!r} is {mine.dtype} {mine.shape} in the "
                    f"manifest, but {theirs.dtype} {theirs.shape} in the file"
                )


def check_tokenizer(path: Path) -> None:
    """The tokenizer file must be a tokenizers JSON file (not, say, a stage's ONNX file)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # (without the library texts are refused anyway; token ids work)
        return
    try:
        Tokenizer.from_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # (a panic in its Rust code is a BaseException)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ManifestError(
            f"tokenizer {path.name} is not a tokenizers JSON file (tokenizer.json): {first}"
        ) from None


def write_manifest(manifest: ModelManifest, out_dir: Path) -> None:
    write_atomic(out_dir / MANIFEST_FILE, manifest.to_json())


@dataclass
class Package:
    """A validated model package on disk."""

    directory: Path
    manifest: ModelManifest
    models: dict[int, onnx.ModelProto]


def load_package(
    directory: Path, *, limits: Limits | None = None, stages: list[int] | None = None
) -> Package:
    """Read `manifest.json` and validate the stage files (all, or the `stages` given), each
    against what the manifest says of it, the tokenizer and the chat template."""
    manifest_path = directory / MANIFEST_FILE
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read {manifest_path}: {exc.strerror}") from None
    manifest = ModelManifest.from_json(data)
    if manifest.chat_template is not None:
        check_template(manifest.chat_template)  # refused before anything of it runs
    models: dict[int, onnx.ModelProto] = {}
    for info in manifest.stages:
        if stages is not None and info.index not in stages:
            continue
        path = directory / info.file
        model = validate_onnx_file(
            path,
            sha256=info.sha256,
            package_dir=directory,
            limits=limits,
            weight_dtype=info.weight_dtype,
        )
        check_stage_file(info, model, path)
        models[info.index] = model
    if manifest.tokenizer is not None:
        tok = directory / manifest.tokenizer
        if not tok.is_file() or sha256_file(tok) != manifest.tokenizer_sha256:
            raise ManifestError(
                f"tokenizer {manifest.tokenizer} is missing or does not match its hash"
            )
        check_tokenizer(tok)
    return Package(directory, manifest, models)


__all__ = [
    "Package",
    "check_stage_file",
    "check_tokenizer",
    "describe_stage",
    "load_package",
    "tensor_infos",
    "write_manifest",
]
