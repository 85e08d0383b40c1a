"""`AsyncClient`'s fine-tuning: submit a fine-tune job and follow it, read its steps, fetch
its adapter (kept once in the artifact cache) and check one against a model."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from client.core import ClientCore
from client.data import load_adapter, read_texts
from client.errors import (
    FusionAIError,
)
from client.routing import quote_part
from client.types import (
    FineTune,
    FinetuneStep,
    Job,
)
from proto.api import Adapter, FinetuneResults

Array = np.ndarray[Any, Any]


class _AdapterOf(msgspec.Struct, frozen=True):
    """The adapter of a job's results, if it has one (any kind of job)."""

    adapter: Adapter | None = None


class FinetuneMethods(ClientCore):
    """Part of `AsyncClient` (what it uses of the other parts: `client/core.py`)."""

    # ---- fine-tuning -----------------------------------------------------------------------

    async def finetune(
        self,
        model: str,
        data: str | Path | Sequence[str],
        *,
        steps: int = 20,
        progress: Callable[[FinetuneStep], None] | None = None,
        timeout: float | None = None,
        poll: float = 10.0,
        **options: Any,
    ) -> FineTune:
        """Fine-tune `model` through the swarm on `data` (texts, or a JSONL file of
        {"text": ...} lines, or a plain text file of one example per line) and wait for it.
        `options`: batch, microbatches, seq_len, method ("lora-fa" or "lora"), rank, lr,
        weight_decay, seed, snapshot_every, shards ([k, n]). `progress` gets each step as it
        is done (`poll`: the longest one status request waits for a change, as in `wait`).
        Returns the losses and the downloaded adapter."""
        if isinstance(data, str | Path):
            texts = await asyncio.to_thread(read_texts, data)
        else:
            texts = [str(t) for t in data]
        body = {"kind": "finetune", "model": model, "texts": texts, "steps": steps, **options}
        if "shards" in body:
            body["shards"] = list(body["shards"])
        job = await self.submit(body)
        done = 0

        async def seen(current: Job) -> None:
            nonlocal done
            for s in await self._steps(job.id, done, current.microbatches):
                done += 1
                if progress is not None:
                    progress(s)

        current = await self._follow(job.id, seen, timeout=timeout, poll=poll, what="fine-tune job")
        path, sha = await self._download_adapter(job.id)
        return FineTune(
            job.id, model, await self._steps(job.id, 0, current.microbatches), path, sha
        )

    async def finetune_steps(self, job_id: str, *, offset: int = 0) -> list[FinetuneStep]:
        """The steps a fine-tune job has done so far (from `offset` on)."""
        return await self._steps(job_id, offset, (await self.job(job_id)).microbatches)

    async def _steps(self, job_id: str, offset: int, total: int) -> list[FinetuneStep]:
        out = await self._call(
            "GET",
            f"/v1/jobs/{quote_part(job_id)}/results?offset={offset}&limit=10000",
            FinetuneResults,
        )
        return [
            FinetuneStep(s.step, total, math.nan if s.loss is None else s.loss, s.tokens, s.seconds)
            for s in out.steps
        ]

    async def adapter(self, job_id: str) -> Path:
        """A fine-tune job's trained adapter (safetensors), downloaded once into the cache."""
        path, _ = await self._download_adapter(job_id)
        return path

    async def _download_adapter(self, job_id: str) -> tuple[Path, str]:
        results = f"/v1/jobs/{quote_part(job_id)}/results?limit=1"
        adapter = (await self._call("GET", results, _AdapterOf)).adapter
        if adapter is None:
            raise FusionAIError(f"job {job_id} has no adapter (is it a finished fine-tune job?)")
        sha = adapter.sha256
        path = self.cache_dir / "adapters" / f"{sha}.safetensors"
        url = f"/v1/jobs/{quote_part(job_id)}/adapter"
        await self._fetch(path, sha, url, f"job {job_id}'s adapter")
        return path, sha

    async def _adapter_tensors(self, adapter: str | Path, model: str) -> dict[str, Array]:
        """An adapter's tensors, checked against the model it is applied to."""
        path = Path(adapter)
        is_file = await asyncio.to_thread(path.is_file)
        if not (isinstance(adapter, Path) or path.suffix == ".safetensors" or is_file):
            path = await self.adapter(str(adapter))  # a fine-tune job's id
        return await asyncio.to_thread(load_adapter, path, model)
