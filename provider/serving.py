"""Serving loaded stages: forward requests and generation sessions with per-session KV caches.

Runs in the p2p layer's worker threads (compute handlers), so everything here is thread-safe
and synchronous. Admission is bounded: past `max_queue` requests in flight (or `per_peer` from
one peer) a request is answered `busy` at once instead of queueing without bound; training
work may use only half the queue, so inference goes first. Sessions belong to the peer that
opened them, expire after `idle_timeout_s`, and their caches together stay under
`kv_budget_bytes` (a step that would exceed it is answered `busy`, its session intact).

Admitted requests then wait for one of `compute_slots` execution slots (`gate.py`: session
steps first, then forward requests, then training work). Chained requests (`chain.py`) run
this provider's hops of a route the broker signed and relay the rest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ir.training import TrainingError, check_adapters
from p2p import ErrorCode, Refused, Relay, Tensor
from p2p.tensor import through_wire
from proto.forward import (
    CHAIN,
    FORWARD,
    ChainResult,
    Forward,
    ForwardResult,
    HopDone,
)
from proto.session import (
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionOutput,
    SessionStep,
)
from provider.chain import check_route, finisher
from provider.faults import Fault
from provider.gate import ComputeGate, Priority
from provider.stage import Array, LoadedStage, Session, arrays, run, tensors, wire_of

log = logging.getLogger(__name__)
MAX_SESSION_ID = 128  # characters
SWEEP_EVERY_S = 1.0  # idle sessions are looked for at most this often (and every heartbeat)


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
        self.sessions: dict[tuple[str, str, str], Session] = {}  # (peer, stage, session)
        self.draining = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._relaying = 0  # chained requests computed here, waiting on the hops after us
        # called with the next hop's peer and addresses before a chained request goes there
        self.before_relay: Callable[[str, Sequence[str]], None] | None = None
        self._per_peer: dict[str, int] = {}
        self._served = 0
        self.tokens_served = 0  # token positions run through stages here (batch x sequence)
        self.runs = 0  # stage runs done (forward passes and generation steps)
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

    def _outputs(self, outputs: dict[str, Array], wire: str) -> dict[str, Tensor]:
        return tensors(self._faulty(outputs), wire)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, peer: str, request: Forward) -> ForwardResult | Relay:
        if request.route:
            return self._chained(peer, request)
        stage = self._forward_stage(request.stage, request.check)
        outputs, ms = self._run_forward(peer, stage, arrays(request.inputs), request.training)
        return ForwardResult(outputs=self._outputs(outputs, wire_of(request.inputs)), compute_ms=ms)

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
                outputs = run(stage.executor, feeds)
                self._count(feeds)
                return outputs, (time.perf_counter() - start) * 1e3

    def _count(self, feeds: dict[str, Array]) -> None:
        hidden = feeds.get("hidden_states")
        tokens = (
            int(hidden.shape[0] * hidden.shape[1]) if hidden is not None and hidden.ndim > 1 else 0
        )
        with self._lock:
            self.tokens_served += tokens
            self.runs += 1

    def _chained(self, peer: str, request: Forward) -> Relay:
        """Run this hop of a chain (and the next ones if they are ours too), then relay the
        hidden states to the next hop's provider, or the outputs to the broker."""
        check_route(request, peer, self.peer_id, self.broker_id)
        route, i = request.route, request.hop
        feeds, wire = arrays(request.inputs), wire_of(request.inputs)
        done: list[HopDone] = []
        while True:  # this hop, and the following ones while they are ours
            stage = self._forward_stage(route[i].stage)
            names = {t.name for t in stage.info.inputs}
            mine = {k: v for k, v in feeds.items() if k in names}
            outputs, ms = self._run_forward(peer, stage, mine, request.training)
            hidden = self._faulty(outputs).get("hidden_states_out")
            if hidden is None:
                raise Refused(ErrorCode.REFUSED, f"stage {stage.key!r} has no hidden_states_out")
            done.append(HopDone(self.peer_id, stage.key, ms))
            if i + 1 == len(route) or route[i + 1].peer != self.peer_id:
                feeds = {**feeds, "hidden_states": hidden}
                break
            # the next hop is ours too: it gets what it would get from another provider
            feeds = {**feeds, "hidden_states": through_wire(hidden, wire)}
            i += 1
        sent = tensors(feeds, wire)
        timeout = max(request.expires - time.time(), 1.0)
        with self._lock:  # a drain waits for the rest of the route too
            self._relaying += 1
        if i + 1 == len(route):  # the last hop: the outputs go to the broker
            result = ChainResult(
                chain=request.chain, outputs={"hidden_states_out": sent["hidden_states"]}
            )
            finish = finisher(done, None, self._relayed)
            return Relay(self.broker_id, [], CHAIN, result, timeout, finish)
        nxt = route[i + 1]
        if self.before_relay is not None:  # (a hole punch to a peer we have not met yet)
            self.before_relay(nxt.peer, nxt.addrs)
        message = Forward(
            stage=nxt.stage,
            inputs=sent,
            training=request.training,
            chain=request.chain,
            route=route,
            hop=i + 1,
            expires=request.expires,
            signature=request.signature,
        )
        return Relay(
            nxt.peer, nxt.addrs, FORWARD, message, timeout, finisher(done, nxt, self._relayed)
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
        adapters = arrays(request.adapters)
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
            self.sessions[key] = Session(
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
            feeds = {**arrays(request.inputs), **session.cache}
            stage.with_adapters(feeds, session.adapters)
            with self.gate.slot(Priority.SESSION):
                outputs = run(stage.executor, feeds)
            self._count(feeds)
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
            session=request.session,
            outputs=self._outputs(visible, wire_of(request.inputs)),
            past_len=session.past_len,
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
