"""Jobs: `dag/` graphs the broker runs through the swarm, persisted in SQLite.

A job's states: queued -> placed (every stage has a route) -> running -> succeeded, failed or
cancelled. A batch job (embed N texts) is cut into microbatches; each runs the job's graph in
topological order: the client-side tasks (load, embed, head) through the client package's
stage code here, each FORWARD task on a provider serving that stage. Consecutive FORWARD
tasks go as one chained request (`proto.forward`): the hidden states pass from provider to
provider and the last pushes the result here, unless a stage is due a spot check (it then
runs on its own) or `relay` is "star". Several microbatches are in the pipeline at once. A
microbatch that fails (provider lost, stalled, busy, refused) is retried on another route,
up to `max_attempts`; results are stored per microbatch as they arrive, so a broker restarted
mid-job only redoes what was in flight. Which queued job starts when is the decision core's
(`broker.core.queue`, FIFO or SJF-BSBF): the runner reports jobs queued, progressing and
ended, and starts those the core says (`StartJob`), a job that shares a route alongside its
host.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

from broker.config import BrokerConfig
from broker.core.actions import StartJob
from broker.core.events import JobEnded, JobProgressed, JobQueued, ModelUsed
from broker.errors import Conflict, NotFound, Unavailable
from broker.events import EventLog
from broker.models import ModelStore
from broker.schema import JobRow
from broker.serving import Serving
from broker.store import Store
from broker.verify import Verifier
from client.session import unless_lost
from client.stages import ClientStageError, ClientStages
from dag.builders import inference_pipeline
from dag.cost import Workload
from dag.execute import Unit, execute
from dag.tasks import TaskKind, task
from dag.validate import DagError
from dag.wire import from_json, to_json
from files.atomic import write_atomic
from p2p import ErrorCode, Host, P2PError, Refused, RemoteError, RequestTimeout, Tensor
from p2p.codec import Message, ProtocolSpec
from proto.forward import (
    FORWARD,
    ROUTE_DOMAIN,
    TIMEOUT,
    UNREACHABLE,
    ChainAccepted,
    ChainBroken,
    ChainResult,
    Forward,
    ForwardResult,
    Hop,
    route_bytes,
)

log = logging.getLogger("fusionai.broker")
Array = np.ndarray[Any, Any]

TERMINAL = ("succeeded", "failed", "cancelled")
ACTIVE = ("placed", "running")
BUSY_WAIT_S = 0.2  # pause before trying again after a "busy" answer; seconds
UNREACHABLE_S = 300.0  # a provider that could not reach the next in a chain: star for so long
NOMINAL_FLOPS = 1e11  # FLOP/s used only to rank jobs by size (SJF); not a prediction


class JobError(ValueError):
    """A job request is invalid; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class JobRequest:
    kind: str
    model: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    microbatch: int

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or [])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "model": self.model,
            "microbatch": self.microbatch,
        }
        if self.texts is not None:
            out["texts"] = self.texts
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
        return out


def parse_request(body: Any, config: BrokerConfig) -> JobRequest:
    """Validate a job submission (JSON); raises `JobError` naming the field."""
    if not isinstance(body, dict):
        raise JobError("body", "a job is a JSON object")
    unknown = sorted(set(body) - {"kind", "model", "texts", "token_ids", "microbatch"})
    if unknown:
        raise JobError(unknown[0], "unknown field")
    kind = body.get("kind", "embed")
    if kind != "embed":
        raise JobError("kind", f"unknown job kind {kind!r}; this broker runs 'embed' batch jobs")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise JobError("model", "name the model (a string)")
    texts, ids = body.get("texts"), body.get("token_ids")
    if (texts is None) == (ids is None):
        raise JobError("texts", "give either texts (strings) or token_ids (lists of ints)")
    if texts is not None:
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise JobError("texts", "must be a list of strings")
        items: Sequence[Any] = texts
    else:
        if not isinstance(ids, list) or not all(
            isinstance(seq, list) and seq and all(type(t) is int for t in seq) for seq in ids
        ):
            raise JobError("token_ids", "must be a list of non-empty lists of integers")
        items = ids
    if not items:
        raise JobError("texts" if texts is not None else "token_ids", "is empty")
    if len(items) > config.max_job_texts:
        raise JobError(
            "texts" if texts is not None else "token_ids",
            f"{len(items)} sequences; one job takes at most {config.max_job_texts}",
        )
    microbatch = body.get("microbatch", config.microbatch)
    if type(microbatch) is not int or not 1 <= microbatch <= 1024:
        raise JobError("microbatch", "must be an integer from 1 to 1024")
    return JobRequest(kind, model, texts, ids, microbatch)


class JobRunner:
    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        events: EventLog,
        serving: Serving,
        models: ModelStore,
        host: Host,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.store = store
        self.events = events
        self.serving = serving
        self.models = models
        self.host = host
        self.driver = serving.driver
        self.clock = serving.clock
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.clients: dict[str, ClientStages] = {}
        self.inflight: dict[str, int] = {}  # requests we have outstanding per provider
        # chained requests waiting for their result: chain id -> (last hop, its outputs)
        self.chains: dict[str, tuple[str, asyncio.Future[dict[str, Tensor]]]] = {}
        # (provider, next provider) -> until when the first cannot reach the second
        self.unreachable: dict[tuple[str, str], float] = {}
        # metrics: (model, seconds, "chain" or "direct") per stage task answered
        self.on_stage: Callable[[str, float, str], None] = lambda model, seconds, relay: None
        self.driver.carry(StartJob, self._start)
        self.verifier = Verifier(
            config, store, events, serving.registry, models, self._check, rng, serving.clock
        )
        self.verifier.on_quarantine = self._redo
        serving.registry.reputation_of = self.verifier.summary

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, body: Any) -> JobRow:
        """Validate and queue a job (the heavy checks run off the event loop)."""
        if isinstance(body, dict) and body.get("kind") == "finetune":
            return await self._submit_finetune(body)
        request = await asyncio.to_thread(parse_request, body, self.config)
        model = self.models.models.get(request.model)
        if model is None:
            raise NotFound(f"no model named {request.model!r}; add it first")
        client = await asyncio.to_thread(self.client, request.model)
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
        mb = request.microbatch
        graph = self._graph(request.model, mb, max(lengths))
        microbatches = -(-request.count // mb)
        flops = sum(task(graph, n).flops for n in graph.nodes) * microbatches
        job_id = uuid.uuid4().hex[:16]
        job = self.store.add_job(
            job_id,
            request.kind,
            request.model,
            request.to_json(),
            to_json(graph),
            microbatches,
            flops / NOMINAL_FLOPS,
        )
        self.events.emit(
            "job_queued",
            job=job_id,
            model=request.model,
            sequences=request.count,
            microbatches=microbatches,
        )
        self._queue(job)
        return job

    async def _submit_finetune(self, body: dict[str, Any]) -> JobRow:
        from broker import finetune as ft

        request = await asyncio.to_thread(ft.parse_finetune, body, self.config.max_job_texts)
        model = self.models.models.get(request.model)
        if model is None:
            raise NotFound(f"no model named {request.model!r}; add it first")
        stages = ft.trainable_stages(model.manifest)
        ft.check_size(model.manifest, request)
        if importlib.util.find_spec("torch") is None:
            raise JobError(
                "kind",
                "this broker cannot run fine-tune jobs: torch is not installed here "
                "(pip install fusionai[torch])",
            )
        client = await asyncio.to_thread(self.client, request.model)
        await asyncio.to_thread(ft.Data, client, request)  # tokenizes: enough tokens?
        graph = ft.finetune_graph(self.serving.spec(request.model), stages, request)
        job_id = uuid.uuid4().hex[:16]
        job = self.store.add_job(
            job_id,
            "finetune",
            request.model,
            request.to_json(),
            to_json(graph),
            request.steps,
            ft.finetune_estimate(graph, request.steps) / NOMINAL_FLOPS,
        )
        self.events.emit(
            "job_queued", job=job_id, model=request.model, job_kind="finetune", steps=request.steps
        )
        self._queue(job)
        return job

    def _queue(self, job: JobRow) -> None:
        """The core hears of a queued job (and starts it when its model has a free route)."""
        self.driver.handle(
            JobQueued(job.id, job.model, job.created, max(1e-6, job.estimate_s), self.clock())
        )

    def save_adapter(self, job_id: str, model: str, data: bytes) -> None:
        """Keep a finished fine-tune job's adapter (safetensors), named by its SHA-256."""
        digest = hashlib.sha256(data).hexdigest()
        folder = self.config.data_dir / "adapters"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{digest}.safetensors"
        if not path.is_file():
            write_atomic(path, data)
        self.store.put_adapter(job_id, model, digest, len(data))
        self.events.emit("adapter_saved", job=job_id, model=model, sha256=digest, bytes=len(data))

    def adapter_path(self, job_id: str) -> tuple[Path, dict[str, Any]]:
        row = self.store.adapter(job_id)
        if row is None:
            job = self.store.job(job_id, full=False)
            if job is None:
                raise NotFound(f"no job {job_id}")
            if job.kind != "finetune":
                raise NotFound(f"job {job_id} is a {job.kind} job; adapters come from fine-tuning")
            raise NotReady(f"job {job_id} is {job.state}; its adapter comes when it has succeeded")
        return self.config.data_dir / "adapters" / f"{row['sha256']}.safetensors", row

    def cancel(self, job_id: str) -> JobRow:
        job = self.store.job(job_id, full=False)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if job.state in TERMINAL:
            return job
        self.store.set_job_state(job_id, "cancelled", "cancelled by request")
        self.events.emit("job_cancelled", job=job_id)
        task_ = self.tasks.pop(job_id, None)
        if task_ is not None:
            task_.cancel()
        self._release(job_id)
        found = self.store.job(job_id, full=False)
        assert found is not None
        return found

    async def embed_now(
        self, model: str, texts: list[str] | None, token_ids: list[list[int]] | None
    ) -> tuple[Array, int]:
        """An interactive embedding request, run at once through the same graph and retries
        as a batch job but neither queued nor stored: (embeddings in input order, tokens)."""
        if model not in self.models.models:
            raise NotFound(f"no model named {model!r}")
        client = await asyncio.to_thread(self.client, model)
        if client.decoder:
            raise JobError("model", f"{model} is a decoder; embeddings come from encoder models")
        try:
            if texts is not None:
                ids, mask = await asyncio.to_thread(client.tokenize, texts)
            else:
                ids, mask = await asyncio.to_thread(client.pad, token_ids or [])
        except ClientStageError as exc:
            raise JobError("input", str(exc)) from None
        mb = self.config.microbatch
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

    def _graph(self, model: str, microbatch: int, seq: int) -> nx.DiGraph:
        """The job graph of one microbatch: client stages, then each provider stage."""
        units = len(self.models.models[model].units)
        pairs = [(i, i + 1) for i in range(units)]
        return inference_pipeline(self.serving.spec(model), pairs, batch=microbatch, seq=seq)

    def busy(self, model: str) -> bool:
        """A job, an embedding request or a generation session is using the model (so its
        placement is not rebalanced now)."""
        return self.serving.core.busy(model)

    @contextlib.contextmanager
    def using(self, model: str) -> Iterator[None]:
        """Tell the core an interactive request uses `model` while this block runs."""
        self.driver.handle(ModelUsed(model, 1, self.clock()))
        try:
            yield
        finally:
            self.driver.handle(ModelUsed(model, -1, self.clock()))

    def client(self, model: str) -> ClientStages:
        """The model's client-side stages, loaded once (a new version of the model drops them)."""
        stages = self.clients.get(model)
        if stages is None:
            stages = self.clients[model] = ClientStages(self.models.models[model].directory)
        return stages

    # ---- scheduling ------------------------------------------------------------------------

    def resume(self) -> None:
        """After a restart: jobs that were placed or running go back to the queue; the core
        hears of every queued job (one whose model is gone fails)."""
        for job in self.store.jobs(ACTIVE):
            done = self.store.count_done(job.id)
            self.store.set_job_state(job.id, "queued")
            self.events.emit("job_resumed", job=job.id, done=done, of=job.microbatches)
        for job in self.store.jobs(("queued",), oldest_first=True):
            if job.model not in self.models.models:
                self._finish(job.id, "failed", f"model {job.model} is no longer stored")
            else:
                self._queue(job)

    async def schedule(self, stop: asyncio.Event) -> None:
        """Own the running jobs until the broker stops: then they are cancelled (they resume
        when it starts again). Jobs start when the core says (`StartJob`)."""
        try:
            await stop.wait()
        finally:
            self.driver.stop()  # jobs cancelled now change no decision on their way out
            for t in list(self.tasks.values()):
                t.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _start(self, action: StartJob) -> None:
        self.store.set_job_state(action.job, "placed")
        route = self.serving.route(action.model)
        self.events.emit("job_placed", job=action.job, route=route, shares_with=action.shares)
        self.tasks[action.job] = asyncio.create_task(self._run(action.job))

    def _finish(self, job_id: str, state: str, error: str = "") -> None:
        job = self.store.job(job_id, full=False)
        if job is None or job.state in TERMINAL:
            return
        self.store.set_job_state(job_id, state, error)
        self.events.emit(f"job_{state}", job=job_id, **({"reason": error} if error else {}))

    # ---- running ---------------------------------------------------------------------------

    async def _run(self, job_id: str) -> None:
        try:
            job = self.store.job(job_id)
            assert job is not None
            await self._execute(job)
        except asyncio.CancelledError:
            raise
        except JobFailed as exc:
            self._finish(job_id, "failed", str(exc))
        except Exception as exc:  # a bug must fail the job loudly, not hang it
            log.exception("job %s crashed", job_id)
            self._finish(job_id, "failed", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if self.tasks.get(job_id) is asyncio.current_task():
                del self.tasks[job_id]
                self._release(job_id)

    def _release(self, job_id: str) -> None:
        """A job stopped or was cancelled: the core frees its route (a job sharing it
        carries on, holding it) and may start the next."""
        self.driver.handle(JobEnded(job_id, self.clock()))

    async def _execute(self, job: JobRow) -> None:
        if job.kind == "finetune":
            await self._finetune(job)
            return
        graph = from_json(job.graph)
        request = job.request
        client = await asyncio.to_thread(self.client, job.model)
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
        self._finish(job.id, "succeeded")

    def _redo(self, peer: str, dropped: dict[str, int]) -> None:
        """A quarantined provider's results were dropped: finished jobs run again for them
        (running ones notice by themselves)."""
        for job_id, n in dropped.items():
            job = self.store.job(job_id, full=False)
            if job is None:
                continue
            self.events.emit("job_redo", job=job_id, peer=peer, microbatches=n, was=job.state)
            if job.state == "succeeded":
                self.store.set_job_state(job_id, "queued")
                self._queue(job)

    async def _check(
        self, peer: str, spec: ProtocolSpec, msg: Message
    ) -> asyncio.Future[Any] | None:
        """A request of the verifier's (a second opinion, a probe)."""
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        try:
            return await self.request_unless_lost(peer, spec, msg, self.config.request_timeout_s)
        finally:
            self.inflight[peer] -= 1

    async def _finetune(self, job: JobRow) -> None:
        from broker.finetune import SwarmFinetune

        await SwarmFinetune(self, job).run()
        self._finish(job.id, "succeeded")

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
        gate = asyncio.Semaphore(self.config.in_flight)

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
            except _StageFailed as exc:
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
        """Run consecutive stages: chained provider to provider, but for stages due a spot
        check, whose input and output the broker must see (they run on their own)."""
        model = self.models.models[job.model]
        peers = [await self.pick(job, pos, avoid) for pos in stages]
        tasks = []
        for pos, peer in zip(stages, peers, strict=True):  # numbered in the order drawn
            due = self.verifier.due(model.unit_key(model.units[pos]))
            nth = self.verifier.count(peer)
            tasks.append((pos, peer, nth if due else 0))

        async def flush(run: list[tuple[int, str]], hidden: Array) -> Array:
            if len(run) == 1:
                return await self._forward(job, run[0][0], run[0][1], hidden, mask, used, 0)
            return await self._chain(job, run, hidden, mask, used) if run else hidden

        run: list[tuple[int, str]] = []
        for pos, peer, nth in tasks:
            alone = bool(nth) or self.config.relay == "star"
            if alone or (run and self._unreachable(run[-1][1], peer)):
                hidden = await flush(run, hidden)
                run = []
            if alone:
                hidden = await self._forward(job, pos, peer, hidden, mask, used, nth)
            else:
                run.append((pos, peer))
        return await flush(run, hidden)

    def _unreachable(self, source: str, target: str) -> bool:
        """Whether `source` recently failed to reach `target` (their hidden states then go
        through the broker)."""
        until = self.unreachable.get((source, target))
        if until is not None and until <= self.clock():
            del self.unreachable[(source, target)]
            return False
        return until is not None

    async def _chain(
        self, job: Ref, hops: list[tuple[int, str]], hidden: Array, mask: Array, used: list[str]
    ) -> Array:
        """Stages as one chained request along `hops` (stage, provider): the activations go
        from provider to provider, and the last pushes the result here (`on_chain_result`)."""
        model = self.models.models[job.model]
        stages = [pos for pos, _ in hops]
        keys = [model.unit_key(model.units[pos]) for pos in stages]
        peers = [peer for _, peer in hops]
        used.extend(peers)
        profiles = self.serving.registry.profiles
        route = [
            Hop(peer, key, list(profiles[peer].addrs) if peer in profiles else [])
            for peer, key in zip(peers, keys, strict=True)
        ]
        chain = uuid.uuid4().hex
        timeout = self.config.request_timeout_s * len(route)
        expires = time.time() + timeout + 5.0
        signature = self.host.identity.sign(route_bytes(chain, route, expires), domain=ROUTE_DOMAIN)
        msg = Forward(
            stage=keys[0],
            inputs=self._inputs(job, stages[0], hidden, mask),
            chain=chain,
            route=route,
            expires=expires,
            signature=signature,
        )
        arrived: asyncio.Future[dict[str, Tensor]] = asyncio.get_running_loop().create_future()
        self.chains[chain] = (peers[-1], arrived)
        for peer in peers:
            self.inflight[peer] = self.inflight.get(peer, 0) + 1
        start = time.perf_counter()
        lost = [self.serving.registry.lost_event(p) for p in peers]
        try:
            call = await unless_lost(
                self.host.request(peers[0], FORWARD, msg, timeout=timeout), lost
            )
        finally:
            del self.chains[chain]
            for peer in peers:
                self.inflight[peer] -= 1
        if call is None:  # (the events as they were: a peer that joins again gets a new one)
            at = next((i for i, e in enumerate(lost) if e.is_set()), 0)
            raise _StageFailed(peers[at], keys[at], "the provider was declared lost")
        answer = await self._answer(call, peers[0], keys[0])
        if isinstance(answer, ChainBroken):
            # the hop that failed ("": pushing the result here failed, after the last hop)
            at = keys.index(answer.stage) if answer.stage in keys else len(keys) - 1
            peer, key = peers[at], keys[at]
            if answer.code == ErrorCode.BUSY:
                await asyncio.sleep(BUSY_WAIT_S)
                raise _StageFailed(peer, key, answer.reason, busy=True)
            if answer.code == UNREACHABLE and answer.stage in keys and at > 0:
                source = peers[at - 1]
                self.unreachable[(source, peer)] = self.clock() + UNREACHABLE_S
                self.events.emit(
                    "chain_unreachable",
                    job=job.id,
                    peer=source,
                    to=peer,
                    reason=answer.reason,
                    seconds=UNREACHABLE_S,
                )
            if answer.code in (TIMEOUT, UNREACHABLE):
                await self.serving.suspect(peer, f"a chained stage request failed: {answer.reason}")
            else:
                await self.serving.changed(0.5)
            raise _StageFailed(peer, key, answer.reason)
        if not arrived.done() or [h.peer for h in answer.hops] != peers:
            raise _StageFailed(peers[-1], keys[-1], "the chain's result did not arrive whole")
        elapsed = time.perf_counter() - start
        work = _workload(hidden)
        for hop in answer.hops:
            self.serving.observe(hop.peer, job.model, work, hop.compute_ms / 1e3)
        for _ in route:
            self.on_stage(job.model, elapsed / len(route), "chain")
        return self._hidden(arrived.result(), peers[-1], keys[-1])

    async def on_chain_result(self, peer: str, msg: ChainResult) -> ChainAccepted:
        """The last hop of a chain pushes its outputs here."""
        waiting = self.chains.get(msg.chain)
        if waiting is None or waiting[0] != peer:
            raise Refused(ErrorCode.NOT_FOUND, "no chain of yours with that id is waiting here")
        if not waiting[1].done():
            waiting[1].set_result(msg.outputs)
        return ChainAccepted(chain=msg.chain)

    async def _answer(self, call: asyncio.Future[Any], peer: str, key: str) -> Any:
        """A stage request's answer; a failure becomes `_StageFailed` (after a busy wait, a
        liveness check of `peer`, or a moment for the route table to catch up)."""
        try:
            return call.result()
        except RemoteError as exc:
            if exc.code == ErrorCode.BUSY:  # full or leaving: wait, it is not a failure
                await asyncio.sleep(BUSY_WAIT_S)
                raise _StageFailed(peer, key, f"{exc.code}: {exc}", busy=True) from None
            await self.serving.changed(0.5)  # e.g. promoted but not confirmed yet
            raise _StageFailed(peer, key, f"{exc.code}: {exc}") from None
        except RequestTimeout as exc:
            await self.serving.suspect(peer, "a stage request timed out")
            raise _StageFailed(peer, key, str(exc)) from None
        except P2PError as exc:
            await self.serving.suspect(peer, f"a stage request failed: {exc}")
            raise _StageFailed(peer, key, str(exc)) from None

    @staticmethod
    def _hidden(outputs: dict[str, Tensor], peer: str, key: str) -> Array:
        tensor = outputs.get("hidden_states_out")
        if tensor is None:
            raise _StageFailed(peer, key, "the answer has no hidden_states_out")
        try:
            return tensor.to_numpy()
        except ValueError as exc:
            raise _StageFailed(peer, key, f"a bad tensor: {exc}") from None

    def _inputs(self, job: Ref, pos: int, hidden: Array, mask: Array) -> dict[str, Tensor]:
        """What stage `pos` takes of the hidden states and the mask (adapters: the provider's
        zeros)."""
        model = self.models.models[job.model]
        names = {i.name for i in model.manifest.stages[model.units[pos]].inputs}
        feeds = {"hidden_states": hidden, "attention_mask": mask}
        return {k: Tensor.from_numpy(v) for k, v in feeds.items() if k in names}

    async def _forward(
        self, job: Ref, pos: int, peer: str, hidden: Array, mask: Array, used: list[str], nth: int
    ) -> Array:
        """Stage `pos` on `peer`; `nth` (when not 0): check the answer, the `nth` task the
        broker gave that provider."""
        model = self.models.models[job.model]
        key = model.unit_key(model.units[pos])
        used.append(peer)
        msg = Forward(stage=key, inputs=self._inputs(job, pos, hidden, mask))
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        start = time.perf_counter()
        try:
            call = await self.request_unless_lost(peer, FORWARD, msg, self.config.request_timeout_s)
        finally:
            self.inflight[peer] -= 1
        if call is None:
            raise _StageFailed(peer, key, "the provider was declared lost")
        answer = await self._answer(call, peer, key)
        if not isinstance(answer, ForwardResult):
            raise _StageFailed(peer, key, f"an unexpected {type(answer).__name__}")
        elapsed = time.perf_counter() - start
        self.serving.observe(peer, job.model, _workload(hidden), answer.compute_ms / 1e3 or elapsed)
        self.on_stage(job.model, elapsed, "direct")
        out = self._hidden(answer.outputs, peer, key)
        if nth:
            out, used[-1] = await self.verifier.check(job.model, pos, key, peer, msg, out, nth)
        return out

    async def request_unless_lost(
        self, peer: str, spec: ProtocolSpec, msg: Message, timeout: float
    ) -> asyncio.Future[Any] | None:
        """Send `msg` to `peer`; the finished call (its result or error), or None if the
        registry declared `peer` lost first (the request is then abandoned)."""
        lost = self.serving.registry.lost_event(peer)
        return await unless_lost(self.host.request(peer, spec, msg, timeout=timeout), lost)

    async def pick(self, job: Ref, pos: int, avoid: set[str]) -> str:
        """The least loaded provider serving stage `pos`, preferring those not in `avoid`;
        waits (up to the request timeout) for a route when there is none."""
        timeout = self.config.request_timeout_s
        peer = await self.serving.pick(job.model, pos, avoid, self.inflight, timeout)
        if peer is None:
            raise JobFailed(
                f"no provider has served stage {pos} of {job.model} for {timeout:.0f} s"
            )
        return peer

    # ---- results ---------------------------------------------------------------------------

    def results(self, job_id: str, offset: int, limit: int) -> dict[str, Any]:
        job = self.store.job(job_id, full=False)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if job.kind == "finetune":  # the steps so far, in any state
            steps = self.store.finetune_steps(job_id)[offset : offset + limit]
            adapter = self.store.adapter(job_id)
            if adapter is not None:
                adapter["url"] = f"/v1/jobs/{job_id}/adapter"
            return {
                "job": job_id,
                "offset": offset,
                "total": self.store.count_done(job_id),
                "steps": [
                    {"step": n, "loss": v[0], "tokens": int(v[1]), "seconds": round(v[2], 4)}
                    for n, v in steps
                ],
                "adapter": adapter,
            }
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
        return {"job": job_id, "offset": offset, "total": total, "embeddings": rows}


@dataclass(frozen=True)
class Ref:
    """What running a microbatch needs to know of its job (or interactive request)."""

    id: str
    model: str


class NotReady(Conflict):
    """The job has no results yet."""


class JobFailed(Exception):
    """The job cannot go on; the message says why (it becomes the job's error)."""


def _workload(hidden: Array) -> Workload:
    return Workload(
        tokens=int(hidden.shape[0] * hidden.shape[1]),
        sequences=int(hidden.shape[0]),
        context=int(hidden.shape[1]),
        dtype="float32",
    )


class _StageFailed(Exception):
    def __init__(self, peer: str, key: str, reason: str, busy: bool = False) -> None:
        super().__init__(f"{key} on {peer}: {reason}")
        self.peer, self.key, self.reason, self.busy = peer, key, reason, busy
