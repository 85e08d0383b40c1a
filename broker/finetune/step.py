"""One optimizer step, run by the one graph executor (`dag.execute`): every task as soon as its
inputs are ready, provider stages through a `Backend` (the swarm, or this process).
`LocalFinetune` runs the same graph, data and trainers in one process: the reference that
swarm training must match, step by step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import networkx as nx
import numpy as np

from broker.finetune.request import Data, FinetuneRequest, finetune_graph, trainable_stages
from client.stages import ClientStages
from dag.execute import Unit, execute
from dag.tasks import TaskKind
from dag.validate import DagError
from ir.manifest import ModelManifest
from ir.training import (
    HeadLoss,
    StageTrainer,
    TrainingError,
    init_adapters,
    save_state,
)

Array = np.ndarray[Any, Any]
ADAPTER_FORMAT = "fusionai.adapter"


class Backend(Protocol):
    """Where the provider stages' training work runs (the swarm, or this process)."""

    async def forward(self, pos: int, step: int, mb: int, inputs: dict[str, Array]) -> Array: ...

    async def backward(
        self, pos: int, step: int, mb: int, grad: Array, input_grad: bool
    ) -> Array | None: ...

    async def update(self, pos: int, step: int) -> float: ...


async def run_step(
    graph: nx.DiGraph,
    step: int,
    data: Data,
    client: ClientStages,
    head: HeadLoss,
    backend: Backend,
) -> float:
    """Run one optimizer step's graph, every task as soon as its inputs are ready; returns the
    step's mean token loss. A failure cancels the rest (an `ExceptionGroup`)."""
    r = data.request
    scale = 1.0 / (r.batch * r.seq_len)
    losses: dict[int, float] = {}

    async def load(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        ids, _ = data.microbatch(step, unit.microbatch)
        return {"ids": ids}

    async def embed(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"hidden": await asyncio.to_thread(client.embed, inputs["ids"])}

    async def forward(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        hidden = inputs["hidden"]
        positions = np.broadcast_to(
            np.arange(hidden.shape[1], dtype=np.int64), hidden.shape[:2]
        ).copy()
        feeds = {"hidden_states": hidden, "position_ids": positions}
        (stage,) = unit.stages
        return {"hidden": await backend.forward(stage, step, unit.microbatch, feeds), "saved": None}

    async def loss(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        m = unit.microbatch
        _, targets = data.microbatch(step, m)
        losses[m], grad = await asyncio.to_thread(head, inputs["hidden"], targets, scale)
        return {"grad": grad}

    async def backward(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        (stage,) = unit.stages
        grad = await backend.backward(stage, step, unit.microbatch, inputs["grad"], stage > 0)
        return {"grad": grad, "adapter_grad": None}

    async def update(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        (stage,) = unit.stages
        await backend.update(stage, step)
        return {}

    handlers = {
        TaskKind.DATA_LOAD: load,
        TaskKind.EMBED: embed,
        TaskKind.FORWARD: forward,
        TaskKind.LOSS: loss,
        TaskKind.BACKWARD: backward,
        TaskKind.UPDATE: update,
    }
    try:
        await execute(graph, handlers, concurrent=True)
    except DagError as exc:
        raise TrainingError(
            f"{exc} (a fine-tune step runs forward, loss, backward, update)"
        ) from None
    return float(sum(losses[m] for m in sorted(losses)))


# ---- one process: the reference -----------------------------------------------------------


class LocalBackend:
    def __init__(self, trainers: list[StageTrainer]) -> None:
        self.trainers = trainers

    async def forward(self, pos: int, step: int, mb: int, inputs: dict[str, Array]) -> Array:
        return await asyncio.to_thread(self.trainers[pos].forward, step, mb, inputs)

    async def backward(
        self, pos: int, step: int, mb: int, grad: Array, input_grad: bool
    ) -> Array | None:
        return await asyncio.to_thread(self.trainers[pos].backward, step, mb, grad, input_grad)

    async def update(self, pos: int, step: int) -> float:
        return await asyncio.to_thread(self.trainers[pos].update, step)


class LocalFinetune:
    """Fine-tune a package in this process, with the swarm's graph, data and trainers."""

    def __init__(self, directory: Path, request: FinetuneRequest) -> None:
        from broker.models import model_spec
        from ir.executors.torch_exec import OnnxModule
        from ir.package import load_package

        self.client = ClientStages(directory)
        manifest = self.client.manifest
        self.stages = trainable_stages(manifest)
        package = load_package(directory)
        self.request = request
        self.trainers = [
            StageTrainer(
                OnnxModule(package.models[s.index]),
                s,
                init_adapters(s, request.rank, request.seed),
                method=request.method,
                lr=request.lr,
                weight_decay=request.weight_decay,
                microbatches=request.microbatches,
            )
            for s in self.stages
        ]
        self.head = HeadLoss(OnnxModule(package.models[manifest.stages[-1].index]))
        self.data = Data(self.client, request)
        self.graph = finetune_graph(model_spec(manifest), self.stages, request)
        self.backend = LocalBackend(self.trainers)

    def run(
        self, steps: int | None = None, progress: Callable[[int, float], None] | None = None
    ) -> list[float]:
        """Train `steps` steps (default: the request's); the loss of each."""

        async def go() -> list[float]:
            out = []
            first = self.trainers[0].step + 1
            for step in range(first, first + (steps or self.request.steps)):
                loss = await run_step(
                    self.graph, step, self.data, self.client, self.head, self.backend
                )
                out.append(loss)
                if progress is not None:
                    progress(step, loss)
            return out

        return asyncio.run(go())

    def adapters(self) -> dict[str, Array]:
        out: dict[str, Array] = {}
        for t in self.trainers:
            out.update(t.adapters())
        return out


def adapter_file(
    adapters: Mapping[str, Array], manifest: ModelManifest, request: FinetuneRequest, **meta: Any
) -> bytes:
    """A finished adapter as safetensors: every stage's A and B under their graph input names,
    with what it was trained for in the metadata."""
    metadata = {
        "format": ADAPTER_FORMAT,
        "model": manifest.name,
        "method": request.method,
        "rank": str(request.rank),
        "stages": json.dumps([s.index for s in manifest.provider_stages()]),
        **{k: str(v) for k, v in meta.items()},
    }
    return save_state(adapters, metadata)


def head_loss(directory: Path, manifest: ModelManifest) -> HeadLoss:
    """The model's head (its last, client-side stage) as a torch module, with the loss."""
    from ir.executors.torch_exec import OnnxModule
    from ir.package import load_package

    last = manifest.stages[-1].index
    package = load_package(directory, stages=[last])
    return HeadLoss(OnnxModule(package.models[last]))
