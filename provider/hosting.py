"""Stage hosting: turn an assignment into a loaded stage.

Checks the assignment's manifest (IR format) and the stage it names, refuses a stage whose
weights exceed the provider's memory budget before downloading anything, fetches the artifact
by SHA-256 into the cache (resuming, with progress), validates it as ONNX (hash, standard
operators only, checker, sizes) and loads it in the chosen executor. Only validated ONNX ever
runs here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import onnx

from files.cache import ArtifactCache, ArtifactError, Progress
from ir.errors import ExecutorError, IRError, ManifestError
from ir.executors.base import Executor
from ir.manifest import ModelManifest, StageInfo
from ir.package import check_stage_file
from ir.validate import validate_onnx_file
from proto.assign import Assign
from provider.stage import LoadedStage

log = logging.getLogger(__name__)

# Memory a loaded stage takes beyond its weights (executor arenas, activations); a factor.
LOAD_OVERHEAD = 1.2


class StageRefused(Exception):
    """The assignment cannot be hosted here; the message says why."""


@dataclass(frozen=True)
class ExecutorChoice:
    kind: str = "ort"  # "ort" or "torch"
    device: str | None = None  # an ORT execution provider name, or a torch device


def stage_of(assign: Assign) -> StageInfo:
    try:
        manifest = ModelManifest.from_json(assign.manifest)
    except IRError as exc:
        raise StageRefused(f"assignment {assign.key}: {exc}") from None
    if not 0 <= assign.stage < len(manifest.stages):
        raise StageRefused(
            f"assignment {assign.key}: stage {assign.stage} does not exist in {manifest.name} "
            f"({len(manifest.stages)} stages)"
        )
    info = manifest.stages[assign.stage]
    if info.placement != "provider":
        raise StageRefused(f"assignment {assign.key}: stage {info.name} runs on the client")
    if assign.role not in ("active", "backup"):
        raise StageRefused(f"assignment {assign.key}: role must be active or backup")
    return info


# the torch executor de-quantizes int8/int4 weights to float32 when it loads them
DEQUANTIZED = {"int8": 4.0, "int4": 8.0}


def memory_needed(info: StageInfo, kind: str = "ort") -> int:
    """What loading the stage takes: its weights as stored (onnxruntime keeps quantized weights
    quantized), or as float32 for the torch executor, plus load overhead."""
    grow = DEQUANTIZED.get(info.weight_dtype, 1.0) if kind == "torch" else 1.0
    return int(max(info.parameter_bytes * grow, info.size_bytes) * LOAD_OVERHEAD)


def make_executor(choice: ExecutorChoice, model: onnx.ModelProto, info: StageInfo) -> Executor:
    if choice.kind == "torch":
        try:
            from ir.executors.torch_exec import TorchExecutor
        except ImportError as exc:
            raise StageRefused(
                f"the torch executor needs torch, which is not installed here ({exc}); "
                f"start the provider with --executor ort or install fusionai[torch]"
            ) from None
        return TorchExecutor(
            model, device=choice.device, inputs=list(info.inputs), outputs=list(info.outputs)
        )
    from ir.executors.ort import OrtExecutor

    providers = [choice.device] if choice.device else None
    return OrtExecutor(
        model, providers=providers, inputs=list(info.inputs), outputs=list(info.outputs)
    )


async def host(
    assign: Assign,
    cache: ArtifactCache,
    choice: ExecutorChoice,
    memory_budget: int,
    used_memory: int,
    *,
    session: aiohttp.ClientSession | None = None,
    progress: Progress | None = None,
) -> LoadedStage:
    """Fetch, verify, validate and load the assigned stage. Raises `StageRefused`."""
    start = time.monotonic()
    info = stage_of(assign)
    need = memory_needed(info, choice.kind)
    if used_memory + need > memory_budget:
        raise StageRefused(
            f"stage {assign.key} needs about {need} bytes of memory; {used_memory} of this "
            f"provider's {memory_budget}-byte budget are in use (--max-memory)"
        )
    try:
        path = await cache.fetch(
            info.sha256,
            assign.url,
            info.size_bytes,
            session=session,
            progress=progress,
            pin=assign.tls_sha256,
        )
    except ArtifactError as exc:
        raise StageRefused(f"stage {assign.key}: {exc}") from None
    cache.pinned.add(info.sha256)
    try:
        model = await asyncio.to_thread(
            validate_onnx_file,
            path,
            sha256=info.sha256,
            package_dir=path.parent,
            weight_dtype=info.weight_dtype,
        )
        try:  # (the file is sound, the manifest is wrong about it: the file is kept)
            check_stage_file(info, model, path)
        except ManifestError as exc:
            raise StageRefused(f"stage {assign.key}: {exc}") from None
        executor = await asyncio.to_thread(make_executor, choice, model, info)
    except ExecutorError as exc:  # this machine could not load it: the file is fine, keep it
        cache.pinned.discard(info.sha256)
        raise StageRefused(f"stage {assign.key} could not be loaded here: {exc}") from None
    except IRError as exc:
        cache.pinned.discard(info.sha256)
        cache.discard(info.sha256)  # verified bytes, but not a stage we will run
        raise StageRefused(f"stage {assign.key} refused: {exc}") from None
    except BaseException:
        cache.pinned.discard(info.sha256)
        raise
    return LoadedStage(assign.key, info, executor, assign.role, load_s=time.monotonic() - start)
