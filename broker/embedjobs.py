"""Embedding jobs: N texts (or token id lists) through an encoder, cut into microbatches.

Each microbatch runs the job's graph (`dag.execute`): the client-side tasks (load, embed,
head) through the model's client stages here, the FORWARD tasks on providers serving those
stages (`broker/calls.py`): consecutive ones as one chained request, unless a stage is due a
spot check (it then runs on its own, and `broker/verify.py` checks the answer) or `relay` is
"star". Several microbatches are in the pipeline at once. A microbatch that fails (provider
lost, stalled, busy, refused) is retried on another route, up to `max_attempts`; results are
stored per microbatch as they arrive, so a broker restarted mid-job only redoes what was in
flight. The HTTP gateway's /v1/embeddings runs the same way, neither queued nor stored
(`embed_now`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import networkx as nx
import numpy as np

from broker.calls import Array, CallFailed, StageCalls
from broker.chaincheck import ChainChecks
from broker.config import BrokerConfig
from broker.core.events import JobProgressed
from broker.core.microbatch import Cut, cut
from broker.driver import CoreDriver
from broker.embedrequest import LARGEST, parse_request
from broker.errors import NotFound, Unavailable
from broker.events import EventLog
from broker.jobkinds import JobError, JobFailed, NotReady, Prepared, Ref
from broker.models import ModelStore
from broker.schema import JobRow
from broker.serving import Serving
from broker.store import Store
from broker.verify import Verifier
from client.stages import ClientStageError, ClientStages
from dag.builders import inference_pipeline
from dag.execute import Unit, execute
from dag.tasks import TaskKind, task
from dag.validate import DagError
from dag.wire import from_json, to_json
from proto.api.jobs import EmbedJobRequest, EmbedResults
from proto.forward import HopDone

log = logging.getLogger("fusionai.broker")


class EmbedJobs:
    """The "embed" job kind."""

    name = "embed"
    request = EmbedJobRequest

    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        events: EventLog,
        driver: CoreDriver,
        serving: Serving,
        models: ModelStore,
        calls: StageCalls,
        verifier: Verifier,
        using: Callable[[str], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.config = config
        self.store = store
        self.events = events
        self.driver = driver
        self.serving = serving
        self.models = models
        self.calls = calls
        self.verifier = verifier
        self.chain_checks = ChainChecks(verifier, models, events)
        self.using = using  # an interactive request holds the model while it runs
        self.clock = serving.clock

    async def prepare(self, body: EmbedJobRequest) -> Prepared:
        """Check a submission (the heavy checks run off the event loop)."""
        request = parse_request(body, self.config)
        model = self.models.models.get(request.model)
        if model is None:
            raise NotFound(f"no model named {request.model!r}; add it first")
        client = await asyncio.to_thread(self.models.client, request.model)
        lengths = (
            [len(t) for t in request.token_ids]
            if request.token_ids is not None
            else [min(client.max_tokens, 2 + len(t.split())) for t in request.texts or []]
        )
        if request.token_ids is not None:
            try:
                await asyncio.to_thread(client.pad, request.token_ids)  # range, length checks
            except ClientStageError as exc:
                raise JobError("token_ids", str(exc)) from None
        elif client.tokenizer is None:
            raise JobError("texts", f"model {request.model} takes token_ids, not texts")
        mb = self._cut(request.model, request.count, request.microbatch).microbatch
        request = dataclasses.replace(request, microbatch=mb)  # (kept: a restart cuts alike)
        graph = self._graph(request.model, mb, max(lengths))
        microbatches = -(-request.count // mb)
        flops = sum(task(graph, n).flops for n in graph.nodes) * microbatches
        return Prepared(
            request.model,
            request.to_json(),
            to_json(graph),
            microbatches,
            flops,
            {"sequences": request.count, "microbatches": microbatches},
        )

    async def embed_now(
        self, model: str, texts: list[str] | None, token_ids: list[list[int]] | None
    ) -> tuple[Array, int]:
        """An interactive embedding request, run at once through the same graph and retries
        as a batch job but neither queued nor stored: (embeddings in input order, tokens)."""
        if model not in self.models.models:
            raise NotFound(f"no model named {model!r}")
        client = await asyncio.to_thread(self.models.client, model)
        if client.decoder:
            raise JobError("model", f"{model} is a decoder; embeddings come from encoder models")
        try:
            if texts is not None:
                ids, mask = await asyncio.to_thread(client.tokenize, texts)
            else:
                ids, mask = await asyncio.to_thread(client.pad, token_ids or [])
        except ClientStageError as exc:
            raise JobError("input", str(exc)) from None
        mb = self._cut(model, len(ids)).microbatch
        graph = self._graph(model, mb, ids.shape[1])
        ref = Ref("request-" + uuid.uuid4().hex[:12], model)
        parts: dict[int, Array] = {}

        def keep(idx: int, out: Array, attempts: int, peers: tuple[str, ...]) -> None:
            parts[idx] = out

        try:
            with self.using(model):
                todo = range(-(-len(ids) // mb))
                await self._microbatches(ref, graph, client, ids, mask, mb, todo, keep)
        except JobFailed as exc:
            raise Unavailable(str(exc)) from None
        return np.concatenate([parts[i] for i in sorted(parts)]), int(mask.sum())

    def _cut(self, model: str, sequences: int, microbatch: int | None = None) -> Cut:
        """How a job of `sequences` on `model` is cut (`microbatch`: as the job asked)."""
        cfg = self.config
        stages = len(self.models.models[model].units)
        star = cfg.relay == "star"
        sized = cut(sequences, stages, largest=LARGEST, in_flight=cfg.in_flight, star=star)
        if microbatch is None:
            microbatch = cfg.microbatch
        return sized if microbatch is None else dataclasses.replace(sized, microbatch=microbatch)

    def _graph(self, model: str, microbatch: int, seq: int) -> nx.DiGraph:
        """The job graph of one microbatch: client stages, then each provider stage."""
        units = len(self.models.models[model].units)
        pairs = [(i, i + 1) for i in range(units)]
        return inference_pipeline(self.serving.spec(model), pairs, batch=microbatch, seq=seq)

    async def run(self, job: JobRow) -> None:
        graph = from_json(job.graph)
        request = job.request
        client = await asyncio.to_thread(self.models.client, job.model)
        if "texts" in request:
            ids, mask = await asyncio.to_thread(client.tokenize, request["texts"])
        else:
            ids, mask = await asyncio.to_thread(client.pad, request["token_ids"])
        mb = int(request["microbatch"])
        done = self.store.done_microbatches(job.id)
        todo = [i for i in range(job.microbatches) if i not in done]
        self.store.set_job_state(job.id, "running")
        self.events.emit("job_running", job=job.id, todo=len(todo), done=len(done))
        step = max(1, job.microbatches // 10)

        def store(idx: int, out: Array, attempts: int, peers: tuple[str, ...]) -> None:
            self.store.put_result(job.id, idx, attempts, out.shape, out.tobytes(), peers)
            finished = self.store.count_done(job.id)
            if finished % step == 0 or finished == job.microbatches:
                self.events.emit("job_progress", job=job.id, done=finished, of=job.microbatches)
                self.driver.handle(JobProgressed(job.id, finished / job.microbatches, self.clock()))

        while todo:  # again while a quarantined provider's results were dropped meanwhile
            await self._microbatches(
                Ref(job.id, job.model), graph, client, ids, mask, mb, todo, store
            )
            done = self.store.done_microbatches(job.id)
            todo = [i for i in range(job.microbatches) if i not in done]

    async def _microbatches(
        self,
        ref: Ref,
        graph: nx.DiGraph,
        client: ClientStages,
        ids: Array,
        mask: Array,
        mb: int,
        todo: Iterable[int],
        done: Callable[[int, Array, int, tuple[str, ...]], None],
    ) -> None:
        """Run microbatches `todo` (rows of `mb` sequences), up to `in_flight` at once, each
        result handed to `done(index, output, attempts, providers that computed it)`. One
        failure cancels the others; the job's own failure (`JobFailed`) is raised first."""
        gate = asyncio.Semaphore(self._cut(ref.model, len(ids), mb).in_flight)

        async def one(idx: int) -> None:
            async with gate:
                rows = slice(idx * mb, (idx + 1) * mb)
                used = int(mask[rows].sum(axis=1).max())  # trim padding beyond this microbatch
                out, attempts, peers = await self._microbatch(
                    ref, graph, client, idx, ids[rows, :used], mask[rows, :used]
                )
                done(idx, out, attempts, peers)

        try:
            async with asyncio.TaskGroup() as group:
                for i in todo:
                    group.create_task(one(i))
        except ExceptionGroup as group:
            errors: list[BaseException] = list(group.exceptions)
            raise next((e for e in errors if isinstance(e, JobFailed)), errors[0]) from None

    async def _microbatch(
        self,
        job: Ref,
        graph: nx.DiGraph,
        client: ClientStages,
        idx: int,
        ids: Array,
        mask: Array,
    ) -> tuple[Array, int, tuple[str, ...]]:
        """Run one microbatch through the job graph; returns (result, attempts, providers)."""
        attempts = 0
        avoid: set[str] = set()
        busy_until: float | None = None
        while True:
            attempts += 1
            used: list[str] = []
            try:
                out = await self._walk(job, graph, client, ids, mask, avoid, used)
            except CallFailed as exc:
                avoid.add(exc.peer)
                if exc.busy and busy_until is None:
                    busy_until = self.clock() + self.config.request_timeout_s
                if exc.busy and busy_until is not None and self.clock() < busy_until:
                    attempts -= 1  # busy answers do not count, for up to a request timeout
                    continue
                if attempts >= self.config.max_attempts:
                    raise JobFailed(
                        f"microbatch {idx} failed {attempts} times; last: {exc}"
                    ) from None
                self.events.emit(
                    "microbatch_retry",
                    job=job.id,
                    peer=exc.peer,
                    microbatch=idx,
                    attempt=attempts,
                    stage=exc.key,
                    reason=exc.reason,
                )
                continue
            distrusted = [p for p in used if self.verifier.quarantined(p)]
            if distrusted:  # quarantined while this microbatch was on its way: redo it
                avoid.update(distrusted)
                attempts -= 1
                self.events.emit(
                    "microbatch_retry",
                    job=job.id,
                    peer=distrusted[0],
                    microbatch=idx,
                    attempt=attempts,
                    reason="the provider was quarantined",
                )
                continue
            if attempts > 1:
                self.events.emit(
                    "microbatch_recovered",
                    job=job.id,
                    microbatch=idx,
                    attempts=attempts,
                    route=used,
                )
            return out, attempts, tuple(used)

    async def _walk(
        self,
        job: Ref,
        graph: nx.DiGraph,
        client: ClientStages,
        ids: Array,
        mask: Array,
        avoid: set[str],
        used: list[str],
    ) -> Array:
        """One microbatch through the job graph (its forward stages chained provider to
        provider); the head's output."""

        async def load(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
            return {"ids": ids}

        async def embed(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
            return {"hidden": await asyncio.to_thread(client.embed, inputs["ids"])}

        async def forward(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
            hidden = await self._stages(job, unit.stages, inputs["hidden"], mask, avoid, used)
            return {"hidden": hidden}

        async def head(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
            return {"out": await asyncio.to_thread(client.head, inputs["hidden"], mask)}

        handlers = {
            TaskKind.DATA_LOAD: load,
            TaskKind.EMBED: embed,
            TaskKind.FORWARD: forward,
            TaskKind.HEAD: head,
        }
        try:
            values = await execute(graph, handlers, fuse=frozenset({TaskKind.FORWARD}))
        except DagError as exc:
            raise JobFailed(f"{exc} (an embedding job runs load, embed, forward, head)") from None
        results = [v["out"] for v in values.values() if "out" in v]
        if len(results) != 1:
            raise JobFailed("the job graph has no head task")
        return np.ascontiguousarray(results[0], dtype=np.float32)

    async def _stages(
        self,
        job: Ref,
        stages: list[int],
        hidden: Array,
        mask: Array,
        avoid: set[str],
        used: list[str],
    ) -> Array:
        """Run consecutive stages, chained provider to provider where they can be. A stage
        due a spot check is checked against its hop's signed commitments when it runs in a
        chain (`broker/chaincheck.py`), else by a second opinion on its answer
        (`Verifier.check`). A check runs beside the stages after it, not before them: the
        hidden states are returned once every check is made, and a provider a check
        quarantined is among `used`, so the microbatch is redone (`_microbatch`)."""
        model = self.models.models[job.model]
        peers = [await self.calls.pick(job, pos, avoid) for pos in stages]
        tasks, keys = [], {pos: model.unit_key(model.units[pos]) for pos in stages}
        numbers = {}  # each task's number among its provider's tasks of the stage
        for pos, peer in zip(stages, peers, strict=True):  # numbered in the order drawn
            due, nth = self.verifier.due(keys[pos], peer), self.verifier.count(peer, keys[pos])
            tasks.append((pos, peer, nth if due else 0))
            numbers[pos] = nth

        made: set[int] = set()  # the stages whose drawn check was made
        checks: list[asyncio.Task[Any]] = []
        alone = self.chain_checks.alone  # (their last chained account was missing)
        solo = {pos for pos, peer, nth in tasks if nth and (keys[pos], peer) in alone}

        async def one(pos: int, peer: str, hidden: Array, nth: int) -> Array:
            out, msg = await self.calls.forward(job, pos, peer, hidden, mask, used)
            if nth:  # check the answer: the `nth` task the broker gave that provider
                made.add(pos)
                alone.discard((keys[pos], peer))
                check = self.verifier.check(job.model, pos, keys[pos], peer, msg, out, nth)
                checks.append(asyncio.create_task(check))
            return out

        async def chained(run: list[tuple[int, str, int]], hidden: Array) -> Array:
            chain, hops = uuid.uuid4().hex, list[HopDone]()
            hops_run = [(pos, peer) for pos, peer, _ in run]
            out = await self.calls.chain(job, hops_run, hidden, mask, used, chain=chain, done=hops)
            if any(nth for _, _, nth in run):
                made.update(pos for pos, _, nth in run if nth)
                numbered = [numbers[pos] for pos, _, _ in run]
                check = self.chain_checks.check(
                    job.model, chain, run, hidden, mask, hops, out, numbered
                )
                checks.append(asyncio.create_task(check))
            return out

        try:
            return await self._run(tasks, one, chained, hidden, solo)
        except BaseException:  # a failed task (or one before it) left checks unmade: owed,
            for pos, peer, nth in tasks:  # so a failure never costs a check
                if nth and pos not in made:
                    self.verifier.owe(keys[pos], peer)
            raise
        finally:  # (made or not, every check started ends here: a wrong answer is caught)
            for failed in await asyncio.gather(*checks, return_exceptions=True):
                if isinstance(failed, Exception):
                    log.warning("a spot check of job %s failed: %r", job.id, failed)

    async def _run(
        self,
        tasks: list[tuple[int, str, int]],
        one: Callable[[int, str, Array, int], Awaitable[Array]],
        chained: Callable[[list[tuple[int, str, int]], Array], Awaitable[Array]],
        hidden: Array,
        solo: set[int],
    ) -> Array:
        """Run `tasks` (stage, provider, its task number if due a check, else 0) in order:
        chained where they can be (`chained`), else, and the stages `solo`, alone (`one`)."""

        async def flush(run: list[tuple[int, str, int]], hidden: Array) -> Array:
            if len(run) == 1:
                return await one(*run[0][:2], hidden, run[0][2])
            return await chained(run, hidden) if run else hidden

        run: list[tuple[int, str, int]] = []
        for pos, peer, nth in tasks:
            alone = self.config.relay == "star" or pos in solo
            if alone or (run and self.calls.unreachable_to(run[-1][1], peer)):
                hidden = await flush(run, hidden)
                run = []
            if alone:
                hidden = await one(pos, peer, hidden, nth)
            else:
                run.append((pos, peer, nth))
        return await flush(run, hidden)

    def results(self, job: JobRow, offset: int, limit: int) -> EmbedResults:
        job_id = job.id
        if job.state != "succeeded":
            raise NotReady(f"job {job_id} is {job.state}; results come when it has succeeded")
        rows: list[list[float]] = []
        total = 0
        for _, shape, data in self.store.results(job_id):
            block = np.frombuffer(data, dtype=np.float32).reshape(shape)
            first = total
            total += block.shape[0]
            lo, hi = max(offset - first, 0), min(offset + limit - first, block.shape[0])
            if lo < hi:
                rows.extend(block[lo:hi].tolist())
        return EmbedResults(job_id, offset, total, rows)
