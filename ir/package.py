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


def tensor_infos(values: Any) -> list[TensorInfo]:
    """TensorInfo of graph inputs or outputs (symbolic dims kept as names)."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dims: list[int | str] = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append(TensorInfo(v.name, _ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), dims))
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
    """Read `manifest.json` and validate the stage files (all, or the `stages` given) and
    the chat template."""
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
        if Path(info.file).name != info.file:
            raise ManifestError(
                f"stage {info.index} names {info.file!r}, which is not a plain file name"
            )
        model = validate_onnx_file(
            directory / info.file,
            sha256=info.sha256,
            package_dir=directory,
            limits=limits,
            weight_dtype=info.weight_dtype,
        )
        names = [i.name for i in model.graph.input]
        if names != [i.name for i in info.inputs]:
            raise ManifestError(
                f"stage {info.index}: graph inputs {names} differ from the manifest's"
            )
        models[info.index] = model
    if manifest.tokenizer is not None:
        tok = directory / manifest.tokenizer
        if not tok.is_file() or sha256_file(tok) != manifest.tokenizer_sha256:
            raise ManifestError(
                f"tokenizer {manifest.tokenizer} is missing or does not match its hash"
            )
    return Package(directory, manifest, models)


__all__ = ["Package", "describe_stage", "load_package", "tensor_infos", "write_manifest"]
