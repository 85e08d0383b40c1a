"""A stage loaded on this provider, a generation session's state, and the conversions between
wire tensors and arrays that every handler uses (a bad tensor or a failed run is refused with
the reason, never an exception that kills the connection)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ir.errors import ExecutorError
from ir.executors.base import Executor
from ir.manifest import StageInfo
from ir.pipeline import zero_adapters
from p2p import ErrorCode, Refused, Tensor
from p2p.tensor import encode
from provider.commitments import Ledger

HIDDEN = ("hidden_states", "hidden_states_out")  # what travels in the package's wire format

Array = np.ndarray[Any, Any]


@dataclass
class LoadedStage:
    key: str
    info: StageInfo
    executor: Executor
    role: str  # "active" serves; "backup" stands by until promoted
    load_s: float = 0.0

    @property
    def cache_inputs(self) -> list[str]:
        return [i.name for i in self.info.inputs if i.name.startswith("past_")]

    def with_adapters(self, feeds: dict[str, Array], adapters: dict[str, Array]) -> None:
        """Feed `adapters`, or zero adapters (the base model) where the caller sent none."""
        if self.info.adapters and not any(a.b_input in feeds for a in self.info.adapters):
            feeds.update(adapters or zero_adapters(self.info))


@dataclass
class Session:
    """One generation session on one stage: its KV cache, owned by the peer that opened it."""

    peer: str
    stage: str
    batch: int
    cache: dict[str, Array]
    adapters: dict[str, Array] = field(default_factory=dict)
    check: bool = False  # a shadow session: it may run on a standby stage
    past_len: int = 0
    last_used: float = field(default_factory=time.monotonic)
    stepping: bool = False  # a step is admitted (one at a time; guarded by the server's lock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # the outputs so far, one entry a step (wire tensors): what the next stage replays from
    trail: list[Tensor] = field(default_factory=list)
    last: tuple[int, Any] | None = None  # (tokens cached before it, answer) of the last step
    ledger: Ledger | None = None  # its signed commitments (a session of batch 1)
    dropped: bool = False  # closed or dropped: its bytes no longer counted (server's lock)
    trail_bytes: int = 0  # what its trail holds (kept as it grows: a sum over it each step
    # would cost a step time in proportion to the tokens so far)

    @property
    def nbytes(self) -> int:
        """Bytes its cache and its trail of outputs hold."""
        return sum(a.nbytes for a in self.cache.values()) + self.trail_bytes


def tensors(arrays: dict[str, Array], wire: str = "native") -> dict[str, Tensor]:
    """Outputs for the wire: hidden states in `wire` format, the rest as they are."""
    return {
        k: encode(np.ascontiguousarray(v), wire if k in HIDDEN else "native")
        for k, v in arrays.items()
    }


def wire_of(inputs: dict[str, Tensor]) -> str:
    """The wire format the hidden states came in: the answer's go back in it."""
    hidden = inputs.get("hidden_states")
    return hidden.wire if hidden is not None else "native"


def arrays(wire: dict[str, Tensor]) -> dict[str, Array]:
    try:
        return {k: t.to_numpy() for k, t in wire.items()}
    except ValueError as exc:
        raise Refused(ErrorCode.REFUSED, f"bad tensor: {exc}") from None


def run(executor: Executor, feeds: dict[str, Array]) -> dict[str, Array]:
    try:
        return executor.run(feeds)
    except ExecutorError as exc:
        raise Refused(ErrorCode.REFUSED, str(exc)) from None
