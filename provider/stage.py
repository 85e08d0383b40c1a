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


@dataclass(eq=False)  # compared by identity
class SharedRows:
    """The KV caches of the sessions of one batched run, left batched for their next run
    (`provider/batching.py`): row i holds its session's `lengths[i]` tokens first, then
    padding (zeros, or whatever earlier steps left there; the attention mask hides it),
    where the next run writes its new tokens in place if there is room."""

    arrays: dict[str, Array]  # past_* name -> (rows, heads, width, head_dim)
    lengths: list[int]
    row_bytes: int  # bytes a row takes in all of `arrays`, padding included (what each
    # session's cache is counted as against the KV budget)

    def view(self, i: int) -> dict[str, Array]:
        """Row `i`'s cache: (1, heads, its tokens, head_dim), views of the shared arrays."""
        n = self.lengths[i]
        return {k: v[i : i + 1, :, :n] for k, v in self.arrays.items()}

    def row(self, i: int) -> dict[str, Array]:
        """Row `i`'s cache on its own (copies: a step may write into its own cache)."""
        return {k: v.copy() for k, v in self.view(i).items()}


@dataclass
class Session:
    """One generation session on one stage: its KV cache, owned by the peer that opened it.

    The cache is either the session's own arrays (`kv`) or a row of the shared arrays its
    last batched run left (`shared`: a batch of the same sessions runs on them as they are,
    with no copy); reading `cache` takes the row out (a copy) and keeps it as its own."""

    peer: str
    stage: str
    batch: int
    kv: dict[str, Array]
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
    counted: int = 0  # bytes counted against the KV budget for its cache (a shared row's
    # padding included) and trail, as its last step left them (server's lock)
    shared: tuple[SharedRows, int] | None = None  # (the run's arrays, its row): see above
    route_key: bytes = b""  # the key its owner tags its chained steps with (or none)

    @property
    def cache(self) -> dict[str, Array]:
        if self.shared is not None:
            rows, i = self.shared
            self.kv, self.shared = rows.row(i), None
        return self.kv

    @cache.setter
    def cache(self, arrays: dict[str, Array]) -> None:
        self.kv, self.shared = arrays, None

    def peek(self) -> dict[str, Array]:
        """Its cache's arrays to read from, without taking a shared row out (views)."""
        if self.shared is not None:
            return self.shared[0].view(self.shared[1])
        return self.kv


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
