"""A pre-training run of K replicas in this process: each replica's step as it runs on a
provider (`ir.pretrain.DataParallel`), the ring all-reduce between them over queues
(`dag.collective.LocalRing`). With K = 1 it is the single-process reference that runs of K
replicas must match; it is also what `fusionai train --local` and the benchmark run. A provider
runs the same `DataParallel` step with the ring over the p2p layer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dag.collective import LocalRing, ring_allreduce
from ir.compress import AllReduce, check_compressor, make_compressor
from ir.pretrain import DataParallel, PretrainError, Replica
from ir.scratch import Corpus

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch: int = 12  # global batch (rows); divisible by 2 and 3
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 10
    compress: str = "none"
    rank: int = 4
    outer_every: int = 0  # DiLoCo's H (0: synchronous)
    start_after: int = 0  # steps all-reduced uncompressed first
    seed: int = 0

    def check(self, replicas: int) -> None:
        if self.steps < 1:
            raise PretrainError(f"steps must be at least 1 (it was {self.steps})")
        if replicas < 1:
            raise PretrainError(f"replicas must be at least 1 (it was {replicas})")
        if self.batch < replicas:
            raise PretrainError(
                f"a global batch of {self.batch} rows cannot be shared by {replicas} replicas"
            )
        if self.outer_every < 0 or self.start_after < 0:
            raise PretrainError("outer_every and start_after are 0 or more")
        if not self.lr > 0:
            raise PretrainError(f"lr must be positive (it was {self.lr})")
        check_compressor(self.compress, self.rank)


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float  # the global batch's mean token loss
    seconds: float
    bytes_sent: int  # by one replica in this step's all-reduces (ring traffic)
    payload_bytes: int  # the compressed buffers one replica handed to the all-reduces


class LocalRun:
    """K replicas of `package` training on `corpus` in this process."""

    def __init__(
        self, package: Path, corpus: Corpus, replicas: int, settings: TrainSettings
    ) -> None:
        settings.check(replicas)
        self.settings, self.corpus, self.size = settings, corpus, replicas
        self.replicas = [
            Replica(package, lr=settings.lr, warmup=settings.warmup, total_steps=settings.steps)
            for _ in range(replicas)
        ]
        shapes = self.replicas[0].shapes()
        self.parallel = [
            DataParallel(
                r,
                make_compressor(
                    settings.compress,
                    shapes,
                    replicas=replicas,
                    rank=settings.rank,
                    seed=settings.seed,
                ),
                i,
                replicas,
                outer_every=settings.outer_every,
                start_after=settings.start_after,
            )
            for i, r in enumerate(self.replicas)
        ]
        self.ring = LocalRing(replicas)
        self.rounds = [0] * replicas
        self.records: list[StepRecord] = []

    def _allreduce(self, rank: int) -> AllReduce:
        async def one(buffer: Array, wire: str) -> Array:
            self.rounds[rank] += 1
            return await ring_allreduce(
                buffer, rank, self.size, self.ring.links(rank), self.rounds[rank], wire
            )

        return one

    async def step(self) -> StepRecord:
        s = self.settings
        step = self.replicas[0].step + 1
        rows = self.corpus.batch(step, s.batch)
        sent, payload = self.ring.sent[0], self.parallel[0].sent_values
        started = time.perf_counter()
        losses = await asyncio.gather(
            *(p.step(rows, s.seq_len, self._allreduce(i)) for i, p in enumerate(self.parallel))
        )
        width = 2 if self.parallel[0].compressor.wire == "float16" else 4
        record = StepRecord(
            step=step,
            loss=float(sum(losses)),
            seconds=time.perf_counter() - started,
            bytes_sent=self.ring.sent[0] - sent,
            payload_bytes=width * (self.parallel[0].sent_values - payload),
        )
        self.records.append(record)
        return record

    def run(
        self, steps: int | None = None, progress: Callable[[StepRecord], None] | None = None
    ) -> list[StepRecord]:
        async def go() -> list[StepRecord]:
            out = []
            for _ in range(steps or self.settings.steps):
                record = await self.step()
                out.append(record)
                if progress is not None:
                    progress(record)
            return out

        return asyncio.run(go())

    def validation_loss(self, rows: int = 32) -> float:
        return self.replicas[0].evaluate(self.corpus.val[:rows])

    def identical(self) -> bool:
        """Whether every replica holds the very same weights."""
        first = self.replicas[0].weights()
        return all(
            all(np.array_equal(first[n], w[n]) for n in first)
            for w in (r.weights() for r in self.replicas[1:])
        )
