"""Fine-tune jobs: LoRA-FA (or LoRA) training of a decoder through the swarm's stages.

Each optimizer step runs the `dag.builders.finetune` graph: every microbatch is loaded and
embedded here (the client's stages), flows forward through the providers serving the model's
stages, meets the loss at the head (here, with torch), and its gradient flows back through the
same providers, each of which accumulates its own adapters' gradients; once every microbatch's
gradient is in, each provider takes an AdamW step on its adapters. Microbatches run
concurrently, so stages work on different microbatches at once (a pipeline).

State protection: every `snapshot_every` steps each provider encodes its adapters and
optimizer state into n erasure-coded shards (any k rebuild it) kept in n other providers' RAM;
the broker records each stage's shard hashes and holders in SQLite once every stage has
snapshotted that step. When a provider is lost the job goes back to the newest complete
snapshot: the replacement rebuilds the lost stage's state from shards, the others roll back to
their own copy, and training replays from there; a step's data depends on (seed, step) alone,
so the replay gives the same losses. No disk checkpoint is involved.

`LocalFinetune` runs the same graph, data and trainers in one process: the reference that
swarm training must match, step by step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import networkx as nx
import numpy as np

from broker.jobs import JobError, JobFailed, JobRunner, Ref
from client.stages import ClientStages
from dag.builders import finetune
from dag.execute import Unit, execute
from dag.tasks import TaskKind, task
from dag.validate import DagError
from ir.manifest import ModelManifest, StageInfo
from ir.training import (
    METHODS,
    HeadLoss,
    StageTrainer,
    TrainingError,
    init_adapters,
    pack,
    save_state,
    step_rows,
)
from p2p import ErrorCode, P2PError, RemoteError, RequestTimeout, Tensor
from p2p.codec import Message, ProtocolSpec
from proto.snapshot import SNAPSHOT, Holder, SnapshotRestore, SnapshotTake, SnapshotTaken
from proto.train import (
    TRAIN,
    TrainBackward,
    TrainClose,
    TrainExport,
    TrainForward,
    TrainOpen,
    TrainOutput,
    TrainState,
    TrainUpdate,
    TrainUpdated,
)

if TYPE_CHECKING:
    from broker.schema import JobRow

log = logging.getLogger("fusionai.broker")
Array = np.ndarray[Any, Any]
ADAPTER_FORMAT = "fusionai.adapter"
MAX_STEPS = 100_000
MAX_RECOVERIES = 10  # provider losses one job survives


@dataclass(frozen=True)
class FinetuneRequest:
    model: str
    texts: list[str]
    steps: int = 20
    batch: int = 8  # sequences per optimizer step
    microbatches: int = 2  # the batch is cut into this many microbatches
    seq_len: int = 32  # tokens per sequence
    method: str = "lora-fa"
    rank: int = 4
    lr: float = 1e-2
    weight_decay: float = 0.0
    seed: int = 0
    snapshot_every: int = 5  # steps between snapshots (0: none)
    shards: tuple[int, int] = (2, 3)  # k of n
    kind: str = "finetune"

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["shards"] = list(self.shards)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FinetuneRequest:
        values = dict(data)
        values["shards"] = tuple(values.get("shards", (2, 3)))
        return cls(**values)


FIELDS = set(FinetuneRequest.__dataclass_fields__)


def parse_finetune(body: Mapping[str, Any], max_texts: int) -> FinetuneRequest:
    """Validate a fine-tune submission (JSON); raises `JobError` naming the field."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise JobError(unknown[0], "unknown field")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise JobError("model", "name the model (a string)")
    texts = body.get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise JobError("texts", "the training data: a non-empty list of strings")
    if len(texts) > max_texts:
        raise JobError("texts", f"{len(texts)} texts; one job takes at most {max_texts}")
    d = FinetuneRequest(model=model, texts=texts)

    def integer(name: str, low: int, high: int) -> int:
        value = body.get(name, getattr(d, name))
        if type(value) is not int or not low <= value <= high:
            raise JobError(name, f"must be an integer from {low} to {high}")
        return value

    def number(name: str, low: float, high: float) -> float:
        value = body.get(name, getattr(d, name))
        if type(value) not in (int, float) or not low <= value < high:
            raise JobError(name, f"must be a number in [{low}, {high})")
        return float(value)

    steps = integer("steps", 1, MAX_STEPS)
    batch = integer("batch", 1, 4096)
    microbatches = integer("microbatches", 1, batch)
    if batch % microbatches:
        raise JobError("microbatches", f"must divide the batch ({batch})")
    seq_len = integer("seq_len", 2, 4096)
    method = body.get("method", d.method)
    if method not in METHODS:
        raise JobError("method", f"must be one of {list(METHODS)}")
    lr = number("lr", 0.0, 10.0)
    if lr <= 0:
        raise JobError("lr", "must be positive")
    shards = body.get("shards", list(d.shards))
    if (
        not isinstance(shards, list | tuple)
        or len(shards) != 2
        or not all(type(v) is int for v in shards)
        or not 1 <= shards[0] <= shards[1] <= 64
    ):
        raise JobError("shards", "[k, n]: n shards, any k of which rebuild; 1 <= k <= n <= 64")
    return FinetuneRequest(
        model=model,
        texts=texts,
        steps=steps,
        batch=batch,
        microbatches=microbatches,
        seq_len=seq_len,
        method=method,
        rank=integer("rank", 1, 1024),
        lr=lr,
        weight_decay=number("weight_decay", 0.0, 1.0),
        seed=integer("seed", 0, 2**63 - 1),
        snapshot_every=integer("snapshot_every", 0, MAX_STEPS),
        shards=(shards[0], shards[1]),
    )


def trainable_stages(manifest: ModelManifest) -> list[StageInfo]:
    """The provider stages of a decoder with adapter slots in each; raises `JobError`."""
    stages = manifest.provider_stages()
    if not any(i.name.startswith("past_") for s in stages for i in s.inputs):
        raise JobError("model", f"{manifest.name} is not a decoder; fine-tuning trains LMs")
    bare = [s.name for s in stages if not s.adapters]
    if bare:
        raise JobError(
            "model",
            f"stages {bare} of {manifest.name} have no adapter slots; export the model with "
            f"adapters (fusionai ir split MODEL --adapters q,v)",
        )
    return stages


MAX_MICROBATCH_TOKENS = 65_536  # sequences x tokens of one microbatch
MAX_LOGIT_BYTES = 1 << 30  # the head's float32 logits of one microbatch, on the broker


def check_size(manifest: ModelManifest, request: FinetuneRequest) -> None:
    """A microbatch must fit a wire message and the broker's head; `JobError` if not."""
    from proto.forward import MAX_ACTIVATION_BYTES

    tokens = request.microbatch * request.seq_len
    hidden = int(manifest.config.get("hidden_size", 0) or 0)
    vocab = int(manifest.config.get("vocab_size", 0) or 0)
    if tokens > MAX_MICROBATCH_TOKENS:
        raise JobError(
            "microbatches",
            f"a microbatch of {request.microbatch} x {request.seq_len} = {tokens} tokens; at most "
            f"{MAX_MICROBATCH_TOKENS}: use more microbatches or a shorter seq_len",
        )
    if tokens * hidden * 4 > MAX_ACTIVATION_BYTES or tokens * vocab * 4 > MAX_LOGIT_BYTES:
        raise JobError(
            "microbatches",
            f"a microbatch of {tokens} tokens is too large for this model's activations or "
            f"logits: use more microbatches or a shorter seq_len",
        )


def finetune_graph(spec: Any, stages: list[StageInfo], request: FinetuneRequest) -> nx.DiGraph:
    """One optimizer step as a `dag` graph (the same graph every step)."""
    adapter_bytes = [
        4.0 * request.rank * sum(a.in_features + a.out_features for a in s.adapters) for s in stages
    ]
    return finetune(
        spec,
        [(i, i + 1) for i in range(len(stages))],
        microbatches=request.microbatches,
        batch=request.microbatch,
        seq=request.seq_len,
        adapter_bytes=adapter_bytes,
    )


class Data:
    """The training texts, tokenized (each ends in end-of-sequence) and packed into rows."""

    def __init__(self, client: ClientStages, request: FinetuneRequest) -> None:
        if client.tokenizer is None:
            raise JobError("texts", f"model {request.model} ships no tokenizer")
        eos = [client.eos] if client.eos is not None else []
        encodings = client.tokenizer.encode_batch(list(request.texts))
        vocab = int(client.manifest.config.get("vocab_size", 0) or 0)
        sequences = [[*e.ids, *eos] for e in encodings]
        try:
            self.blocks = pack(sequences, request.seq_len)
        except TrainingError as exc:
            raise JobError("texts", str(exc)) from None
        if vocab and int(self.blocks.max()) >= vocab:
            raise JobError("texts", "the tokenizer gives ids outside the model's vocabulary")
        self.request = request
        self.tokens = int(sum(len(s) for s in sequences))

    def microbatch(self, step: int, m: int) -> tuple[Array, Array]:
        """(input ids, target ids), each (microbatch, seq_len), of microbatch m of `step`."""
        r = self.request
        rows = step_rows(len(self.blocks), step, r.batch, r.seed)[
            m * r.microbatch : (m + 1) * r.microbatch
        ]
        block = self.blocks[rows]
        return block[:, :-1].copy(), block[:, 1:].copy()


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


# ---- the swarm ----------------------------------------------------------------------------


class StageFailed(Exception):
    def __init__(self, pos: int, peer: str, reason: str) -> None:
        super().__init__(f"stage {pos} on {peer[:12]}: {reason}")
        self.pos, self.peer, self.reason = pos, peer, reason


class SwarmFinetune:
    """Runs one fine-tune job through the swarm for the job runner."""

    def __init__(self, runner: JobRunner, job: JobRow) -> None:
        self.runner = runner
        self.config = runner.config
        self.store = runner.store
        self.events = runner.events
        self.serving = runner.serving
        self.host = runner.host
        self.job = job
        self.request = FinetuneRequest.from_json(job.request)
        self.model = runner.models.models[job.model]
        self.stages = trainable_stages(self.model.manifest)
        self.keys = [self.model.unit_key(u) for u in self.model.units]
        self.route: list[str] = []
        self.snapshotting: asyncio.Task[None] | None = None
        self.recoveries = 0
        self.committed = 0  # the newest snapshot every stage completed
        self.touched: set[str] = set()  # every provider this job used: closed at the end

    # ---- requests to providers -------------------------------------------------------------

    async def _call(self, pos: int, spec: ProtocolSpec, msg: Message, timeout: float) -> Any:
        """A request to the provider training stage `pos`; `StageFailed` if it cannot serve."""
        peer = self.route[pos]
        self.touched.add(peer)
        deadline = self.runner.clock() + self.config.request_timeout_s
        while True:
            call = await self.runner.request_unless_lost(peer, spec, msg, timeout)
            if call is None:
                raise StageFailed(pos, peer, "the provider was declared lost")
            try:
                return call.result()
            except RemoteError as exc:
                if exc.code == ErrorCode.BUSY and self.runner.clock() < deadline:
                    await asyncio.sleep(0.2)  # inference goes first; training waits its turn
                    continue
                raise StageFailed(pos, peer, f"{exc.code}: {exc}") from None
            except RequestTimeout as exc:
                await self.serving.suspect(peer, "a training request timed out")
                raise StageFailed(pos, peer, str(exc)) from None
            except P2PError as exc:
                await self.serving.suspect(peer, f"a training request failed: {exc}")
                raise StageFailed(pos, peer, str(exc)) from None

    async def forward(self, pos: int, step: int, mb: int, inputs: dict[str, Array]) -> Array:
        msg = TrainForward(
            job=self.job.id,
            stage=self.keys[pos],
            step=step,
            microbatch=mb,
            inputs={k: Tensor.from_numpy(v) for k, v in inputs.items()},
        )
        out: TrainOutput = await self._call(pos, TRAIN, msg, self.config.request_timeout_s)
        if out.output is None:
            raise StageFailed(pos, self.route[pos], "the answer has no hidden states")
        return out.output.to_numpy()

    async def backward(
        self, pos: int, step: int, mb: int, grad: Array, input_grad: bool
    ) -> Array | None:
        msg = TrainBackward(
            job=self.job.id,
            stage=self.keys[pos],
            step=step,
            microbatch=mb,
            grad=Tensor.from_numpy(grad),
            input_grad=input_grad,
        )
        out: TrainOutput = await self._call(pos, TRAIN, msg, self.config.request_timeout_s)
        if input_grad and out.output is None:
            raise StageFailed(pos, self.route[pos], "the answer has no input gradient")
        return out.output.to_numpy() if out.output is not None else None

    async def update(self, pos: int, step: int) -> float:
        every = self.request.snapshot_every
        msg = TrainUpdate(
            job=self.job.id,
            stage=self.keys[pos],
            step=step,
            keep=bool(every and step % every == 0),
            committed=self.committed,
        )
        out: TrainUpdated = await self._call(pos, TRAIN, msg, self.config.request_timeout_s)
        return out.grad_norm

    def _open(self, pos: int, adapters: bool = True) -> TrainOpen:
        """The run's settings for stage `pos`, with its initial adapters (or none: a restore
        takes them from the snapshot)."""
        r, info = self.request, self.stages[pos]
        init = init_adapters(info, r.rank, r.seed) if adapters else {}
        return TrainOpen(
            job=self.job.id,
            stage=self.keys[pos],
            method=r.method,
            lr=r.lr,
            weight_decay=r.weight_decay,
            microbatches=r.microbatches,
            adapters={k: Tensor.from_numpy(v) for k, v in init.items()},
        )

    async def _each(self, call: Callable[[int], Awaitable[Any]]) -> list[Any]:
        """`call(pos)` for every stage at once; the first stage failure is raised."""
        results = await asyncio.gather(
            *(call(p) for p in range(len(self.keys))), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if isinstance(e, JobFailed)), errors[0])
        return results

    # ---- route, start, recovery ------------------------------------------------------------

    async def _pick(self, pos: int, avoid: set[str]) -> str:
        return await self.runner.pick(Ref(self.job.id, self.job.model), pos, avoid)

    async def _start(self) -> int:
        """Open (or, after a broker restart, restore) every stage; the step reached."""
        self.route = [await self._pick(p, set()) for p in range(len(self.keys))]
        snap = self.store.latest_snapshot(self.job.id, len(self.keys))
        if snap is not None:
            return await self._restore(snap)
        await self._each(lambda p: self._call(p, TRAIN, self._open(p), 60.0))
        self.store.delete_results_from(self.job.id, 0)  # a restart without a snapshot: anew
        return 0

    async def _restore(self, snap: tuple[int, dict[int, dict[str, Any]]]) -> int:
        step, records = snap

        async def one(pos: int) -> None:
            rec = records[pos]
            msg = SnapshotRestore(
                open=self._open(pos, adapters=False),
                step=step,
                k=rec["k"],
                sha256=rec["sha256"],
                size=rec["size"],
                shards=rec["shards"],
                holders=[Holder(peer=h["peer"], addrs=h["addrs"]) for h in rec["holders"]],
            )
            try:
                await self._call(pos, SNAPSHOT, msg, 120.0)
            except StageFailed as exc:
                if "cannot rebuild" in exc.reason:
                    raise JobFailed(f"stage {pos} ({self.keys[pos]}): {exc.reason}") from None
                raise

        await self._each(one)
        self.store.delete_results_from(self.job.id, step)
        self.committed = step
        return step

    async def _recover(self, failed: StageFailed) -> int:
        """Go back to the newest complete snapshot (or the start) on a repaired route; the
        step reached. A failure while recovering starts the recovery again."""
        while True:
            try:
                return await self._recover_once(failed)
            except StageFailed as exc:
                failed = exc

    async def _recover_once(self, failed: StageFailed) -> int:
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES:
            raise JobFailed(f"gave up after {MAX_RECOVERIES} provider losses; last: {failed}")
        start = time.perf_counter()
        if self.snapshotting is not None:
            self.snapshotting.cancel()
            await asyncio.gather(self.snapshotting, return_exceptions=True)
            self.snapshotting = None
        await self.serving.suspect(failed.peer, f"training failed: {failed.reason}")
        snap = self.store.latest_snapshot(self.job.id, len(self.keys))
        self.events.emit(
            "finetune_recovering",
            job=self.job.id,
            peer=failed.peer,
            stage=self.keys[failed.pos],
            reason=failed.reason,
            from_step=snap[0] if snap else 0,
        )
        avoid = {failed.peer}
        self.route = [
            peer
            if peer != failed.peer and self.serving.registry.alive(peer)
            else await self._pick(pos, avoid)
            for pos, peer in enumerate(self.route)
        ]
        if snap is None:
            await self._each(lambda p: self._call(p, TRAIN, self._open(p), 60.0))
            self.store.delete_results_from(self.job.id, 0)
            step = 0
        else:
            step = await self._restore(snap)
        self.events.emit(
            "finetune_recovered",
            job=self.job.id,
            step=step,
            route=self.route,
            seconds=round(time.perf_counter() - start, 3),
        )
        return step

    # ---- snapshots -------------------------------------------------------------------------

    def _holders(self, pos: int, n: int) -> list[Holder]:
        owner = self.route[pos]
        live = sorted(
            p
            for p in self.serving.registry.core.pool.providers
            if p != owner and self.serving.registry.alive(p)
        )
        if not live:
            return []
        shift = pos % len(live)  # spread the stages' shards over different providers
        chosen = (live[shift:] + live[:shift])[:n]
        return [Holder(peer=p, addrs=self.serving.peer_info(p)["addrs"]) for p in chosen]

    async def _snapshot(self, step: int) -> None:
        k, n = self.request.shards
        holders = [self._holders(p, n) for p in range(len(self.keys))]
        short = [p for p, h in enumerate(holders) if len(h) < k]
        if short:
            self.events.emit(
                "snapshot_skipped",
                job=self.job.id,
                step=step,
                reason=f"stages {short} have fewer than k={k} other providers to hold shards",
            )
            return
        if any(len(h) < n for h in holders):
            self.events.emit(
                "snapshot_reduced",
                job=self.job.id,
                step=step,
                reason=f"fewer than n={n} other providers: {min(map(len, holders))} shards of "
                f"which any {k} rebuild (survives {min(map(len, holders)) - k} losses)",
            )
        for hs in holders:
            self.touched.update(h.peer for h in hs)
        start = time.perf_counter()

        async def take(pos: int) -> SnapshotTaken:
            msg = SnapshotTake(
                job=self.job.id,
                stage=self.keys[pos],
                step=step,
                k=k,
                holders=holders[pos],
                committed=self.committed,
            )
            answer: SnapshotTaken = await self._call(pos, SNAPSHOT, msg, 120.0)
            return answer

        try:
            taken = await self._each(take)
        except (StageFailed, P2PError) as exc:
            self.events.emit("snapshot_failed", job=self.job.id, step=step, reason=str(exc))
            return
        records = {
            pos: {
                "peer": self.route[pos],
                "k": k,
                "sha256": t.sha256,
                "size": t.size,
                "shards": t.shards,
                "holders": [{"peer": h.peer, "addrs": h.addrs} for h in holders[pos]],
            }
            for pos, t in enumerate(taken)
        }
        self.store.put_snapshot(self.job.id, step, records)
        self.committed = step
        self.events.emit(
            "snapshot",
            job=self.job.id,
            step=step,
            k=k,
            n=min(len(h) for h in holders),
            bytes=sum(t.size for t in taken),
            seconds=round(time.perf_counter() - start, 4),
            holders={str(pos): [h.peer for h in hs] for pos, hs in enumerate(holders)},
        )

    # ---- the job ---------------------------------------------------------------------------

    async def run(self) -> None:
        client = await asyncio.to_thread(self.runner.client, self.job.model)
        try:
            data = await asyncio.to_thread(Data, client, self.request)
        except JobError as exc:  # (checked at submission; the model may have changed since)
            raise JobFailed(str(exc)) from None
        # Off the event loop: importing torch and building the head's module can take
        # seconds, and a stalled loop answers no heartbeat (providers would join again).
        head = await asyncio.to_thread(head_loss, self.model.directory, self.model.manifest)
        graph = finetune_graph(self.serving.spec(self.job.model), self.stages, self.request)
        try:
            await self._train(client, data, head, graph)
        except asyncio.CancelledError:
            # the job was cancelled (close its runs), or the broker is stopping (keep them:
            # the job resumes from its snapshot when the broker is back)
            row = self.store.job(self.job.id, full=False)
            if row is None or row.state not in ("placed", "running"):
                await asyncio.shield(self._close())
            raise
        except BaseException:
            await asyncio.shield(self._close())
            raise
        await self._close()

    async def _train(
        self, client: ClientStages, data: Data, head: HeadLoss, graph: nx.DiGraph
    ) -> None:
        self.store.set_job_state(self.job.id, "running")
        try:
            step = await self._start()
        except StageFailed as exc:
            step = await self._recover(exc)
        await self._steps(client, data, head, graph, step)

    async def _steps(
        self, client: ClientStages, data: Data, head: HeadLoss, graph: nx.DiGraph, step: int
    ) -> None:
        self.events.emit(
            "finetune_started", job=self.job.id, route=self.route, step=step, tokens=data.tokens
        )
        while True:
            step = await self._run_steps(client, data, head, graph, step)
            try:
                await self._finish_adapter(step)
                return
            except StageFailed as exc:  # a provider lost while reading the adapters back:
                step = await self._recover(exc)  # redo the steps after the newest snapshot

    async def _run_steps(
        self, client: ClientStages, data: Data, head: HeadLoss, graph: nx.DiGraph, step: int
    ) -> int:
        """Steps after `step` up to the last (recovering from lost providers); the last."""
        r = self.request
        while step < r.steps:
            step += 1
            started = time.perf_counter()
            try:
                loss = await run_step(graph, step, data, client, head, self)
            except BaseExceptionGroup as group:
                for kind in (JobFailed, StageFailed):
                    found = _first(group, kind)
                    if isinstance(found, JobFailed):
                        raise found from None
                    if isinstance(found, StageFailed):
                        step = await self._recover(found)
                        break
                else:
                    raise
                continue
            seconds = time.perf_counter() - started
            tokens = r.batch * r.seq_len
            record = np.array([loss, tokens, seconds], dtype=np.float64)
            self.store.put_result(self.job.id, step - 1, 1, (3,), record.tobytes())
            self.events.emit(
                "finetune_step",
                job=self.job.id,
                step=step,
                loss=round(loss, 6),
                tokens_s=round(tokens / seconds, 1),
            )
            if r.snapshot_every and step % r.snapshot_every == 0 and step < r.steps:
                if self.snapshotting is not None:
                    await self.snapshotting
                self.snapshotting = asyncio.create_task(self._snapshot(step))
        if self.snapshotting is not None:
            await self.snapshotting
            self.snapshotting = None
        return step

    async def _finish_adapter(self, step: int) -> None:
        """Read the adapters back from the providers into one file (`StageFailed` if one of
        them is lost meanwhile)."""

        async def export(pos: int) -> TrainState:
            msg = TrainExport(job=self.job.id, stage=self.keys[pos])
            state: TrainState = await self._call(pos, TRAIN, msg, 60.0)
            return state

        states = await self._each(export)
        adapters: dict[str, Array] = {}
        for s in states:
            adapters.update({k: t.to_numpy() for k, t in s.adapters.items()})
        steps = self.store.finetune_steps(self.job.id)
        data = await asyncio.to_thread(
            adapter_file,
            adapters,
            self.model.manifest,
            self.request,
            job=self.job.id,
            steps=step,
            final_loss=steps[-1][1][0] if steps else "",
        )
        await asyncio.to_thread(self.runner.save_adapter, self.job.id, self.job.model, data)

    async def _close(self) -> None:
        """Training runs and shards of this job are dropped everywhere (best effort)."""
        if self.snapshotting is not None:
            self.snapshotting.cancel()
            await asyncio.gather(self.snapshotting, return_exceptions=True)
            self.snapshotting = None
        peers = self.touched | set(self.route) | self.store.snapshot_holders(self.job.id)

        async def close(peer: str) -> None:
            if not self.serving.registry.alive(peer):
                return
            try:
                await self.host.request(peer, TRAIN, TrainClose(job=self.job.id), timeout=5.0)
            except P2PError:
                pass

        await asyncio.gather(*(close(p) for p in peers), return_exceptions=True)


def head_loss(directory: Path, manifest: ModelManifest) -> HeadLoss:
    """The model's head (its last, client-side stage) as a torch module, with the loss."""
    from ir.executors.torch_exec import OnnxModule
    from ir.package import load_package

    last = manifest.stages[-1].index
    package = load_package(directory, stages=[last])
    return HeadLoss(OnnxModule(package.models[last]))


def finetune_estimate(graph: nx.DiGraph, steps: int) -> float:
    """FLOPs of the whole job (the queue ranks jobs by size)."""
    return sum(task(graph, n).flops for n in graph.nodes) * steps


def _first(group: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type `kind` in a (possibly nested) exception group."""
    if isinstance(group, kind):
        return group
    if isinstance(group, BaseExceptionGroup):
        for exc in group.exceptions:
            found = _first(exc, kind)
            if found is not None:
                return found
    return None
