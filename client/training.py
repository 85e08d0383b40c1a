"""`AsyncClient`'s pre-training: submit a train job and follow it step by step; its trained
model is a model of the broker, to generate from like any other."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.core import ClientCore
from client.data import read_texts
from client.errors import FusionAIError
from client.routing import quote_part
from client.types import Job
from proto.api import TrainResults, TrainStep


@dataclass(frozen=True)
class Trained:
    """A finished train job: its steps, and the trained model's name on the broker."""

    job: str
    model: str  # the model trained
    steps: list[TrainStep]
    trained: str  # the new model

    @property
    def losses(self) -> list[float | None]:
        return [s.loss for s in self.steps]


class TrainMethods(ClientCore):
    """Part of `AsyncClient` (what it uses of the other parts: `client/core.py`)."""

    async def train(
        self,
        model: str,
        data: str | Path | Sequence[str],
        *,
        steps: int = 100,
        replicas: int = 2,
        progress: Callable[[TrainStep], None] | None = None,
        timeout: float | None = None,
        poll: float = 10.0,
        **options: Any,
    ) -> Trained:
        """Pre-train every weight of `model` (a package from `fusionai ir init`) on `data`
        (texts, a JSONL file of {"text": ...} lines, or a text file) with `replicas`
        providers each holding a whole replica, and wait for it. `options`: batch (global
        rows), seq_len, lr, warmup, weight_decay, compress ("none", "fp16", "powersgd",
        "acp"), rank, outer_every (DiLoCo's H), start_after, eval_every, seed, name (of the
        trained model). `progress` gets each step as it is done."""
        if isinstance(data, str | Path):
            texts = await asyncio.to_thread(read_texts, data)
        else:
            texts = [str(t) for t in data]
        body = {"kind": "train", "model": model, "texts": texts, "steps": steps,
                "replicas": replicas, **options}  # fmt: skip
        job = await self.submit(body)
        done = 0

        async def seen(current: Job) -> None:
            nonlocal done
            for s in (await self._train_results(job.id, done)).steps:
                done += 1
                if progress is not None:
                    progress(s)

        await self._follow(job.id, seen, timeout=timeout, poll=poll, what="train job")
        results = await self._train_results(job.id, 0)
        if results.model is None:
            raise FusionAIError(f"train job {job.id} succeeded without a trained model")
        return Trained(job.id, model, results.steps, results.model)

    async def train_steps(self, job_id: str, *, offset: int = 0) -> list[TrainStep]:
        """The steps a train job has done so far (from `offset` on)."""
        return (await self._train_results(job_id, offset)).steps

    async def _train_results(self, job_id: str, offset: int) -> TrainResults:
        url = f"/v1/jobs/{quote_part(job_id)}/results?offset={offset}&limit=10000"
        out: TrainResults = await self._call("GET", url, TrainResults)
        return out
