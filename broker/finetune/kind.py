"""The "finetune" job kind: checks a submission, runs the job through the swarm
(`swarm.py`), presents its steps and keeps its adapter in the broker's artifact cache (named by
its SHA-256, like the models' files; those an earlier release kept in data_dir/adapters/ move
in when the broker starts, `broker/models.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from broker.calls import StageCalls
from broker.config import BrokerConfig
from broker.errors import NotFound
from broker.events import EventLog
from broker.finetune.request import (
    Data,
    check_size,
    finetune_estimate,
    finetune_graph,
    parse_finetune,
    trainable_stages,
)
from broker.finetune.swarm import SwarmFinetune
from broker.jobkinds import JobError, NotReady, Prepared
from broker.models import ModelStore
from broker.schema import JobRow
from broker.serving import Serving
from broker.store import Store
from dag.wire import to_json
from proto.api.jobs import Adapter, FinetuneJobRequest, FinetuneResults, Step


class FinetuneJobs:
    """The "finetune" job kind."""

    name = "finetune"
    request = FinetuneJobRequest

    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        events: EventLog,
        serving: Serving,
        models: ModelStore,
        calls: StageCalls,
    ) -> None:
        self.config = config
        self.store = store
        self.events = events
        self.serving = serving
        self.models = models
        self.calls = calls

    async def prepare(self, body: FinetuneJobRequest) -> Prepared:
        """Check a submission (the tokenizing runs off the event loop)."""
        request = parse_finetune(body, self.config.max_job_texts)
        model = self.models.models.get(request.model)
        if model is None:
            raise NotFound(f"no model named {request.model!r}; add it first")
        stages = trainable_stages(model.manifest)
        check_size(model.manifest, request)
        if importlib.util.find_spec("torch") is None:
            raise JobError(
                "kind",
                "this broker cannot run fine-tune jobs: torch is not installed here "
                "(pip install fusionai[torch])",
            )
        client = await asyncio.to_thread(self.models.client, request.model)
        await asyncio.to_thread(Data, client, request)  # tokenizes: enough tokens?
        graph = finetune_graph(self.serving.spec(request.model), stages, request)
        return Prepared(
            request.model,
            request.to_json(),
            to_json(graph),
            request.steps,
            finetune_estimate(graph, request.steps),
            {"job_kind": "finetune", "steps": request.steps},
        )

    async def run(self, job: JobRow) -> None:
        await SwarmFinetune(self, job).run()

    def results(self, job: JobRow, offset: int, limit: int) -> FinetuneResults:
        """The steps so far, in any state, and the adapter once saved."""
        job_id = job.id
        steps = self.store.finetune_steps(job_id)[offset : offset + limit]
        row = self.store.adapter(job_id)
        adapter = None if row is None else Adapter(**row, url=f"/v1/jobs/{job_id}/adapter")
        return FinetuneResults(
            job=job_id,
            offset=offset,
            total=self.store.count_done(job_id),
            steps=[Step(n, v[0], int(v[1]), round(v[2], 4)) for n, v in steps],
            adapter=adapter,
        )

    def save_adapter(self, job_id: str, model: str, data: bytes) -> None:
        """Keep a finished fine-tune job's adapter (safetensors) in the artifact cache, named
        by its SHA-256 like every artifact."""
        digest = hashlib.sha256(data).hexdigest()
        self.models.cache.put(digest, data)
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
        sha, cache = row["sha256"], self.models.cache
        if not cache.has(sha):
            raise NotFound(f"job {job_id}'s adapter {sha[:12]} is missing from the store")
        return cache.path(sha), row
