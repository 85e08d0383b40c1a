"""Model packages: build one from a transformers model, load and validate one from disk.

manifest = build_package(model, n_stages=3, out_dir=Path("pkg"), name="minilm")
package = load_package(Path("pkg"))          # validates every file before returning
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ir import costs
from ir.errors import IRError, ManifestError
from ir.families import AdapterConfig, StageModule, plan_stages
from ir.manifest import MANIFEST_FILE, ModelManifest, StageInfo, TensorInfo
from ir.validate import Limits, sha256_file, validate_onnx_file

log = logging.getLogger(__name__)

OPSET = 17
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


def export_stage(stage: StageModule, path: Path, opset: int = OPSET) -> None:
    """Export one stage to ONNX with dynamic batch/sequence/past axes (TorchScript exporter)."""
    import torch

    stage.module.eval()
    with torch.no_grad():
        torch.onnx.export(
            stage.module,
            stage.example_inputs,
            str(path),
            input_names=stage.input_names,
            output_names=stage.output_names,
            dynamic_axes=stage.dynamic_axes,
            opset_version=opset,
            dynamo=False,
            do_constant_folding=True,
        )


def stage_info(
    index: int, stage: StageModule, path: Path, model: onnx.ModelProto, weight_dtype: str
) -> StageInfo:
    sha = sha256_file(path)
    return StageInfo(
        index=index,
        name=stage.name,
        placement="client" if stage.placement == "client" else "provider",
        file=f"{sha}.onnx",
        sha256=sha,
        size_bytes=path.stat().st_size,
        inputs=tensor_infos(model.graph.input),
        outputs=tensor_infos(model.graph.output),
        opset=max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        parameter_bytes=costs.parameter_bytes(model),
        flops_per_token=costs.weight_flops_per_token(model),
        attention_flops_per_token_per_context=stage.attention_flops_per_token_per_context,
        activation_bytes_per_token=stage.activation_bytes_per_token
        // (2 if weight_dtype == "float16" else 1),
        kv_bytes_per_token=stage.kv_bytes_per_token,
        layers=list(stage.layers) if stage.layers else None,
        adapters=list(stage.adapters),
        weight_dtype=weight_dtype,
    )


def build_package(
    model: Any,
    n_stages: int,
    out_dir: Path,
    *,
    name: str,
    adapters: AdapterConfig | None = None,
    tokenizer_file: Path | None = None,
    fp16: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ModelManifest:
    """Split `model` into `n_stages` provider stages (plus client stages) and write a package.

    Files are written under a temporary name and moved into place, and the manifest is written
    last, so an interrupted build never leaves a package that looks complete.
    """
    family, config, stages = plan_stages(model, n_stages, adapters)
    out_dir.mkdir(parents=True, exist_ok=True)
    infos: list[StageInfo] = []
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        for index, stage in enumerate(stages):
            started = time.perf_counter()
            path = Path(tmp) / f"stage{index}.onnx"
            export_stage(stage, path)
            graph = onnx.load(str(path))
            if fp16:
                from ir.fp16 import convert_to_fp16

                graph = convert_to_fp16(graph)
                onnx.save(graph, str(path))
            info = stage_info(index, stage, path, graph, "float16" if fp16 else "float32")
            os.replace(path, out_dir / info.file)
            infos.append(info)
            if progress:
                elapsed = time.perf_counter() - started
                progress(
                    f"stage {index} {stage.name}: {info.size_bytes / 1e6:.1f} MB in {elapsed:.1f} s"
                )
    tok_name = tok_sha = None
    if tokenizer_file is not None:
        tok_sha = sha256_file(tokenizer_file)
        tok_name = f"{tok_sha}.json"
        shutil.copyfile(tokenizer_file, out_dir / tok_name)
    manifest = ModelManifest(
        name=name,
        family=family,
        config=config,
        stages=infos,
        tokenizer=tok_name,
        tokenizer_sha256=tok_sha,
    )
    write_manifest(manifest, out_dir)
    return manifest


def write_manifest(manifest: ModelManifest, out_dir: Path) -> None:
    tmp = out_dir / (MANIFEST_FILE + ".tmp")
    tmp.write_bytes(manifest.to_json())
    os.replace(tmp, out_dir / MANIFEST_FILE)


@dataclass
class Package:
    """A validated model package on disk."""

    directory: Path
    manifest: ModelManifest
    models: dict[int, onnx.ModelProto]

    def stage_path(self, index: int) -> Path:
        return self.directory / self.manifest.stages[index].file


def load_package(
    directory: Path, *, limits: Limits | None = None, stages: list[int] | None = None
) -> Package:
    """Read `manifest.json` and validate the stage files (all, or the `stages` given)."""
    manifest_path = directory / MANIFEST_FILE
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read {manifest_path}: {exc.strerror}") from None
    manifest = ModelManifest.from_json(data)
    models: dict[int, onnx.ModelProto] = {}
    for info in manifest.stages:
        if stages is not None and info.index not in stages:
            continue
        if Path(info.file).name != info.file:
            raise ManifestError(
                f"stage {info.index} names {info.file!r}, which is not a plain file name"
            )
        model = validate_onnx_file(
            directory / info.file, sha256=info.sha256, package_dir=directory, limits=limits
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


__all__ = ["IRError", "Package", "build_package", "export_stage", "load_package", "tensor_infos"]
