"""Serving loaded stages: forward requests and generation sessions with per-session KV caches.

Runs in the p2p layer's worker threads (compute handlers), so everything here is thread-safe
and synchronous. Admission is bounded: past `max_queue` requests in flight (or `per_peer` from
one peer) a request is answered `busy` at once instead of queueing without bound; training
work may use only half the queue, so inference goes first. Sessions belong to the peer that
opened them, expire after `idle_timeout_s`, and their caches together stay under
`kv_budget_bytes` (a step that would exceed it is answered `busy`, its session intact).

Admitted requests then wait for one of `compute_slots` execution slots (default 1): the
executor already uses every core (or the GPU) for one run, and more runs at once on the same
cores only thrash their caches (measured: 12 MiniLM stage runs at once on 2 cores cost 43 %
more CPU than 3). Waiting requests take a free slot in priority order: session steps
(interactive), then forward requests, then training work; first come, first served within one.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from ir.errors import ExecutorError
from ir.executors.base import Executor
from ir.manifest import StageInfo
from ir.pipeline import zero_adapters
from ir.training import TrainingError, check_adapters
from p2p import ErrorCode, P2PError, Refused, Relay, RemoteError, RequestTimeout, Tensor, verify
from proto.forward import (
    BAD_ANSWER,
    CHAIN,
    FORWARD,
    MAX_HOPS,
    ROUTE_DOMAIN,
    TIMEOUT,
    UNREACHABLE,
    ChainAccepted,
    ChainBroken,
    ChainResult,
    Forward,
    ForwardResult,
    Hop,
    HopDone,
    route_bytes,
)
from proto.session import (
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionOutput,
    SessionStep,
)

log = logging.getLogger(__name__)
Array = np.ndarray[Any, Any]
MAX_SESSION_ID = 128  # characters
SWEEP_EVERY_S = 1.0  # idle sessions are looked for at most this often (and every heartbeat)


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
class _Session:
    peer: str
    stage: str
    batch: int
    cache: dict[str, Array]
    adapters: dict[str, Array] = field(default_factory=dict)
    check: bool = False  # a shadow session: it may run on a standby stage
    past_len: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache.values())


class Priority(IntEnum):
    """Who takes a free compute slot first (lowest value)."""

    SESSION = 0  # interactive: a generation step
    FORWARD = 1  # batch inference
    TRAINING = 2


class ComputeGate:
    """`slots` executions at once; waiters take a free slot by (priority, arrival)."""

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"compute slots must be >= 1, got {slots}")
        self.slots = slots
        self._busy = 0
        self._waiting: list[tuple[int, int]] = []  # heap of (priority, ticket)
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    @contextmanager
    def slot(self, priority: Priority) -> Iterator[None]:
        with self._cond:
            me = (priority, next(self._tickets))
            heapq.heappush(self._waiting, me)
            try:
                while self._busy >= self.slots or self._waiting[0] != me:
                    self._cond.wait()
                self._busy += 1
            finally:
                self._waiting.remove(me)
                heapq.heapify(self._waiting)
                self._cond.notify_all()  # the next in line may take another free slot
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)


@dataclass(frozen=True)
class Fault:
    """Deterministic faults for tests (hidden `--fault` option)."""

    die_at_step: int | None = None  # exit the process when serving this request (1-based)
    wrong_output: bool = False  # add 1 to every floating-point output
    slow_ms: float = 0.0  # sleep this long before each answer
    drop: bool = False  # never answer (the caller times out)
    on: str | None = None  # die-at-step, slow, drop: this stage key only (not wrong-output)

    @classmethod
    def parse(cls, text: str | None) -> Fault | None:
        if not text:
            return None
        values: dict[str, Any] = {}
        for part in text.split(","):
            name, _, value = part.strip().partition("=")
            if name == "die-at-step" and value.isdigit() and int(value) > 0:
                values["die_at_step"] = int(value)
            elif name == "wrong-output" and not value:
                values["wrong_output"] = True
            elif name == "slow" and value.replace(".", "", 1).isdigit():
                values["slow_ms"] = float(value)
            elif name == "drop" and not value:
                values["drop"] = True
            elif name == "on" and value:
                values["on"] = value
            else:
                raise ValueError(
                    f"unknown fault {part!r}; use die-at-step=N, wrong-output, slow=MS, drop "
                    f"and on=STAGE_KEY"
                )
        return cls(**values)


class Server:
    def __init__(
        self,
        *,
        max_queue: int = 32,
        per_peer: int = 8,
        kv_budget_bytes: int = 1 << 30,
        idle_timeout_s: float = 300.0,
        fault: Fault | None = None,
        sessions_per_peer: int = 64,
        max_sessions: int = 1024,
        compute_slots: int = 1,
    ) -> None:
        self.sessions_per_peer = sessions_per_peer
        self.max_sessions = max_sessions
        self.max_queue = max_queue
        self.per_peer = per_peer
        self.kv_budget = kv_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self.fault = fault
        self.gate = ComputeGate(compute_slots)
        self.peer_id = ""  # ours and our broker's, once the host runs: chained requests
        self.broker_id = ""  # are accepted only along a route the broker signed
        self.stages: dict[str, LoadedStage] = {}
        self.sessions: dict[tuple[str, str, str], _Session] = {}  # (peer, stage, session)
        self.draining = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._relaying = 0  # chained requests computed here, waiting on the hops after us
        self._per_peer: dict[str, int] = {}
        self._served = 0
        self._last_sweep = 0.0  # when idle sessions were last expired
        self._fault_count = 0  # requests counted by a fault limited to one stage
        self._stopped = threading.Event()  # releases dropped requests at shutdown

    # ---- stages ----------------------------------------------------------------------------

    def add(self, stage: LoadedStage) -> None:
        with self._lock:
            self.stages[stage.key] = stage

    def remove(self, key: str) -> LoadedStage | None:
        with self._lock:
            stage = self.stages.pop(key, None)
            for k in [k for k, s in self.sessions.items() if s.stage == key]:
                del self.sessions[k]
        return stage

    def promote(self, key: str) -> bool:
        with self._lock:
            stage = self.stages.get(key)
            if stage is None:
                return False
            stage.role = "active"
            return True

    def _stage(self, key: str, check: bool = False) -> LoadedStage:
        """The stage `key`, if it serves (or, for a spot check, stands by) here."""
        stage = self.stages.get(key)
        if stage is None:
            raise Refused(ErrorCode.NOT_FOUND, f"stage {key!r} is not loaded here")
        if stage.role != "active" and not check:
            raise Refused(ErrorCode.REFUSED, f"stage {key!r} is on standby here, not serving")
        return stage

    # ---- admission -------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextmanager
    def _admit(self, peer: str, training: bool = False) -> Iterator[int]:
        with self._lock:
            if self.draining:
                raise Refused(
                    ErrorCode.BUSY, "this provider is leaving; send the request elsewhere"
                )
            limit = self.max_queue // 2 if training else self.max_queue
            if self._in_flight >= limit:
                raise Refused(
                    ErrorCode.BUSY, f"queue full ({self._in_flight} requests); retry later"
                )
            if self._per_peer.get(peer, 0) >= self.per_peer:
                raise Refused(
                    ErrorCode.BUSY, f"too many requests from you at once (limit {self.per_peer})"
                )
            self._in_flight += 1
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            self._served += 1
            number = self._served
        try:
            yield number
        finally:
            with self._lock:
                self._in_flight -= 1
                left = self._per_peer[peer] - 1
                if left:
                    self._per_peer[peer] = left
                else:
                    del self._per_peer[peer]
                self._idle.notify_all()

    def drain(self, deadline_s: float) -> bool:
        """Refuse new work and wait up to `deadline_s` for requests in flight; True if none
        is left."""
        end = time.monotonic() + deadline_s
        with self._lock:
            self.draining = True
            while self._in_flight or self._relaying:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self) -> None:
        self._stopped.set()

    def _apply_fault(self, number: int, stage: str) -> None:
        f = self.fault
        if f is None:
            return
        if f.on is not None:  # count this stage's requests only
            if stage != f.on:
                return
            with self._lock:
                self._fault_count += 1
                number = self._fault_count
        if f.die_at_step is not None and number >= f.die_at_step:
            log.error("fault injection: dying at request %d", number)
            os._exit(137)
        if f.slow_ms:
            time.sleep(f.slow_ms / 1e3)
        if f.drop:
            self._stopped.wait()
            raise Refused(ErrorCode.SHUTTING_DOWN, "the provider is closing")

    def _faulty(self, outputs: dict[str, Array]) -> dict[str, Array]:
        if self.fault is not None and self.fault.wrong_output:
            return {
                k: (v + 1).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v
                for k, v in outputs.items()
            }
        return outputs

    def _outputs(self, outputs: dict[str, Array]) -> dict[str, Tensor]:
        return _tensors(self._faulty(outputs))

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, peer: str, request: Forward) -> ForwardResult | Relay:
        if request.route:
            return self._chained(peer, request)
        stage = self._forward_stage(request.stage, request.check)
        outputs, ms = self._run_forward(peer, stage, _arrays(request.inputs), request.training)
        return ForwardResult(outputs=self._outputs(outputs), compute_ms=ms)

    def _forward_stage(self, key: str, check: bool = False) -> LoadedStage:
        stage = self._stage(key, check)
        if stage.cache_inputs:
            raise Refused(
                ErrorCode.REFUSED, f"stage {key!r} keeps a KV cache: use a generation session"
            )
        return stage

    def _run_forward(
        self, peer: str, stage: LoadedStage, feeds: dict[str, Array], training: bool
    ) -> tuple[dict[str, Array], float]:
        """Admit, wait for a compute slot, run: (outputs, milliseconds the run took)."""
        with self._admit(peer, training) as number:
            self._apply_fault(number, stage.key)
            stage.with_adapters(feeds, {})
            with self.gate.slot(Priority.TRAINING if training else Priority.FORWARD):
                start = time.perf_counter()
                outputs = _run(stage.executor, feeds)
                return outputs, (time.perf_counter() - start) * 1e3

    def _chained(self, peer: str, request: Forward) -> Relay:
        """Run this hop of a chain (and the next ones if they are ours too), then relay the
        hidden states to the next hop's provider, or the outputs to the broker."""
        route, i = request.route, request.hop
        if not self.broker_id:
            raise Refused(ErrorCode.REFUSED, "this provider takes no chained requests")
        if len(route) > MAX_HOPS or not 0 <= i < len(route):
            raise Refused(ErrorCode.REFUSED, f"a route has 1 to {MAX_HOPS} hops, hop within it")
        if route[i].peer != self.peer_id or route[i].stage != request.stage:
            raise Refused(ErrorCode.REFUSED, f"hop {i} of this route is not this provider's")
        if peer != (self.broker_id if i == 0 else route[i - 1].peer):
            raise Refused(ErrorCode.REFUSED, f"hop {i} of this route comes from another peer")
        if request.expires < time.time():
            raise Refused(ErrorCode.REFUSED, "the route has expired")
        signed = route_bytes(request.chain, route, request.expires)
        if not verify(self.broker_id, signed, request.signature, domain=ROUTE_DOMAIN):
            raise Refused(ErrorCode.REFUSED, "the route is not signed by this provider's broker")
        feeds = _arrays(request.inputs)
        done: list[HopDone] = []
        while True:  # this hop, and the following ones while they are ours
            stage = self._forward_stage(route[i].stage)
            names = {t.name for t in stage.info.inputs}
            run = {k: v for k, v in feeds.items() if k in names}
            outputs, ms = self._run_forward(peer, stage, run, request.training)
            hidden = self._faulty(outputs).get("hidden_states_out")
            if hidden is None:
                raise Refused(ErrorCode.REFUSED, f"stage {stage.key!r} has no hidden_states_out")
            done.append(HopDone(self.peer_id, stage.key, ms))
            feeds = {**feeds, "hidden_states": hidden}
            if i + 1 == len(route) or route[i + 1].peer != self.peer_id:
                break
            i += 1
        tensors = _tensors(feeds)
        timeout = max(request.expires - time.time(), 1.0)
        with self._lock:  # a drain waits for the rest of the route too
            self._relaying += 1
        if i + 1 == len(route):  # the last hop: the outputs go to the broker
            result = ChainResult(
                chain=request.chain, outputs={"hidden_states_out": tensors["hidden_states"]}
            )
            finish = _finish(done, None, self._relayed)
            return Relay(self.broker_id, [], CHAIN, result, timeout, finish)
        nxt = route[i + 1]
        message = Forward(
            stage=nxt.stage,
            inputs=tensors,
            training=request.training,
            chain=request.chain,
            route=route,
            hop=i + 1,
            expires=request.expires,
            signature=request.signature,
        )
        return Relay(
            nxt.peer, nxt.addrs, FORWARD, message, timeout, _finish(done, nxt, self._relayed)
        )

    def _relayed(self) -> None:
        with self._lock:
            self._relaying -= 1
            self._idle.notify_all()

    # ---- sessions --------------------------------------------------------------------------

    def session(
        self, peer: str, request: SessionOpen | SessionStep | SessionClose
    ) -> SessionOpened | SessionOutput | SessionClosed:
        if time.monotonic() - self._last_sweep >= SWEEP_EVERY_S:  # not a scan per request
            self.expire()
        if isinstance(request, SessionOpen):
            return self._open(peer, request)
        if isinstance(request, SessionClose):
            with self._lock:
                self.sessions.pop((peer, request.stage, request.session), None)
            return SessionClosed(session=request.session)
        return self._step(peer, request)

    def _open(self, peer: str, request: SessionOpen) -> SessionOpened:
        if not 1 <= len(request.session) <= MAX_SESSION_ID:
            raise Refused(ErrorCode.REFUSED, f"a session id has 1 to {MAX_SESSION_ID} characters")
        stage = self._stage(request.stage, request.check)
        if not stage.cache_inputs:
            raise Refused(ErrorCode.REFUSED, f"stage {request.stage!r} keeps no KV cache")
        if not 1 <= request.batch <= 1024:
            raise Refused(ErrorCode.REFUSED, f"batch must be 1 to 1024, got {request.batch}")
        adapters = _arrays(request.adapters)
        if adapters:
            try:
                check_adapters(stage.info, adapters)
            except TrainingError as exc:
                raise Refused(ErrorCode.REFUSED, f"adapter refused: {exc}") from None
        cache = {}
        for info in stage.info.inputs:
            if info.name.startswith("past_"):
                # the batch as asked, no tokens cached yet ("past" and other symbols: 0)
                shape: list[int] = [
                    request.batch if d == "batch" else (0 if isinstance(d, str) else d)
                    for d in info.shape
                ]
                cache[info.name] = np.zeros(shape, dtype=info.dtype)
        with self._lock:
            if self.draining:
                raise Refused(
                    ErrorCode.BUSY, "this provider is leaving; open the session elsewhere"
                )
            key = (peer, request.stage, request.session)
            mine = sum(1 for k in self.sessions if k[0] == peer)
            if mine >= self.sessions_per_peer or len(self.sessions) >= self.max_sessions:
                raise Refused(
                    ErrorCode.BUSY,
                    f"too many open sessions ({mine} of yours, {len(self.sessions)} in all; "
                    f"limits {self.sessions_per_peer} and {self.max_sessions}): close some",
                )
            if key in self.sessions:
                raise Refused(ErrorCode.REFUSED, f"session {request.session!r} is already open")
            self.sessions[key] = _Session(
                peer, request.stage, request.batch, cache, adapters, check=request.check
            )
        return SessionOpened(session=request.session, idle_timeout_s=self.idle_timeout_s)

    def _step(self, peer: str, request: SessionStep) -> SessionOutput:
        with self._lock:
            session = self.sessions.get((peer, request.stage, request.session))
        if session is None:
            raise Refused(
                ErrorCode.NOT_FOUND,
                f"no session {request.session!r} here (never opened, closed, or expired after "
                f"{self.idle_timeout_s:g} s idle): open it again and replay its history",
            )
        stage = self._stage(session.stage, session.check)
        sent_cache = [n for n in request.inputs if n.startswith("past_")]
        if sent_cache:
            raise Refused(ErrorCode.REFUSED, f"the provider keeps {sent_cache} itself")
        with self._admit(peer) as number, session.lock:
            session.last_used = time.monotonic()  # in use: not idle, whatever the step takes
            self._apply_fault(number, session.stage)
            feeds = {**_arrays(request.inputs), **session.cache}
            stage.with_adapters(feeds, session.adapters)
            with self.gate.slot(Priority.SESSION):
                outputs = _run(stage.executor, feeds)
            new_cache = {
                name.replace("present_", "past_", 1): value
                for name, value in outputs.items()
                if name.startswith("present_")
            }
            new_bytes = sum(a.nbytes for a in new_cache.values())
            with self._lock:
                others = sum(s.nbytes for s in self.sessions.values() if s is not session)
                if others + new_bytes > self.kv_budget:
                    raise Refused(
                        ErrorCode.BUSY,
                        f"KV cache memory full ({others + new_bytes} of {self.kv_budget} "
                        f"bytes); the session is unchanged: retry later or elsewhere",
                    )
                session.cache = new_cache
                if new_cache:  # (batch, heads, tokens, head_dim)
                    session.past_len = int(next(iter(new_cache.values())).shape[2])
                session.last_used = time.monotonic()
        visible = {k: v for k, v in outputs.items() if not k.startswith("present_")}
        return SessionOutput(
            session=request.session, outputs=self._outputs(visible), past_len=session.past_len
        )

    def expire(self) -> int:
        """Drop sessions idle longer than the timeout; returns how many."""
        self._last_sweep = time.monotonic()
        cutoff = self._last_sweep - self.idle_timeout_s
        with self._lock:
            old = [
                k
                for k, s in self.sessions.items()
                if s.last_used < cutoff and not s.lock.locked()  # a step in progress is use
            ]
            for k in old:
                del self.sessions[k]
        return len(old)

    def kv_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.sessions.values())


def _finish(
    done: list[HopDone], nxt: Hop | None, relayed: Callable[[], None]
) -> Callable[[Any], ForwardResult | ChainBroken]:
    """How a chain hop answers once the next hop (`nxt`; None: the broker) has answered."""

    relaying = True

    def finish(outcome: Any) -> ForwardResult | ChainBroken:
        nonlocal relaying
        if relaying:  # the relay is over: counted once, however often asked
            relaying = False
            relayed()
        if isinstance(outcome, ChainBroken):  # further down the route
            return outcome
        if isinstance(outcome, ForwardResult):
            return ForwardResult(outputs={}, hops=[*done, *outcome.hops])
        if isinstance(outcome, ChainAccepted):
            return ForwardResult(outputs={}, hops=done)
        peer, stage = (nxt.peer, nxt.stage) if nxt else ("", "")  # "": the broker itself
        if isinstance(outcome, RemoteError):
            return ChainBroken(peer, stage, str(outcome.code), str(outcome))
        if isinstance(outcome, RequestTimeout):
            return ChainBroken(peer, stage, TIMEOUT, str(outcome))
        if isinstance(outcome, P2PError):
            return ChainBroken(peer, stage, UNREACHABLE, str(outcome))
        return ChainBroken(peer, stage, BAD_ANSWER, f"unexpected {type(outcome).__name__}")

    return finish


def _tensors(arrays: dict[str, Array]) -> dict[str, Tensor]:
    return {k: Tensor.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def _arrays(tensors: dict[str, Tensor]) -> dict[str, Array]:
    try:
        return {k: t.to_numpy() for k, t in tensors.items()}
    except ValueError as exc:
        raise Refused(ErrorCode.REFUSED, f"bad tensor: {exc}") from None


def _run(executor: Executor, feeds: dict[str, Array]) -> dict[str, Array]:
    try:
        return executor.run(feeds)
    except ExecutorError as exc:
        raise Refused(ErrorCode.REFUSED, str(exc)) from None
