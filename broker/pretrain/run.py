"""A train job through the swarm: K providers each hold a whole replica
(`provider/pretraining.py`), take their shares of each step's global batch and all-reduce
their gradients with one another over the p2p layer; the broker sends only rows and the ring,
and hears only each replica's loss and bytes.

Two-phase steps: every replica prepares step s (its gradient, all-reduced, held); once all
have, the step is recorded in SQLite (its loss, tokens, seconds, the replicas that took part)
and then committed on each. When a replica fails or is lost mid-step, the others abort it and
are back where they were; the step is redone without the lost one, so no step is counted twice
or skipped. Between steps, the ring is filled back to K: a provider joining reads the weights,
AdamW's state and the compressor's warm start from a replica (peer to peer) and takes part in
the next step. A broker that restarts finds its replicas again (opening a run that a provider
holds answers where it stands): a step recorded but not yet committed is committed, one
prepared but not recorded is aborted and redone. A step's rows depend on (seed, step) alone,
and the global batch and learning-rate schedule do not depend on K.

At the end the trained weights are read from one replica and become a model of this broker,
ready to serve. A job whose replicas are all lost fails (there is no checkpoint to go back to).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from broker.core.events import JobProgressed
from broker.jobkinds import JobFailed
from broker.pretrain.export import export_model
from broker.pretrain.request import RECORD, VAL_ROWS, corpus_of, parse
from ir.pretrain import shard
from p2p import P2PError, Tensor
from proto.pretrain import (
    PRETRAIN,
    PretrainAbort,
    PretrainAdmit,
    PretrainClose,
    PretrainCommit,
    PretrainEval,
    PretrainLoss,
    PretrainOpen,
    PretrainReady,
    PretrainSettings,
    PretrainStep,
    PretrainStepped,
    StageFile,
)
from proto.snapshot import Holder

if TYPE_CHECKING:
    from broker.pretrain.kind import TrainJobs
    from broker.schema import JobRow

Array = np.ndarray[Any, Any]
OPEN_TIMEOUT_S = 600.0  # fetching the stage files and building the replica
STEP_TIMEOUT_S = 900.0
CALL_TIMEOUT_S = 60.0
MAX_FAILED_ATTEMPTS = 3  # of one step with every replica still there


class SwarmPretrain:
    def __init__(self, kind: TrainJobs, job: JobRow) -> None:
        self.kind, self.job = kind, job
        self.request = parse(job)
        self.model = kind.models.models[job.model]
        self.registry = kind.serving.registry
        self.host = kind.calls.host
        self.events = kind.events
        self.store = kind.store
        self.members: list[str] = []  # the ring, in order: replicas at step `done`
        self.done = 0  # steps recorded (and committed on every member)
        self.avoid: set[str] = set()  # providers that failed this job
        self.touched: set[str] = set()

    # ---- calls -----------------------------------------------------------------------------

    async def _call(self, peer: str, message: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.touched.add(peer)
        return await self.host.request(peer, PRETRAIN, message, timeout=timeout)

    def _holder(self, peer: str) -> Holder:
        profile = self.registry.profiles.get(peer)
        return Holder(peer=peer, addrs=list(profile.addrs) if profile is not None else [])

    def _open(self, peer: str, donor: str | None = None) -> PretrainOpen:
        r, links = self.request, self.kind.serving.artifacts
        files = [
            StageFile(
                index=s.index,
                sha256=s.sha256,
                size=s.size_bytes,
                url=links.url(s.sha256, peer, s.size_bytes),
            )
            for s in self.model.manifest.stages
        ]
        settings = PretrainSettings(
            lr=r.lr,
            warmup=r.warmup,
            total_steps=r.steps,
            weight_decay=r.weight_decay,
            compress=r.compress,
            rank=r.rank,
            outer_every=r.outer_every,
            start_after=r.start_after,
            seed=r.seed,
        )
        return PretrainOpen(
            job=self.job.id,
            manifest=self.model.manifest_bytes,
            files=files,
            settings=settings,
            tls_sha256=links.tls_sha256(),
            donor=self._holder(donor) if donor else None,
        )

    # ---- the run ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            self.corpus = await asyncio.to_thread(corpus_of, self.model, self.request)
        except ValueError as exc:  # (checked at submission; the model may have changed since)
            raise JobFailed(str(exc)) from None
        self.store.set_job_state(self.job.id, "running")
        try:
            await self._train()
        except asyncio.CancelledError:
            # cancelled: keep the weights trained so far, close the replicas; the broker
            # stopping: keep them, to resume
            row = self.store.job(self.job.id, full=False)
            if row is None or row.state not in ("placed", "running"):
                await asyncio.shield(self._stop_cancelled())
            raise
        except BaseException:
            await asyncio.shield(self._close())
            raise
        await self._close()

    async def _train(self) -> None:
        r = self.request
        self.done = self.store.count_done(self.job.id)
        await self._gather()
        self.events.emit(
            "train_started",
            job=self.job.id,
            replicas=list(self.members),
            step=self.done,
            tokens=self.corpus.tokens,
            compress=r.compress,
        )
        while self.done < r.steps:
            await self._fill()
            await self._step(self.done + 1)
        await self._export()

    async def _gather(self) -> None:
        """The replicas at step `done`: the last step's replicas found again (after a restart),
        each brought to `done`, then more to make K."""
        last = self.store.train_replicas(self.job.id) if self.done else []
        found = [p for p in last if self.registry.alive(p)]
        answers = await asyncio.gather(
            *(self._call(p, self._open(p), OPEN_TIMEOUT_S) for p in found), return_exceptions=True
        )
        for peer, ready in zip(found, answers, strict=True):
            if not isinstance(ready, PretrainReady):
                self._drop(peer, f"cannot open: {ready}")
                continue
            try:
                if ready.prepared == self.done and ready.step == self.done - 1:
                    await self._call(peer, PretrainCommit(job=self.job.id, step=self.done))
                elif ready.prepared:
                    await self._call(peer, PretrainAbort(job=self.job.id, step=ready.prepared))
                elif ready.step != self.done:
                    await self._call(peer, PretrainClose(job=self.job.id))  # joins afresh
                    continue
            except P2PError as exc:
                self._drop(peer, str(exc))
                continue
            self.members.append(peer)
        if self.done and not self.members:
            raise JobFailed(
                f"every replica that held step {self.done} is gone; a train job has no "
                "checkpoint to go back to"
            )
        await self._fill()
        if not self.members:
            raise JobFailed("no provider could open a replica")

    async def _fill(self) -> None:
        """Bring the ring back to K replicas with providers not yet in it (each reads the
        running state from a member, or starts from the package at step 0)."""
        want = self.request.replicas - len(self.members)
        for peer in [p for p in self.kind.providers() if p not in self.members]:
            if want <= 0:
                return
            if peer in self.avoid:
                continue
            donor = self.members[0] if self.done and self.members else None
            # every member admits it: the donor lets it read the state, and all take its ring
            # chunks, which may come before their own step does (a member lost meanwhile is
            # found at the next step)
            admit = PretrainAdmit(job=self.job.id, peer=peer)
            admitted = await asyncio.gather(
                *(self._call(m, admit) for m in self.members), return_exceptions=True
            )
            failed = dict(zip(self.members, admitted, strict=True)).get(donor or "")
            if isinstance(failed, BaseException) and donor is not None:
                self._drop(donor, f"lost while admitting a joiner: {failed}")
                await self._fill()  # with another donor
                return
            try:
                ready = await self._call(peer, self._open(peer, donor), OPEN_TIMEOUT_S)
            except P2PError as exc:
                self._drop(peer, f"could not join: {exc}")
                continue
            if ready.prepared and ready.step == self.done:  # (from before a broker restart)
                abort = PretrainAbort(job=self.job.id, step=self.done + 1)
                try:
                    ready = await self._call(peer, abort, STEP_TIMEOUT_S)
                except P2PError as exc:
                    self._drop(peer, f"could not join: {exc}")
                    continue
            if ready.step != self.done or ready.prepared:
                self._drop(peer, f"joined at step {ready.step}, not {self.done}")
                await self._quiet_close(peer)
                continue
            self.members.append(peer)
            want -= 1
            self.events.emit(
                "train_replica_joined", job=self.job.id, peer=peer, step=self.done, donor=donor
            )

    def _drop(self, peer: str, reason: str) -> None:
        self.avoid.add(peer)
        if peer in self.members:
            self.members.remove(peer)
        self.events.emit("train_replica_dropped", job=self.job.id, peer=peer, reason=reason[:300])

    async def _step(self, step: int) -> None:
        r = self.request
        rows = self.corpus.batch(step, r.batch)
        attempt, failed_with_all = 0, 0
        while True:
            if not self.members:
                raise JobFailed(f"every replica was lost at step {step}")
            ring = [self._holder(p) for p in self.members]
            started = time.perf_counter()
            results = await self._prepare(step, attempt, rows, ring)
            bad = {p: e for p, e in results.items() if not isinstance(e, PretrainStepped)}
            if not bad:
                break
            before = list(self.members)
            await self._abort(step, bad)
            if self.members == before:
                failed_with_all += 1
                if failed_with_all >= MAX_FAILED_ATTEMPTS:
                    peer, exc = next(iter(bad.items()))
                    raise JobFailed(f"step {step} failed {failed_with_all} times: {exc}")
            attempt += 1
            await self._fill()
        stepped = [results[p] for p in self.members]
        loss = float(sum(s.loss for s in stepped))
        if not math.isfinite(loss):
            await self._abort(step, {})
            raise JobFailed(f"the loss diverged ({loss}) at step {step}; try a lower lr")
        seconds = time.perf_counter() - started  # (the step's prepare: validation apart)
        tokens = r.batch * r.seq_len
        sent = max(s.bytes_sent for s in stepped)
        record = np.array([loss, tokens, seconds, len(stepped), sent, math.nan], np.float64)
        assert record.size == RECORD
        self.store.put_train_step(
            self.job.id, step, attempt + 1, record.tobytes(), list(self.members)
        )
        self.done = step
        commits = await asyncio.gather(
            *(self._call(p, PretrainCommit(job=self.job.id, step=step)) for p in self.members),
            return_exceptions=True,
        )
        for peer, c in zip(list(self.members), commits, strict=True):
            if not isinstance(c, PretrainReady):
                self._drop(peer, f"commit failed: {c}")
        val = await self._validate(step)  # (the weights after the step)
        if not math.isnan(val):
            record[5] = val
            self.store.put_train_step(
                self.job.id, step, attempt + 1, record.tobytes(), list(self.members)
            )
        self.events.emit(
            "train_step",
            job=self.job.id,
            step=step,
            loss=round(loss, 6),
            val_loss=None if math.isnan(val) else round(val, 6),
            tokens_s=round(tokens / max(seconds, 1e-9), 1),
            bytes_sent=sent,
            replicas=len(stepped),
            attempts=attempt + 1,
        )
        driver = self.kind.serving.driver
        driver.handle(JobProgressed(self.job.id, step / r.steps, self.kind.serving.clock()))

    async def _prepare(
        self, step: int, attempt: int, rows: Array, ring: list[Holder]
    ) -> dict[str, Any]:
        """Every member's answer to the step (or its error); the first failure, or a member
        declared lost, aborts the others at once instead of waiting for their timeouts."""
        size = len(ring)
        calls = {
            p: asyncio.create_task(
                self._call(
                    p,
                    PretrainStep(
                        job=self.job.id,
                        step=step,
                        attempt=attempt,
                        rows=Tensor.from_numpy(np.ascontiguousarray(shard(rows, i, size))),
                        total_rows=len(rows),
                        ring=ring,
                        rank=i,
                    ),
                    STEP_TIMEOUT_S,
                )
            )
            for i, p in enumerate(self.members)
        }
        lost = {asyncio.create_task(self.registry.lost_event(p).wait()): p for p in self.members}
        results: dict[str, Any] = {}
        pending = set(calls.values())
        try:
            while pending:
                done, _ = await asyncio.wait(
                    pending | set(lost), return_when=asyncio.FIRST_COMPLETED
                )
                for t in done:
                    if t in lost:
                        results[lost.pop(t)] = JobFailed("declared lost")
                    else:
                        pending.discard(t)
                if any(c.done() and (c.exception() is not None) for c in calls.values()) or any(
                    isinstance(v, JobFailed) for v in results.values()
                ):
                    break
        finally:
            for t in lost:
                t.cancel()
        if pending:  # a failure: wake the others' steps (they answer with an error)
            await self._abort_calls(step, [p for p, c in calls.items() if not c.done()])
            await asyncio.wait(pending, timeout=CALL_TIMEOUT_S)
        for p, c in calls.items():
            if p in results:
                continue
            if not c.done():
                c.cancel()
                results[p] = TimeoutError("no answer after the step was aborted")
            else:
                results[p] = c.exception() or c.result()
        return results

    async def _abort_calls(self, step: int, peers: list[str]) -> dict[str, Any]:
        """(An abort waits for the step's computing under way: as long as a step may take.)"""
        abort = PretrainAbort(job=self.job.id, step=step)
        answers = await asyncio.gather(
            *(self._call(p, abort, STEP_TIMEOUT_S) for p in peers), return_exceptions=True
        )
        return dict(zip(peers, answers, strict=True))

    async def _abort(self, step: int, bad: dict[str, Any]) -> None:
        """Every member back to the last step; those that cannot answer (or were declared
        lost) leave the ring."""
        answers = await self._abort_calls(step, list(self.members))
        for peer, answer in answers.items():
            lost = isinstance(bad.get(peer), JobFailed) or not self.registry.alive(peer)
            if lost or not isinstance(answer, PretrainReady) or answer.step != self.done:
                self._drop(peer, f"lost at step {step}: {bad.get(peer) or answer}")
        self.events.emit(
            "train_step_redone",
            job=self.job.id,
            step=step,
            errors={p[:12]: str(e)[:200] for p, e in bad.items()},
            replicas=len(self.members),
        )

    async def _validate(self, step: int) -> float:
        r = self.request
        every = r.eval_every or max(1, r.steps // 10)
        if step % every and step != r.steps:
            return math.nan
        if not self.members:
            return math.nan
        rows = self.corpus.val[:VAL_ROWS]
        message = PretrainEval(job=self.job.id, rows=Tensor.from_numpy(rows))
        try:
            got: PretrainLoss = await self._call(self.members[0], message, STEP_TIMEOUT_S)
        except P2PError:
            return math.nan  # (the step goes on; the replica's loss shows at the next step)
        return float(got.loss)

    async def _export(self) -> None:
        """The trained weights, read from a replica, as a model of this broker."""
        stored = await export_model(self)
        self.events.emit("train_saved", job=self.job.id, model=stored.name, step=self.done)

    async def _stop_cancelled(self) -> None:
        """A cancelled job's weights at its last step become a model, then its replicas go."""
        try:
            if self.done and self.members:
                # the step recorded last is committed on every replica (cancelled between
                # its record and its commit, a replica still holds it prepared), then a step
                # under way is dropped
                committed = await asyncio.gather(
                    *(self._call(p, PretrainCommit(job=self.job.id, step=self.done))
                      for p in self.members),
                    return_exceptions=True,
                )  # fmt: skip
                for peer, c in zip(list(self.members), committed, strict=True):
                    if not isinstance(c, PretrainReady):
                        self._drop(peer, f"commit failed: {c}")
                await self._abort_calls(self.done + 1, list(self.members))
                await self._export()
        except Exception as exc:  # (best effort: the job is cancelled either way)
            self.events.emit("train_not_saved", job=self.job.id, reason=str(exc)[:300])
        await self._close()

    async def _quiet_close(self, peer: str) -> None:
        try:
            await self._call(peer, PretrainClose(job=self.job.id), 5.0)
        except P2PError:
            pass

    async def _close(self) -> None:
        """The job's replicas are dropped everywhere (best effort)."""
        peers = [p for p in self.touched if self.registry.alive(p)]
        await asyncio.gather(*(self._quiet_close(p) for p in peers), return_exceptions=True)
