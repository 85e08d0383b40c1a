"""Fine-tuning on a provider: stage trainers, erasure-coded snapshots and the shards it holds.

The broker opens a training run on a stage this provider serves; the provider builds a torch
module of the same validated ONNX file it serves (torch must be installed) and trains its own
adapters with it (`ir.training.StageTrainer`). Forward and backward requests go through the
same admission as inference, as training work: they use at most half the queue.

Snapshots: at the broker's request the provider keeps a copy of its state after an update,
encodes it (safetensors bytes) into n shards with a k-of-n erasure code (zfec), and pushes
one shard to each of n other providers, which keep them in RAM (`ShardStore`). A replacement
provider rebuilds a lost stage's state from any k shards, each checked against the SHA-256 the
broker recorded, and the whole against its SHA-256. Nothing touches the disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ir.errors import IRError
from ir.training import StageTrainer, TrainingError, load_state, save_state
from p2p import ErrorCode, Host, P2PError, Refused, RemoteError, Tensor
from proto.snapshot import (
    SHARD,
    Holder,
    ShardData,
    ShardDrop,
    ShardGet,
    ShardPut,
    ShardStored,
    SnapshotRestore,
    SnapshotTake,
    SnapshotTaken,
)
from proto.train import (
    TrainBackward,
    TrainClose,
    TrainClosed,
    TrainExport,
    TrainForward,
    TrainOpen,
    TrainOutput,
    TrainReady,
    TrainState,
    TrainUpdate,
    TrainUpdated,
)
from provider.gate import Priority
from provider.serving import Server
from provider.shards import ShardError, ShardStore, decode, encode, sha256
from provider.stage import LoadedStage

log = logging.getLogger(__name__)
Array = np.ndarray[Any, Any]
MAX_RUNS = 16  # training runs open at once on one provider
SHARD_TIMEOUT_S = 30.0


@dataclass
class _Run:
    open: TrainOpen
    trainer: StageTrainer
    kept: dict[int, bytes] = field(default_factory=dict)  # step -> state bytes to snapshot


class Training:
    """Training runs on this provider's stages, and the shards it holds for others."""

    def __init__(
        self,
        server: Server,
        broker_id: str,
        module_of: Callable[[LoadedStage], Any],
        *,
        shard_budget_bytes: int = 512 * 1024 * 1024,
    ) -> None:
        self.server = server
        self.broker_id = broker_id
        self.module_of = module_of
        self.store = ShardStore(shard_budget_bytes)
        self.runs: dict[tuple[str, str], _Run] = {}
        self.host: Host | None = None
        self._lock = threading.Lock()
        self.stragglers: set[asyncio.Future[None]] = set()  # shard fetches no longer needed

    # ---- training (compute handler: worker threads) ----------------------------------------

    def _broker_only(self, peer: str) -> None:
        if peer != self.broker_id:
            raise Refused(ErrorCode.REFUSED, "only this provider's broker may run training here")

    def _run(self, job: str, stage: str) -> _Run:
        run = self.runs.get((job, stage))
        if run is None:
            raise Refused(
                ErrorCode.NOT_FOUND, f"no training run of job {job} on stage {stage} here"
            )
        return run

    def train(
        self,
        peer: str,
        request: TrainOpen | TrainForward | TrainBackward | TrainUpdate | TrainExport | TrainClose,
    ) -> TrainReady | TrainOutput | TrainUpdated | TrainState | TrainClosed:
        self._broker_only(peer)
        try:
            if isinstance(request, TrainOpen):
                run = self.open(request, None)
                return TrainReady(
                    job=request.job,
                    step=run.trainer.step,
                    trainable_parameters=run.trainer.trainable_parameters,
                )
            if isinstance(request, TrainClose):
                with self._lock:
                    for key in [k for k in self.runs if k[0] == request.job]:
                        del self.runs[key]
                self.store.drop(request.job)
                return TrainClosed(job=request.job)
            run = self._run(request.job, request.stage)
            if isinstance(request, TrainForward):
                return self._forward(peer, run, request)
            if isinstance(request, TrainBackward):
                return self._backward(peer, run, request)
            if isinstance(request, TrainUpdate):
                norm = run.trainer.update(request.step)
                if request.keep:
                    run.kept[request.step] = save_state(run.trainer.state())
                for step in [s for s in run.kept if s < request.committed]:
                    del run.kept[step]  # the newest complete snapshot and later ones stay
                return TrainUpdated(step=request.step, grad_norm=norm)
            return TrainState(
                step=run.trainer.step,
                adapters={k: Tensor.from_numpy(v) for k, v in run.trainer.adapters().items()},
            )
        except TrainingError as exc:
            raise Refused(ErrorCode.REFUSED, str(exc)) from None

    def open(self, request: TrainOpen, state: dict[str, Array] | None) -> _Run:
        stage = self.server.stages.get(request.stage)
        if stage is None:
            raise Refused(ErrorCode.NOT_FOUND, f"stage {request.stage!r} is not loaded here")
        if not 1 <= request.microbatches <= 4096:
            raise Refused(ErrorCode.REFUSED, "microbatches must be 1 to 4096")
        if not (0 < request.lr < 10 and 0 <= request.weight_decay < 1):
            raise Refused(ErrorCode.REFUSED, "lr must be in (0, 10), weight_decay in [0, 1)")
        try:
            adapters = {k: t.to_numpy() for k, t in request.adapters.items()}
        except ValueError as exc:
            raise Refused(ErrorCode.REFUSED, f"bad adapter tensor: {exc}") from None
        if state is not None:  # a restore: the adapters come from the snapshot
            names = [n for a in stage.info.adapters for n in (a.a_input, a.b_input)]
            adapters = {n: state[n] for n in names if n in state}
        with self._lock:
            if (request.job, request.stage) not in self.runs and len(self.runs) >= MAX_RUNS:
                raise Refused(ErrorCode.BUSY, f"{MAX_RUNS} training runs are open here already")
        try:
            module = self.module_of(stage)
        except (ImportError, IRError) as exc:
            raise Refused(ErrorCode.REFUSED, f"this provider cannot train: {exc}") from None
        trainer = StageTrainer(
            module,
            stage.info,
            adapters,
            method=request.method,
            lr=request.lr,
            weight_decay=request.weight_decay,
            microbatches=request.microbatches,
        )
        if state is not None:
            trainer.load_state(state)
        run = _Run(request, trainer)
        with self._lock:
            self.runs[(request.job, request.stage)] = run
        return run

    def _forward(self, peer: str, run: _Run, request: TrainForward) -> TrainOutput:
        with self.server._admit(peer, training=True) as number:
            self.server._apply_fault(number, request.stage)
            inputs = _arrays(request.inputs)
            with self.server.gate.slot(Priority.TRAINING):
                start = time.perf_counter()
                out = run.trainer.forward(request.step, request.microbatch, inputs)
                ms = (time.perf_counter() - start) * 1e3
        return TrainOutput(output=Tensor.from_numpy(out), compute_ms=ms)

    def _backward(self, peer: str, run: _Run, request: TrainBackward) -> TrainOutput:
        with self.server._admit(peer, training=True) as number:
            self.server._apply_fault(number, request.stage)
            grad = _arrays({"grad": request.grad})["grad"]
            with self.server.gate.slot(Priority.TRAINING):
                start = time.perf_counter()
                out = run.trainer.backward(
                    request.step, request.microbatch, grad, request.input_grad
                )
                ms = (time.perf_counter() - start) * 1e3
        return TrainOutput(output=None if out is None else Tensor.from_numpy(out), compute_ms=ms)

    # ---- shards (compute handler) ----------------------------------------------------------

    def shard(self, peer: str, request: ShardPut | ShardGet | ShardDrop) -> ShardStored | ShardData:
        if isinstance(request, ShardPut):
            return ShardStored(bytes_held=self.store.put(request))
        if isinstance(request, ShardDrop):
            self._broker_only(peer)
            return ShardStored(bytes_held=self.store.drop(request.job))
        data = self.store.get(request.job, request.stage, request.step, request.index)
        if data is None:
            raise Refused(
                ErrorCode.NOT_FOUND,
                f"no shard {request.index} of {request.stage} at step {request.step} here",
            )
        return ShardData(data=data)

    # ---- snapshots (control handler: the event loop) ---------------------------------------

    async def snapshot(
        self, peer: str, request: SnapshotTake | SnapshotRestore
    ) -> SnapshotTaken | TrainReady:
        self._broker_only(peer)
        if isinstance(request, SnapshotTake):
            return await self._take(request)
        return await self._restore(request)

    async def _dial(self, holder: Holder) -> None:
        assert self.host is not None
        if self.host.is_connected(holder.peer):
            return
        errors = []
        for addr in holder.addrs:
            full = addr if "/p2p/" in addr else f"{addr}/p2p/{holder.peer}"
            try:
                await asyncio.wait_for(self.host.connect(full), 10.0)
                return
            except (P2PError, OSError, TimeoutError) as exc:
                errors.append(f"{addr}: {exc}")
        raise ShardError(f"cannot reach {holder.peer[:12]}: {'; '.join(errors) or 'no address'}")

    async def _take(self, request: SnapshotTake) -> SnapshotTaken:
        run = self._run(request.job, request.stage)
        data = run.kept.get(request.step)
        if data is None:
            raise Refused(ErrorCode.NOT_FOUND, f"no state kept at step {request.step}")
        n = len(request.holders)
        start = time.perf_counter()
        try:
            shards = await asyncio.to_thread(encode, data, request.k, n)
        except ShardError as exc:
            raise Refused(ErrorCode.REFUSED, str(exc)) from None
        hashes = await asyncio.to_thread(lambda: [sha256(data), *map(sha256, shards)])
        encoded = time.perf_counter()

        async def push(i: int, holder: Holder) -> None:
            msg = ShardPut(
                job=request.job,
                stage=request.stage,
                step=request.step,
                index=i,
                k=request.k,
                n=n,
                size=len(data),
                data=shards[i],
                committed=request.committed,
            )
            if self.host is not None and holder.peer == self.host.peer_id:
                self.store.put(msg)
                return
            await self._dial(holder)
            assert self.host is not None
            await self.host.request(holder.peer, SHARD, msg, timeout=SHARD_TIMEOUT_S)

        results = await asyncio.gather(
            *(push(i, h) for i, h in enumerate(request.holders)), return_exceptions=True
        )
        failed = [
            f"{h.peer[:12]}: {r}"
            for h, r in zip(request.holders, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            raise Refused(ErrorCode.REFUSED, f"shards not stored: {'; '.join(failed)}")
        return SnapshotTaken(
            step=request.step,
            sha256=hashes[0],
            size=len(data),
            shards=hashes[1:],
            encode_ms=(encoded - start) * 1e3,
            push_ms=(time.perf_counter() - encoded) * 1e3,
        )

    async def _restore(self, request: SnapshotRestore) -> TrainReady:
        o = request.open
        run = self.runs.get((o.job, o.stage))
        data = run.kept.get(request.step) if run is not None else None
        if data is None or await asyncio.to_thread(sha256, data) != request.sha256:
            data = await self._gather(request)
        try:
            state = await asyncio.to_thread(load_state, data)
        except TrainingError as exc:
            raise Refused(ErrorCode.REFUSED, f"the rebuilt state is unusable: {exc}") from None
        try:
            run = await asyncio.to_thread(self.open, o, state)
        except TrainingError as exc:
            raise Refused(ErrorCode.REFUSED, f"the rebuilt state does not fit: {exc}") from None
        run.kept = {request.step: data}  # later copies belong to steps that will be redone
        return TrainReady(
            job=o.job, step=run.trainer.step, trainable_parameters=run.trainer.trainable_parameters
        )

    def _straggler_done(self, task: asyncio.Future[None]) -> None:
        self.stragglers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("an unneeded shard fetch failed: %r", task.exception())

    async def _gather(self, request: SnapshotRestore) -> bytes:
        """Pull shards from every holder at once and decode as soon as k check out: the
        shards held here and by peers already connected arrive first, and a slow dial to
        another holder (a new connection, an unreachable peer) holds nothing up."""
        o, n = request.open, len(request.holders)
        if len(request.shards) != n or not 1 <= request.k <= n:
            raise Refused(ErrorCode.REFUSED, "a restore names one shard hash per holder, k <= n")
        got: dict[int, bytes] = {}
        problems: list[str] = []

        async def fetch(i: int, holder: Holder) -> None:
            data = None
            if self.host is not None and holder.peer == self.host.peer_id:
                data = self.store.get(o.job, o.stage, request.step, i)
                if data is None:
                    problems.append(f"shard {i}: not here")
                    return
            else:
                try:
                    await self._dial(holder)
                    assert self.host is not None
                    reply = await self.host.request(
                        holder.peer,
                        SHARD,
                        ShardGet(job=o.job, stage=o.stage, step=request.step, index=i),
                        timeout=SHARD_TIMEOUT_S,
                    )
                    data = reply.data
                except (ShardError, RemoteError, P2PError) as exc:
                    problems.append(f"shard {i} on {holder.peer[:12]}: {exc}")
                    return
            if await asyncio.to_thread(sha256, data) != request.shards[i]:
                problems.append(f"shard {i} on {holder.peer[:12]}: wrong SHA-256")
                return
            got[i] = data

        pending = {asyncio.ensure_future(fetch(i, h)) for i, h in enumerate(request.holders)}
        try:
            while pending and len(got) < request.k:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # fetch reports failures in `problems`; anything else: a bug
        except BaseException:
            for task in pending:  # the restore itself failed or was cancelled
                task.cancel()
            raise
        for task in pending:  # not needed: they finish in the background, shards unused
            self.stragglers.add(task)
            task.add_done_callback(self._straggler_done)
        usable = dict(got)  # a copy: fetches left running may still add to `got`
        if len(usable) < request.k:
            raise Refused(
                ErrorCode.NOT_FOUND,
                f"cannot rebuild {o.stage} at step {request.step}: {len(usable)} of the "
                f"{request.k} shards needed are reachable ({'; '.join(problems)})",
            )
        try:
            data = await asyncio.to_thread(decode, usable, request.k, n, request.size)
        except ShardError as exc:
            raise Refused(ErrorCode.REFUSED, f"cannot decode the shards: {exc}") from None
        if await asyncio.to_thread(sha256, data) != request.sha256:
            raise Refused(ErrorCode.REFUSED, "the rebuilt state does not match its SHA-256")
        return data


def _arrays(tensors: dict[str, Tensor]) -> dict[str, Array]:
    try:
        return {k: t.to_numpy() for k, t in tensors.items()}
    except ValueError as exc:
        raise Refused(ErrorCode.REFUSED, f"bad tensor: {exc}") from None


def torch_threads() -> None:
    """Training on a shared machine: as many torch threads as FUSIONAI_THREADS, if set."""
    threads = os.environ.get("FUSIONAI_THREADS")
    if threads and threads.isdigit():
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
