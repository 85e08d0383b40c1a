"""Fine-tune jobs through the swarm: LoRA-FA (or LoRA) training of a decoder through the
swarm's stages.

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
import math
import time
from typing import Any

import networkx as nx
import numpy as np

from broker.finetune.remote import StageFailed, SwarmStages
from broker.finetune.request import Data, finetune_graph
from broker.finetune.step import adapter_file, head_loss, run_step
from broker.jobkinds import JobError, JobFailed
from client.stages import ClientStages
from ir.training import (
    HeadLoss,
)
from p2p import P2PError
from proto.snapshot import SNAPSHOT, Holder, SnapshotRestore, SnapshotTake, SnapshotTaken
from proto.train import (
    TRAIN,
    TrainClose,
    TrainExport,
    TrainState,
)

Array = np.ndarray[Any, Any]
MAX_RECOVERIES = 10  # provider losses one job survives


class SwarmFinetune(SwarmStages):
    """Runs one fine-tune job through the swarm for the job runner: start, snapshots,
    recovery from lost providers, the adapter at the end."""

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
        return [Holder(peer=p, addrs=self.serving.peer_info(p).addrs) for p in chosen]

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
        client = await asyncio.to_thread(self.kind.models.client, self.job.model)
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
            if not math.isfinite(loss):
                raise JobFailed(
                    f"the training loss diverged ({loss}) at step {step}; try a lower lr "
                    f"(it was {r.lr:g})"
                )
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
        await asyncio.to_thread(self.kind.save_adapter, self.job.id, self.job.model, data)

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
