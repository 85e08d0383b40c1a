"""A manifest checked against itself: its figures, dtypes, layer ranges and stage chain.

`ModelManifest.from_json` runs `check_manifest` on every manifest it decodes, so a broker,
a provider and a client refuse the same manifests, before any file is read. What a manifest
says about its files (their size, inputs, outputs, opset, weights) is compared with the files
themselves where they are loaded (`ir.package.load_package`, `ir.package.check_stage_file`).
Each failure is a `ManifestError` naming the stage and the field at fault.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING

from files.digest import is_sha256
from ir.errors import ManifestError

if TYPE_CHECKING:
    from ir.manifest import ModelManifest, StageInfo, TensorInfo

# Tensor dtypes a stage may take or give: those `ir.package.tensor_infos` names and the
# wire carries (`p2p.tensor.DTYPES`).
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
# What most of a stage's stored weights may be (`ir.quantize.DTYPES`).
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
MIN_OPSET = 7  # the oldest ONNX operator set onnxruntime runs
MAX_FIGURE = 2**53  # largest size, count or FLOP figure accepted (exact as a float)
# Config entries that are sizes or counts: positive integers where given.
SIZES = (
    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "vocab_size", "max_positions",
)  # fmt: skip
# A block stage's hidden-state output, which the next stage takes as `hidden_states`.
HIDDEN_OUT = ("hidden_states_out", "hidden_states")


@cache
def max_opset() -> int:
    """The newest ONNX operator set the installed onnx knows."""
    import onnx.defs  # (on first use: importing a manifest stays light)

    return int(onnx.defs.onnx_opset_version())


def check_manifest(manifest: ModelManifest) -> None:
    """Raise `ManifestError` for the first figure, name or link the manifest gets wrong."""
    if not manifest.stages:
        raise ManifestError("the manifest lists no stages")
    if [s.index for s in manifest.stages] != list(range(len(manifest.stages))):
        raise ManifestError("stage indices must be 0, 1, 2, ... in order")
    _check_config(manifest)
    _check_tokenizer(manifest)
    for stage in manifest.stages:
        _check_stage(stage)
    _check_layers(manifest)
    for before, after in zip(manifest.stages, manifest.stages[1:], strict=False):
        _check_link(before, after)


def where(stage: StageInfo) -> str:
    """How messages name a stage: `stage 2 (layers.3-5)`."""
    return f"stage {stage.index} ({stage.name})"


def plain_file_name(name: str) -> bool:
    """Whether `name` names a file in the package folder itself (no folder, no drive)."""
    return bool(name) and all(
        p(name).name == name and not p(name).anchor for p in (PurePosixPath, PureWindowsPath)
    )


def _figure(value: int, what: str, *, least: int = 0) -> None:
    if not least <= value <= MAX_FIGURE:
        raise ManifestError(f"{what} is {value}; it must be between {least} and {MAX_FIGURE}")


def _check_config(manifest: ModelManifest) -> None:
    for key, value in manifest.config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ManifestError(f"config.{key} is {value}; it must be a finite number")
        if key in SIZES and (not isinstance(value, int) or not 0 < value <= MAX_FIGURE):
            raise ManifestError(f"config.{key} is {value!r}; it must be a positive integer")
    if any(t < 0 for t in manifest.stop_token_ids):
        raise ManifestError(f"stop_token_ids {manifest.stop_token_ids} must not be negative")


def _check_tokenizer(manifest: ModelManifest) -> None:
    name, sha = manifest.tokenizer, manifest.tokenizer_sha256
    if (name is None) != (sha is None):
        raise ManifestError("tokenizer and tokenizer_sha256 go together: give both or neither")
    if sha is not None and not is_sha256(sha):
        raise ManifestError("tokenizer_sha256 must be a SHA-256: 64 lowercase hex digits")
    if name is not None and not plain_file_name(name):
        raise ManifestError(f"tokenizer names {name!r}, which is not a plain file name")


def _check_stage(stage: StageInfo) -> None:
    at = where(stage)
    if not plain_file_name(stage.file):
        raise ManifestError(f"{at} names {stage.file!r}, which is not a plain file name")
    if not is_sha256(stage.sha256):
        raise ManifestError(f"{at}: sha256 must be a SHA-256: 64 lowercase hex digits")
    _figure(stage.size_bytes, f"{at}: size_bytes", least=1)
    for field in (
        "parameter_bytes",
        "flops_per_token",
        "attention_flops_per_token_per_context",
        "activation_bytes_per_token",
        "kv_bytes_per_token",
    ):
        _figure(getattr(stage, field), f"{at}: {field}")
    if not MIN_OPSET <= stage.opset <= max_opset():
        raise ManifestError(
            f"{at}: opset {stage.opset} is outside {MIN_OPSET}..{max_opset()}, the operator "
            f"sets this FusionAI runs; export the stage with a supported opset"
        )
    if stage.weight_dtype not in WEIGHT_DTYPES:
        raise ManifestError(
            f"{at}: weight_dtype {stage.weight_dtype!r} is none of {', '.join(WEIGHT_DTYPES)}"
        )
    if not stage.outputs:
        raise ManifestError(f"{at} declares no outputs")
    for kind, tensors in (("inputs", stage.inputs), ("outputs", stage.outputs)):
        names = [t.name for t in tensors]
        if len(set(names)) != len(names) or not all(names):
            raise ManifestError(f"{at}: {kind} {names} must have distinct, non-empty names")
        for t in tensors:
            _check_tensor(t, f"{at}: {kind[:-1]} {t.name!r}")
    layers = stage.layers
    if layers is not None and not (len(layers) == 2 and 0 <= layers[0] < layers[1] <= MAX_FIGURE):
        raise ManifestError(
            f"{at}: layers {layers} must be [first, last + 1] with 0 <= first < last + 1 "
            f"(reversed or empty ranges are refused)"
        )
    inputs = {t.name for t in stage.inputs}
    for a in stage.adapters:
        _figure(a.in_features, f"{at}: adapter {a.target} in_features", least=1)
        _figure(a.out_features, f"{at}: adapter {a.target} out_features", least=1)
        if not {a.a_input, a.b_input} <= inputs:
            raise ManifestError(
                f"{at}: adapter {a.target} names inputs {a.a_input!r} and {a.b_input!r}, "
                f"which the stage does not declare"
            )


def _check_tensor(tensor: TensorInfo, what: str) -> None:
    if tensor.dtype not in DTYPES:
        raise ManifestError(f"{what}: dtype {tensor.dtype!r} is none of {', '.join(DTYPES)}")
    for dim in tensor.shape:
        if isinstance(dim, int):
            _figure(dim, f"{what}: a dimension of its shape {tensor.shape}")
        elif not dim:
            raise ManifestError(f"{what}: a dimension of its shape {tensor.shape} has no name")


def _check_layers(manifest: ModelManifest) -> None:
    """Stages with blocks cover 0..num_layers in order, each taking up where one ended."""
    end = 0
    blocks = [s for s in manifest.stages if s.layers is not None]
    for stage in blocks:
        assert stage.layers is not None
        if stage.layers[0] != end:
            raise ManifestError(
                f"{where(stage)}: layers {stage.layers} should start at block {end}, where "
                f"the stage before it ends: a stage's blocks follow on from the last's"
            )
        end = stage.layers[1]
    total = manifest.config.get("num_layers")
    if blocks and isinstance(total, int) and end != total:
        raise ManifestError(
            f"the stages' layers end at block {end}, but config.num_layers is {total}"
        )


def _check_link(before: StageInfo, after: StageInfo) -> None:
    """`after` takes something `before` gives, each such tensor with the dtype and the fixed
    sizes it is given with. A block stage's `hidden_states_out` is the next `hidden_states`;
    other inputs (a mask, positions, the KV cache, adapters) come from the caller."""
    given = {t.name: t for t in before.outputs}
    if HIDDEN_OUT[0] in given and HIDDEN_OUT[1] not in given:
        given[HIDDEN_OUT[1]] = given[HIDDEN_OUT[0]]
    taken = [t for t in after.inputs if t.name in given]
    if not taken:
        raise ManifestError(
            f"{where(after)} takes none of what {where(before)} gives: its inputs are "
            f"{[t.name for t in after.inputs]}, the outputs before it "
            f"{[t.name for t in before.outputs]}"
        )
    for t in taken:
        out = given[t.name]
        fixed = len(t.shape) == len(out.shape) and all(
            a == b
            for a, b in zip(t.shape, out.shape, strict=True)
            if isinstance(a, int) and isinstance(b, int)
        )
        if t.dtype != out.dtype or not fixed:
            raise ManifestError(
                f"{where(after)}: input {t.name!r} is {t.dtype} {t.shape}, but "
                f"{where(before)} gives {out.name!r} as {out.dtype} {out.shape}"
            )
