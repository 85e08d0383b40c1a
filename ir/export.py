"""Build a model package from a torch model: plan stages, export each to ONNX, write files.

manifest = build_package(model, n_stages=3, out_dir=Path("pkg"), name="minilm")
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx

from files.atomic import move_atomic
from files.digest import sha256_file
from ir.chat import Chat, check_template
from ir.errors import UnsupportedModel
from ir.families import AdapterConfig, StageModule, plan_stages
from ir.manifest import WIRES, ModelManifest, StageInfo
from ir.package import describe_stage, write_manifest

OPSET = 17


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a package stores weights and sends activations.

    fp16: weights stored and activations sent as fp16 (compute stays fp32).
    quantize: (bits, group): provider stages' matrix weights as int8 or int4 blocks.
    wire: how hidden states travel between stages ("native" or "int8", see `ir.manifest`).
    """

    fp16: bool = False
    quantize: tuple[int, int] | None = None
    wire: str = "native"

    def check(self) -> None:
        if self.fp16 and self.quantize:
            raise UnsupportedModel("--fp16 and --quantize do not combine yet: choose one")
        if self.wire not in WIRES:
            raise UnsupportedModel(f"unknown wire format {self.wire!r}; known: {', '.join(WIRES)}")
        if self.fp16 and self.wire != "native":
            raise UnsupportedModel(
                "--fp16 already sends hidden states as fp16; --wire int8 takes fp32 ones: "
                "choose one"
            )
        if self.quantize:
            from ir.quantize import check

            check(*self.quantize)


def wire_bytes(values: int, wire: str, itemsize: int = 4) -> int:
    """Bytes of a hidden state of `values` floats in `wire` format (the int8 format: one byte
    a value plus a float32 scale per 64 values, or per row when it is not a multiple of 64;
    `p2p.tensor.WIRE_BLOCK`)."""
    if wire == "int8":
        return values + 4 * (values // 64 if values % 64 == 0 else 1)
    return values * itemsize


def export_stage(
    stage: StageModule, path: Path, opset: int = OPSET, *, trainable: bool = False
) -> None:
    """Export one stage to ONNX with dynamic batch/sequence/past axes (TorchScript exporter).

    The exporter merges weights of equal value into one initializer when the module is in eval
    mode (a fresh model's norm weights are all ones): `trainable` exports in training mode,
    where only weights that are one tensor are merged, so each can be trained on its own. A
    stage with dropout is refused then (it would be exported as training-mode dropout)."""
    import torch

    if trainable:
        for name, m in stage.module.named_modules():
            rates = [getattr(m, "p", 0.0) if isinstance(m, torch.nn.Dropout) else 0.0]
            rates += [v for k, v in vars(m).items() if k.endswith("dropout")]
            if any(isinstance(v, int | float) and v > 0 for v in rates):
                raise UnsupportedModel(
                    f"stage {stage.name} has dropout ({name or 'the stage'}); a trainable "
                    f"export needs a model without"
                )
        stage.module.train()
        mode = torch.onnx.TrainingMode.PRESERVE
    else:
        stage.module.eval()
        mode = torch.onnx.TrainingMode.EVAL
    try:
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
                training=mode,
            )
    finally:
        stage.module.eval()


def stage_info(
    index: int,
    stage: StageModule,
    path: Path,
    model: onnx.ModelProto,
    weight_dtype: str,
    wire: str = "native",
) -> StageInfo:
    itemsize = 2 if weight_dtype == "float16" else 4
    return describe_stage(
        index,
        stage.name,
        stage.placement,
        path,
        model,
        attention_flops_per_token_per_context=stage.attention_flops_per_token_per_context,
        activation_bytes_per_token=wire_bytes(
            stage.activation_bytes_per_token // 4, wire, itemsize
        ),
        kv_bytes_per_token=stage.kv_bytes_per_token * itemsize // 4,
        layers=list(stage.layers) if stage.layers else None,
        adapters=list(stage.adapters),
        weight_dtype=weight_dtype,
    )


def _trim() -> None:
    """Hand memory freed by the last stage back to the system (glibc keeps it otherwise, and a
    long split's footprint would creep up stage by stage)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def build_package(
    model: Any,
    n_stages: int,
    out_dir: Path,
    *,
    name: str,
    adapters: AdapterConfig | None = None,
    tokenizer_file: Path | None = None,
    chat: Chat | None = None,
    encoding: Encoding = Encoding(),
    progress: Callable[[str], None] | None = None,
    trainable: bool = False,
) -> ModelManifest:
    """Split `model` into `n_stages` provider stages (plus client stages) and write a package
    (`trainable`: every weight its own initializer, for pre-training; `export_stage`)."""
    family, config, stages = plan_stages(model, n_stages, adapters)
    return write_package(
        family,
        config,
        stages,
        out_dir,
        name=name,
        tokenizer_file=tokenizer_file,
        chat=chat,
        encoding=encoding,
        progress=progress,
        trainable=trainable,
    )


def write_package(
    family: str,
    config: dict[str, int | float | str],
    stages: list[StageModule],
    out_dir: Path,
    *,
    name: str,
    tokenizer_file: Path | None = None,
    chat: Chat | None = None,
    encoding: Encoding = Encoding(),
    progress: Callable[[str], None] | None = None,
    trainable: bool = False,
) -> ModelManifest:
    """Export planned stages and write the package, stored and sent as `encoding` says.

    Files are written under a temporary name and moved into place, and the manifest is written
    last, so an interrupted build never leaves a package that looks complete; a folder this
    call created is removed again if the build fails. A stage with `prepare`/`release` hooks
    has its weights loaded just for its export.
    """
    encoding.check()
    chat = chat or Chat()
    if chat.template is not None:
        check_template(chat.template)
    with _removed_if_failed(out_dir), _young_collections():
        infos: list[StageInfo] = []
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
            for index, stage in enumerate(stages):
                started = time.perf_counter()
                path = Path(tmp) / f"stage{index}.onnx"
                info = _export(index, stage, path, encoding, trainable)
                move_atomic(path, out_dir / info.file)
                infos.append(info)
                if progress:
                    seconds = time.perf_counter() - started
                    progress(
                        f"stage {index} {stage.name}: {info.size_bytes / 1e6:.1f} MB in "
                        f"{seconds:.1f} s"
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
            chat_template=chat.template,
            special_tokens=dict(chat.special_tokens),
            stop_token_ids=list(chat.stop_token_ids),
            wire=encoding.wire,
        )
        write_manifest(manifest, out_dir)
    return manifest


@contextlib.contextmanager
def _young_collections() -> Iterator[None]:
    """While stages are exported, the objects that existed before (the libraries' modules,
    the model's structure) are left out of garbage collections: a full collection after each
    stage, to free its weights, then scans only what the stages made (it took a quarter
    second a stage, scanning everything transformers and torch had built)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _removed_if_failed(out_dir: Path) -> Iterator[None]:
    """Make `out_dir`; if it did not exist and what follows fails, remove it again."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _export(
    index: int,
    stage: StageModule,
    path: Path,
    encoding: Encoding,
    trainable: bool = False,
) -> StageInfo:
    """Export one stage to `path` (loading its weights first if it has hooks), convert it as
    asked, and describe it."""
    if stage.prepare:
        stage.prepare()
    try:
        export_stage(stage, path, trainable=trainable)
    finally:
        if stage.release:
            stage.release()
            gc.collect()  # the stage's torch weights go before its graph is read back
            _trim()
    graph = onnx.load(str(path))
    dtype = "float32"
    if encoding.fp16:
        from ir.fp16 import convert_to_fp16

        graph, dtype = convert_to_fp16(graph), "float16"
        onnx.save(graph, str(path))
    if encoding.quantize and stage.placement == "provider":
        from ir.quantize import quantize_stage

        graph = quantize_stage(graph, *encoding.quantize)
        dtype = f"int{encoding.quantize[0]}"
        onnx.save(graph, str(path))
    return stage_info(index, stage, path, graph, dtype, encoding.wire)
