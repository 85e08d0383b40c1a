"""The "train" job kind: checks a submission (the model, the corpus, the replicas the swarm
can give), builds its graph, runs it (`run.py`) and presents its steps and trained model."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import numpy as np

from broker.calls import StageCalls
from broker.config import BrokerConfig
from broker.errors import NotFound
from broker.events import EventLog
from broker.jobkinds import JobError, Prepared
from broker.models import ModelStore, StoredModel
from broker.pretrain.request import RECORD, corpus_of, parse, to_dict, trained_name
from broker.pretrain.run import SwarmPretrain
from broker.schema import JobRow
from broker.serving import Serving
from broker.store import Store
from dag.builders import data_parallel_train
from dag.tasks import task
from dag.wire import to_json
from proto.api.jobs import TrainJobRequest, TrainResults, TrainStep
from proto.pretrain import MAX_PART_BYTES

MAX_TRAIN_BYTES = MAX_PART_BYTES * 4  # a state part holds one whole tensor at most


class TrainJobs:
    """The "train" job kind."""

    name = "train"
    request = TrainJobRequest

    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        events: EventLog,
        serving: Serving,
        models: ModelStore,
        calls: StageCalls,
        add_model: Callable[[bytes], Awaitable[StoredModel]],
    ) -> None:
        self.config = config
        self.store = store
        self.events = events
        self.serving = serving
        self.models = models
        self.calls = calls
        self.add_model = add_model

    def providers(self) -> list[str]:
        """Live, trusted providers (each may hold a replica)."""
        registry = self.serving.registry
        return sorted(
            p for p in registry.profiles if registry.alive(p) and p not in registry.quarantined
        )

    async def prepare(self, body: TrainJobRequest) -> Prepared:
        model = self.models.models.get(body.model)
        if model is None:
            raise NotFound(f"no model named {body.model!r}; add it first")
        if model.manifest.family in ("bert", "onnx"):
            raise JobError("model", f"{body.model} is not a decoder to pre-train")
        if any(s.weight_dtype != "float32" for s in model.manifest.stages):
            raise JobError("model", f"{body.model}: only float32 packages are trained")
        if body.batch < body.replicas:
            raise JobError(
                "batch", f"a global batch of {body.batch} rows cannot feed {body.replicas} replicas"
            )
        live = len(self.providers())
        if body.replicas > live:
            raise JobError(
                "replicas",
                f"{body.replicas} replicas asked for, and the swarm has {live} provider"
                f"{'' if live == 1 else 's'} to hold them",
            )
        if body.name is not None and body.name in self.models.models:
            raise JobError("name", f"a model named {body.name} exists already")
        weight_bytes = float(sum(s.size_bytes for s in model.manifest.stages))
        if weight_bytes > MAX_TRAIN_BYTES:
            raise JobError(
                "model",
                f"{body.model} has {weight_bytes / 2**20:.0f} MiB of weights; train jobs take "
                f"models up to {MAX_TRAIN_BYTES >> 20} MiB for now (a ring chunk and a state "
                "part each travel as one message)",
            )
        await asyncio.to_thread(corpus_of, model, body)  # enough text?
        spec = self.serving.spec(body.model)
        graph = data_parallel_train(
            spec,
            [(0, spec.n_layers)],
            replicas=body.replicas,
            microbatches=1,
            batch=math.ceil(body.batch / body.replicas),
            seq=body.seq_len,
            adapter_bytes=[weight_bytes],  # every weight is trained
        )
        flops = sum(task(graph, n).flops for n in graph.nodes) * body.steps
        return Prepared(
            body.model,
            to_dict(body),
            to_json(graph),
            body.steps,
            flops,
            {"job_kind": "train", "steps": body.steps, "replicas": body.replicas},
        )

    async def run(self, job: JobRow) -> None:
        await SwarmPretrain(self, job).run()

    def results(self, job: JobRow, offset: int, limit: int) -> TrainResults:
        full = self.store.job(job.id) if not job.request else job
        if full is None:
            raise NotFound(f"no job {job.id}")
        request = parse(full)
        steps = []
        for idx, _, data in self.store.results_from(job.id, offset, limit):
            loss, tokens, seconds, replicas, sent, val = np.frombuffer(data, np.float64)[:RECORD]
            steps.append(
                TrainStep(
                    idx + 1,
                    float(loss) if math.isfinite(loss) else None,
                    int(tokens),
                    round(float(seconds), 4),
                    int(replicas),
                    int(sent),
                    float(val) if math.isfinite(val) else None,
                )
            )
        name = trained_name(job, request)
        done = job.state in ("succeeded", "cancelled") and name in self.models.models
        total = self.store.count_done(job.id)
        return TrainResults(job.id, offset, total, steps, name if done else None)
