"""Pre-training replicas on this provider (`proto.pretrain`): a whole package, every weight
trainable (`ir.pretrain.DataParallel`), its gradients all-reduced with the other replicas over
the p2p layer, peer to peer (`dag.collective.ring_allreduce` on `RingLinks`).

A step is two-phase: the replica computes, all-reduces and holds the update until the broker
commits it, or drops it when the broker aborts the step (a replica was lost mid-step: every
survivor goes back to where it was, and the step is redone without the lost one). Aborting
wakes a step waiting on a lost neighbour at once; a neighbour silent for `RING_TIMEOUT_S`
fails the step by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dag.collective import CollectiveError, ring_allreduce
from files.cache import ArtifactError
from ir.compress import CompressionError, check_compressor, make_compressor
from ir.errors import IRError
from p2p import ErrorCode, Host, P2PError, Refused, Tensor
from proto.pretrain import (
    MAX_PART_BYTES,
    MAX_REPLICAS,
    PRETRAIN,
    RING,
    PretrainAbort,
    PretrainAdmit,
    PretrainClose,
    PretrainClosed,
    PretrainCommit,
    PretrainEval,
    PretrainFetch,
    PretrainLoss,
    PretrainOpen,
    PretrainPart,
    PretrainReady,
    PretrainStep,
    PretrainStepped,
    RingAck,
    RingChunk,
)
from proto.snapshot import Holder
from provider.ring import ATTEMPTS, CALLS, RingLinks, dial, round_base, split_parts

Array = np.ndarray[Any, Any]
Fetch = Callable[[str, str, int, str], Awaitable[Path]]  # (sha, url, size, tls pin) -> file
MAX_RUNS = 2  # pre-training replicas one provider holds at once
BYTES_PER_WEIGHT_BYTE = 5  # weights, gradient, AdamW's two moments, the compressor's buffers


@dataclass
class _Run:
    dp: Any  # ir.pretrain.DataParallel
    links: RingLinks
    members: set[str] = field(default_factory=set)  # the ring's replicas: may send chunks
    admitted: set[str] = field(default_factory=set)  # peers the broker let read the state
    task: asyncio.Task[float] | None = None  # the step being prepared
    export: dict[tuple[int, bool], list[dict[str, Array]]] = field(default_factory=dict)
    vocab: int = 0


class Pretraining:
    """The pre-training replicas this provider holds, and its side of their rings."""

    def __init__(self, broker_id: str, fetch: Fetch, memory_budget: Callable[[], int]) -> None:
        self.broker_id = broker_id
        self.fetch = fetch
        self.memory_budget = memory_budget
        self.host: Host | None = None
        self.runs: dict[str, _Run] = {}
        self.opening: dict[str, asyncio.Task[_Run]] = {}

    def attach(self, host: Host) -> None:
        self.host = host
        host.add_control_handler(PRETRAIN, self.handle)
        host.add_control_handler(RING, self.ring)

    def _run(self, job: str) -> _Run:
        run = self.runs.get(job)
        if run is None:
            raise Refused(ErrorCode.NOT_FOUND, f"no pre-training replica of job {job} here")
        return run

    # ---- the ring (provider -> provider) ---------------------------------------------------

    async def ring(self, peer: str, chunk: RingChunk) -> RingAck:
        run = self._run(chunk.job)
        if peer not in run.members and peer not in run.admitted:
            raise Refused(ErrorCode.REFUSED, "only the run's replicas send ring chunks here")
        if chunk.phase not in (0, 1) or not 0 <= chunk.chunk < MAX_REPLICAS:
            raise Refused(ErrorCode.REFUSED, "a ring chunk's phase is 0 or 1, its index < 64")
        if chunk.data.dtype not in ("float32", "float16") or len(chunk.data.shape) != 1:
            raise Refused(ErrorCode.REFUSED, "a ring chunk is a float32 or float16 vector")
        if chunk.data.shape[0] > run.dp.replica.parameters:  # (no buffer is longer)
            raise Refused(ErrorCode.REFUSED, "a ring chunk longer than the model")
        try:
            data = chunk.data.to_numpy()
        except ValueError as exc:
            raise Refused(ErrorCode.REFUSED, f"bad ring chunk: {exc}") from None
        run.links.put((chunk.round, chunk.phase, chunk.chunk), data)
        return RingAck()

    # ---- the broker's requests -------------------------------------------------------------

    async def handle(self, peer: str, request: Any) -> Any:
        if isinstance(request, PretrainFetch):
            run = self._run(request.job)
            if peer != self.broker_id and peer not in run.admitted:
                raise Refused(ErrorCode.REFUSED, "the broker has not let this peer read the run")
            return await self._part(run, request)
        if peer != self.broker_id:
            raise Refused(ErrorCode.REFUSED, "only this provider's broker may run pre-training")
        if isinstance(request, PretrainOpen):
            run = await self._open(request)
            return self._ready(request.job, run)
        if isinstance(request, PretrainClose):
            run_ = self.runs.pop(request.job, None)
            if run_ is not None:
                await self._stop(run_, "the run was closed")
            return PretrainClosed(job=request.job)
        run = self._run(request.job)
        if isinstance(request, PretrainStep):
            return await self._step(run, request)
        if isinstance(request, PretrainCommit):
            return await self._commit(run, request)
        if isinstance(request, PretrainAbort):
            await self._stop(run, f"step {request.step} was aborted by the broker")
            return self._ready(request.job, run)
        if isinstance(request, PretrainAdmit):
            run.admitted.add(request.peer)
            return self._ready(request.job, run)
        assert isinstance(request, PretrainEval)
        rows = self._rows(run, request.rows)
        loss = await asyncio.to_thread(run.dp.replica.evaluate, rows)
        return PretrainLoss(loss=float(loss))

    def _ready(self, job: str, run: _Run) -> PretrainReady:
        dp = run.dp
        return PretrainReady(
            job=job, step=dp.committed, prepared=dp.prepared, parameters=dp.replica.parameters
        )

    async def _open(self, request: PretrainOpen) -> _Run:
        run = self.runs.get(request.job)
        if run is not None:  # the broker lost track (it restarted): a step under way ends,
            task = run.task  # what it prepared stays, for the broker to commit or abort
            if task is not None:
                run.links.fail("the broker opened the run again")
                await asyncio.gather(task, return_exceptions=True)
            run.links.boxes.clear()  # (its attempts count from 0 again)
            return run
        opening = self.opening.get(request.job)
        if opening is None:
            if len(self.runs) + len(self.opening) >= MAX_RUNS:
                raise Refused(ErrorCode.BUSY, f"{MAX_RUNS} pre-training replicas are here already")
            opening = self.opening[request.job] = asyncio.create_task(self._build(request))
        try:
            built = await asyncio.shield(opening)
        finally:
            if opening.done():
                self.opening.pop(request.job, None)
        self.runs[request.job] = built
        return built

    async def _build(self, request: PretrainOpen) -> _Run:
        from ir.manifest import ModelManifest

        s = request.settings
        try:
            check_compressor(s.compress, s.rank)
            manifest = ModelManifest.from_json(request.manifest)
        except (CompressionError, IRError) as exc:
            raise Refused(ErrorCode.REFUSED, str(exc)) from None
        if not (0 < s.lr < 10 and 0 <= s.weight_decay < 1 and s.warmup >= 0):
            raise Refused(ErrorCode.REFUSED, "lr must be in (0, 10), weight_decay in [0, 1)")
        if s.outer_every < 0 or s.start_after < 0 or s.total_steps < 1:
            raise Refused(ErrorCode.REFUSED, "outer_every and start_after are 0 or more")
        files = {f.sha256: f for f in request.files}
        needed = sum(info.size_bytes for info in manifest.stages)
        if needed * BYTES_PER_WEIGHT_BYTE > self.memory_budget():
            raise Refused(
                ErrorCode.REFUSED,
                f"a replica needs about {needed * BYTES_PER_WEIGHT_BYTE >> 20} MiB; this "
                f"provider gives {self.memory_budget() >> 20} MiB",
            )
        paths = {}
        for info in manifest.stages:
            f = files.get(info.sha256)
            if f is None or f.index != info.index or f.size != info.size_bytes:
                raise Refused(ErrorCode.REFUSED, f"no file for stage {info.index}")
            try:
                paths[info.index] = await self.fetch(f.sha256, f.url, f.size, request.tls_sha256)
            except (ArtifactError, OSError, ValueError) as exc:
                raise Refused(ErrorCode.REFUSED, f"stage {info.index}: {exc}") from None
        try:
            dp = await asyncio.to_thread(_replica, manifest, paths, s)
        except (IRError, CompressionError, ImportError) as exc:
            raise Refused(ErrorCode.REFUSED, f"cannot build a replica: {exc}") from None
        assert self.host is not None
        run = _Run(dp, RingLinks(self.host, request.job), vocab=_vocab(manifest))
        if request.donor is not None:
            await self._take(run, request.job, request.donor)
        return run

    async def _take(self, run: _Run, job: str, donor: Holder) -> None:
        """The running state, read part by part from a replica that has it."""
        from ir.pretrain_state import load_state

        assert self.host is not None
        try:
            await dial(self.host, donor)
        except CollectiveError as exc:
            raise Refused(ErrorCode.REFUSED, f"cannot reach the donor: {exc}") from None
        state: dict[str, Array] = {}
        part, parts, step = 0, 1, -1
        while part < parts:
            try:
                got = await self.host.request(
                    donor.peer, PRETRAIN, PretrainFetch(job=job, part=part), timeout=120.0
                )
            except P2PError as exc:
                raise Refused(ErrorCode.REFUSED, f"cannot read the state: {exc}") from None
            if not isinstance(got, PretrainPart) or (step >= 0 and got.step != step):
                raise Refused(ErrorCode.REFUSED, "the donor's state changed while being read")
            step, parts = got.step, got.parts
            state.update({k: t.to_numpy() for k, t in got.tensors.items()})
            part += 1
        try:
            await asyncio.to_thread(load_state, run.dp, state)
        except (IRError, CompressionError, ValueError) as exc:
            raise Refused(ErrorCode.REFUSED, f"the donor's state does not fit: {exc}") from None

    async def _part(self, run: _Run, request: PretrainFetch) -> PretrainPart:
        from ir.pretrain_state import export_state

        if run.task is not None or run.dp.pending is not None:
            raise Refused(ErrorCode.BUSY, "a step is under way; read the state between steps")
        key = (run.dp.committed, request.weights_only)
        parts = run.export.get(key)
        if parts is None:
            run.export.clear()
            state = await asyncio.to_thread(export_state, run.dp, weights_only=request.weights_only)
            parts = run.export[key] = split_parts(state, MAX_PART_BYTES)
        if not 0 <= request.part < len(parts):
            raise Refused(ErrorCode.REFUSED, f"part {request.part} of {len(parts)}")
        tensors = {k: Tensor.from_numpy(v) for k, v in parts[request.part].items()}
        return PretrainPart(step=key[0], part=request.part, parts=len(parts), tensors=tensors)

    def _rows(self, run: _Run, rows: Tensor) -> Array:
        try:
            out = rows.to_numpy()
        except ValueError as exc:
            raise Refused(ErrorCode.REFUSED, f"bad rows: {exc}") from None
        if out.dtype != np.int64 or out.ndim != 2 or out.shape[1] < 2:
            raise Refused(ErrorCode.REFUSED, "rows are int64 (rows, sequence + 1)")
        if out.size and (out.min() < 0 or (run.vocab and out.max() >= run.vocab)):
            raise Refused(ErrorCode.REFUSED, f"token ids must be from 0 to {run.vocab - 1}")
        return out

    async def _step(self, run: _Run, request: PretrainStep) -> PretrainStepped:
        assert self.host is not None
        dp, me = run.dp, self.host.peer_id
        ring = request.ring
        if run.task is not None:
            raise Refused(ErrorCode.BUSY, "a step is under way here")
        if dp.pending is not None and dp.prepared == request.step:
            await asyncio.to_thread(dp.abort)  # an earlier attempt of this step
        if request.step != dp.committed + 1 or dp.pending is not None:
            raise Refused(ErrorCode.REFUSED, f"this replica is at step {dp.committed}")
        peers = [h.peer for h in ring]
        if not (
            1 <= len(ring) <= MAX_REPLICAS
            and 0 <= request.rank < len(ring)
            and peers[request.rank] == me
            and len(set(peers)) == len(peers)
            and 0 <= request.attempt < ATTEMPTS
        ):
            raise Refused(ErrorCode.REFUSED, "a ring of distinct replicas with this one at rank")
        rows = self._rows(run, request.rows)
        if not len(rows) <= request.total_rows <= 1 << 20:
            raise Refused(ErrorCode.REFUSED, "total_rows must be at least this replica's rows")
        run.members = set(peers)
        run.export.clear()
        dp.rank, dp.size = request.rank, len(ring)
        base = round_base(request.step, request.attempt)
        nxt = ring[(request.rank + 1) % len(ring)]
        run.links.reset(base, nxt.peer)
        if len(ring) > 1:
            try:
                await dial(self.host, nxt)
            except CollectiveError as exc:
                raise Refused(ErrorCode.REFUSED, f"step {request.step}: {exc}") from None
        calls, reducing = 0, 0.0

        async def allreduce(buffer: Array, wire: str) -> Array:
            nonlocal calls, reducing
            calls += 1
            if calls >= CALLS:
                raise CollectiveError(f"more than {CALLS - 1} all-reduces in one step")
            began = time.perf_counter()
            try:
                return await ring_allreduce(
                    buffer, request.rank, len(ring), run.links, base + calls, wire
                )
            finally:
                reducing += time.perf_counter() - began

        sent, started = run.links.sent, time.perf_counter()
        run.task = asyncio.create_task(
            dp.prepare(rows, request.total_rows, rows.shape[1] - 1, allreduce)
        )
        run.task.add_done_callback(_retrieved)  # (its error is answered, or nobody's to hear)
        try:
            loss = await asyncio.shield(run.task)
        except CollectiveError as exc:
            raise Refused(ErrorCode.REFUSED, f"step {request.step}: {exc}") from None
        except (IRError, ValueError, IndexError, RuntimeError) as exc:
            raise Refused(ErrorCode.REFUSED, f"step {request.step} failed: {exc}") from None
        finally:
            if run.task.done():
                run.task = None
        seconds = time.perf_counter() - started
        return PretrainStepped(
            step=request.step,
            loss=float(loss),
            bytes_sent=run.links.sent - sent,
            compute_ms=(seconds - reducing) * 1e3,
            reduce_ms=reducing * 1e3,
        )

    async def _commit(self, run: _Run, request: PretrainCommit) -> PretrainReady:
        dp = run.dp
        if dp.pending is not None and request.step == dp.prepared:
            await asyncio.to_thread(dp.commit)
        elif request.step != dp.committed:  # (committed already: said again, the same)
            raise Refused(ErrorCode.REFUSED, f"step {request.step} is not prepared here")
        return self._ready(request.job, run)

    async def _stop(self, run: _Run, reason: str) -> None:
        """Wake and finish the step under way (if any), then drop what it prepared."""
        run.links.fail(reason)
        task = run.task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(run.dp.abort)


def _replica(manifest: Any, paths: dict[int, Path], s: Any) -> Any:
    """A replica of the package whose stage files are at `paths` (validated here)."""
    from ir.package import Package, check_stage_file
    from ir.pretrain import DataParallel, Replica
    from ir.validate import validate_onnx_file
    from provider.training import torch_threads

    torch_threads()
    models = {}
    for info in manifest.stages:
        path = paths[info.index]
        model = validate_onnx_file(
            path, sha256=info.sha256, package_dir=path.parent, weight_dtype=info.weight_dtype
        )
        check_stage_file(info, model, path)
        models[info.index] = model
    directory = next(iter(paths.values())).parent
    replica = Replica(
        Package(directory, manifest, models),
        lr=s.lr,
        warmup=s.warmup,
        total_steps=s.total_steps,
        weight_decay=s.weight_decay,
    )
    compressor = make_compressor(s.compress, replica.shapes(), replicas=1, rank=s.rank, seed=s.seed)
    return DataParallel(
        replica, compressor, 0, 1, outer_every=s.outer_every, start_after=s.start_after
    )


def _retrieved(task: asyncio.Task[float]) -> None:
    if not task.cancelled():
        task.exception()


def _vocab(manifest: Any) -> int:
    vocab = manifest.config.get("vocab_size")
    return vocab if isinstance(vocab, int) and vocab > 0 else 0
