"""The swarm side of a fine-tune job: its stages on the providers of its route, called with
`proto.train` requests (open, forward, backward, update), each failure a `StageFailed` that
names the stage, so the job can recover it (`swarm.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from broker.calls import StageCalls
from broker.config import BrokerConfig
from broker.events import EventLog
from broker.finetune.request import FinetuneRequest, trainable_stages
from broker.jobkinds import JobFailed, Ref
from broker.models import ModelStore
from broker.schema import JobRow
from broker.serving import Serving
from broker.store import Store
from ir.training import (
    init_adapters,
)
from p2p import ErrorCode, P2PError, RemoteError, RequestTimeout, Tensor
from p2p.codec import Message, ProtocolSpec
from proto.train import (
    TRAIN,
    TrainBackward,
    TrainForward,
    TrainOpen,
    TrainOutput,
    TrainUpdate,
    TrainUpdated,
)


class JobParts(Protocol):
    """What a fine-tune job uses of the broker (its job kind provides it)."""

    config: BrokerConfig
    store: Store
    events: EventLog
    serving: Serving
    models: ModelStore
    calls: StageCalls

    def save_adapter(self, job_id: str, model: str, data: bytes) -> None: ...


Array = np.ndarray[Any, Any]


class StageFailed(Exception):
    def __init__(self, pos: int, peer: str, reason: str) -> None:
        super().__init__(f"stage {pos} on {peer[:12]}: {reason}")
        self.pos, self.peer, self.reason = pos, peer, reason


class SwarmStages:
    """A fine-tune job's stages on the providers of its route: training requests to them
    (the step executor's `Backend`), each failure a `StageFailed` naming the stage."""

    def __init__(self, kind: JobParts, job: JobRow) -> None:
        self.kind = kind
        self.calls = kind.calls
        self.clock = kind.serving.clock
        self.config = kind.config
        self.store = kind.store
        self.events = kind.events
        self.serving = kind.serving
        self.host = kind.calls.host
        self.job = job
        self.request = FinetuneRequest.from_json(job.request)
        self.model = kind.models.models[job.model]
        self.stages = trainable_stages(self.model.manifest)
        self.keys = [self.model.unit_key(u) for u in self.model.units]
        self.route: list[str] = []
        self.snapshotting: asyncio.Task[None] | None = None
        self.recoveries = 0
        self.committed = 0  # the newest snapshot every stage completed
        self.touched: set[str] = set()  # every provider this job used: closed at the end

    # ---- requests to providers -------------------------------------------------------------

    async def _call(self, pos: int, spec: ProtocolSpec, msg: Message, timeout: float) -> Any:
        """A request to the provider training stage `pos`; `StageFailed` if it cannot serve."""
        peer = self.route[pos]
        self.touched.add(peer)
        deadline = self.clock() + self.config.request_timeout_s
        while True:
            call = await self.calls.request_unless_lost(peer, spec, msg, timeout)
            if call is None:
                raise StageFailed(pos, peer, "the provider was declared lost")
            try:
                return call.result()
            except RemoteError as exc:
                if exc.code == ErrorCode.BUSY and self.clock() < deadline:
                    await asyncio.sleep(0.2)  # inference goes first; training waits its turn
                    continue
                raise StageFailed(pos, peer, f"{exc.code}: {exc}") from None
            except RequestTimeout as exc:
                await self.serving.suspect(peer, "a training request timed out")
                raise StageFailed(pos, peer, str(exc)) from None
            except P2PError as exc:
                await self.serving.suspect(peer, f"a training request failed: {exc}")
                raise StageFailed(pos, peer, str(exc)) from None

    async def forward(self, pos: int, step: int, mb: int, inputs: dict[str, Array]) -> Array:
        msg = TrainForward(
            job=self.job.id,
            stage=self.keys[pos],
            step=step,
            microbatch=mb,
            inputs={k: Tensor.from_numpy(v) for k, v in inputs.items()},
        )
        out: TrainOutput = await self._call(pos, TRAIN, msg, self.config.request_timeout_s)
        if out.output is None:
            raise StageFailed(pos, self.route[pos], "the answer has no hidden states")
        return out.output.to_numpy()

    async def backward(
        self, pos: int, step: int, mb: int, grad: Array, input_grad: bool
    ) -> Array | None:
        msg = TrainBackward(
            job=self.job.id,
            stage=self.keys[pos],
            step=step,
            microbatch=mb,
            grad=Tensor.from_numpy(grad),
            input_grad=input_grad,
        )
        out: TrainOutput = await self._call(pos, TRAIN, msg, self.config.request_timeout_s)
        if input_grad and out.output is None:
            raise StageFailed(pos, self.route[pos], "the answer has no input gradient")
        return out.output.to_numpy() if out.output is not None else None

    async def update(self, pos: int, step: int) -> float:
        every = self.request.snapshot_every
        msg = TrainUpdate(
            job=self.job.id,
            stage=self.keys[pos],
            step=step,
            keep=bool(every and step % every == 0),
            committed=self.committed,
        )
        out: TrainUpdated = await self._call(pos, TRAIN, msg, self.config.request_timeout_s)
        return out.grad_norm

    def _open(self, pos: int, adapters: bool = True) -> TrainOpen:
        """The run's settings for stage `pos`, with its initial adapters (or none: a restore
        takes them from the snapshot)."""
        r, info = self.request, self.stages[pos]
        init = init_adapters(info, r.rank, r.seed) if adapters else {}
        return TrainOpen(
            job=self.job.id,
            stage=self.keys[pos],
            method=r.method,
            lr=r.lr,
            weight_decay=r.weight_decay,
            microbatches=r.microbatches,
            adapters={k: Tensor.from_numpy(v) for k, v in init.items()},
        )

    async def _each(self, call: Callable[[int], Awaitable[Any]]) -> list[Any]:
        """`call(pos)` for every stage at once; the first stage failure is raised."""
        results = await asyncio.gather(
            *(call(p) for p in range(len(self.keys))), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if isinstance(e, JobFailed)), errors[0])
        return results

    # ---- route, start, recovery ------------------------------------------------------------

    async def _pick(self, pos: int, avoid: set[str]) -> str:
        return await self.calls.pick(Ref(self.job.id, self.job.model), pos, avoid)
