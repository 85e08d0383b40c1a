"""Serving loaded stages: forward requests and generation sessions with per-session KV caches.

Runs in the p2p layer's worker threads (compute handlers), so everything here is thread-safe
and synchronous. Admission is bounded: past `max_queue` requests in flight (or `per_peer` from
one peer) a request is answered `busy` at once instead of queueing without bound; training
work may use only half the queue, so inference goes first. Session steps are bounded by the
sessions instead (one step of a session at a time; `sessions.py` serves them, with their caches
and the batcher that runs steps of different sessions together, `batching.py`).

Admitted requests then wait for one of `compute_slots` execution slots (`gate.py`: session
steps first, then forward requests, then training work). Chained requests (`chain.py`) run
this provider's hops of a route the broker signed and relay the rest; chained session steps
(`stepchain.py`) those of a route a client signed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import msgspec
import numpy as np

from ir.pipeline import batchable
from p2p import ErrorCode, Message, ProtocolSpec, Refused, Relay, Tensor
from p2p.tensor import through_wire
from proto.forward import (
    CHAIN,
    FORWARD,
    ChainResult,
    Forward,
    ForwardResult,
    Hop,
    HopDone,
)
from proto.heartbeat import StageWork
from proto.session import StepHop, dial_addrs
from provider.batching import Batcher
from provider.chain import check_route, finisher
from provider.commitments import Sign, hop_commitment
from provider.events import event
from provider.faults import Fault
from provider.gate import ComputeGate, Priority
from provider.sessions import SessionServing
from provider.stage import Array, LoadedStage, Session, arrays, run, tensors, wire_of
from provider.stepchain import StepChains

log = logging.getLogger(__name__)


class Server(SessionServing, StepChains):
    """`max_batch`: session steps of one stage run together, up to this many (1: each alone);
    `batch_window_s`: how long a run waits for the sessions expected to join it."""

    def __init__(
        self,
        *,
        max_queue: int = 32,
        per_peer: int = 8,
        kv_budget_bytes: int = 1 << 30,
        idle_timeout_s: float = 300.0,
        fault: Fault | None = None,
        sessions_per_peer: int = 256,
        max_sessions: int = 1024,
        compute_slots: int = 1,
        max_batch: int = 16,
        batch_window_s: float = 0.002,
    ) -> None:
        self.sessions_per_peer = sessions_per_peer
        self.max_sessions = max_sessions
        self.max_queue = max_queue
        self.per_peer = per_peer
        self.kv_budget = kv_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self.fault = fault
        self.gate = ComputeGate(compute_slots)
        self.batcher = Batcher(
            self.gate, self._run_batch, max_batch=max_batch, window_s=batch_window_s
        )
        self.peer_id = ""  # ours and our broker's, once the host runs: chained requests
        self.broker_id = ""  # are accepted only along a route the broker signed
        self.stages: dict[str, LoadedStage] = {}
        self.sessions: dict[tuple[str, str, str], Session] = {}  # (peer, stage, session)
        self.draining = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._relaying = 0  # chained requests computed here, waiting on the hops after us
        # signs a session's commitments with our peer key, once the host runs (None: none made)
        self.sign: Sign | None = None
        # called with the next hop's peer and addresses before a chained request goes there
        self.before_relay: Callable[[str, Sequence[str]], None] | None = None
        self._per_peer: dict[str, int] = {}
        self._served = 0
        self.tokens_served = 0  # token positions run through stages here (batch x sequence)
        self.runs = 0  # stage runs done (forward passes and generation steps)
        self.work: dict[str, StageWork] = {}  # per stage: what the heartbeats report
        self._last_sweep = 0.0  # when idle sessions were last expired
        self._absent: set[str] = set()  # peers with sessions, disconnected at the last sweep
        self._kv_used = 0  # bytes of the sessions' caches (kept up to date under the lock)
        self._fault_count = 0  # requests counted by a fault limited to one stage
        self._stopped = threading.Event()  # releases dropped requests at shutdown

    # ---- stages ----------------------------------------------------------------------------

    def add(self, stage: LoadedStage) -> None:
        with self._lock:
            self.stages[stage.key] = stage
        if stage.cache_inputs and not batchable(stage.info) and self.batcher.max_batch > 1:
            event(
                "unbatched_stage",
                stage=stage.key,
                reason="its package was split before decoder stages took an attention mask: "
                "its sessions run one at a time. Split the model again (fusionai ir split) "
                "and add it again to run them in batches",
            )

    def remove(self, key: str) -> LoadedStage | None:
        with self._lock:
            stage = self.stages.pop(key, None)
            gone = self._taken([k for k, s in self.sessions.items() if s.stage == key])
        self._dropped(gone)
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
    def _admit(
        self, peer: str, training: bool = False, stepping: Session | None = None
    ) -> Iterator[int]:
        """Count a request in (refused as busy past the limits); `stepping`: a step of that
        session, bounded by its one step at a time instead of the queue's limits."""
        with self._lock:
            if self.draining:
                raise Refused(
                    ErrorCode.BUSY, "this provider is leaving; send the request elsewhere"
                )
            if stepping is not None:
                if stepping.stepping:
                    raise Refused(ErrorCode.BUSY, "this session's previous step is still running")
                stepping.stepping = True
            else:
                limit = self.max_queue // 2 if training else self.max_queue
                if self._in_flight >= limit:
                    raise Refused(
                        ErrorCode.BUSY, f"queue full ({self._in_flight} requests); retry later"
                    )
                if self._per_peer.get(peer, 0) >= self.per_peer:
                    raise Refused(
                        ErrorCode.BUSY,
                        f"too many requests from you at once (limit {self.per_peer})",
                    )
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            self._in_flight += 1
            self._served += 1
            number = self._served
        try:
            yield number
        finally:
            with self._lock:
                self._in_flight -= 1
                if stepping is not None:
                    stepping.stepping = False
                else:
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
        outputs, ms = self._run_forward(
            peer, stage, arrays(request.inputs), request.training, check=request.check
        )
        return ForwardResult(outputs=self._outputs(outputs, wire_of(request.inputs)), compute_ms=ms)

    def _forward_stage(self, key: str, check: bool = False) -> LoadedStage:
        stage = self._stage(key, check)
        if stage.cache_inputs:
            raise Refused(
                ErrorCode.REFUSED, f"stage {key!r} keeps a KV cache: use a generation session"
            )
        return stage

    def _run_forward(
        self,
        peer: str,
        stage: LoadedStage,
        feeds: dict[str, Array],
        training: bool,
        *,
        check: bool = False,
    ) -> tuple[dict[str, Array], float]:
        """Admit, wait for a compute slot, run: (outputs, milliseconds the run took). A
        `check` (the broker's second opinion) is not a user's request in the counts."""
        with self._admit(peer, training) as number:
            self._apply_fault(number, stage.key)
            stage.with_adapters(feeds, {})
            with self.gate.slot(Priority.TRAINING if training else Priority.FORWARD):
                start = time.perf_counter()
                outputs = run(stage.executor, feeds)
                seconds = time.perf_counter() - start
                self._count(stage.key, feeds, seconds, requests=0 if check else 1)
                return outputs, seconds * 1e3

    def _count(
        self, key: str, feeds: dict[str, Array], seconds: float, *, requests: int = 0
    ) -> None:
        """Count one executor run of stage `key` that took `seconds` (and the `requests` it
        answered)."""
        hidden = feeds.get("hidden_states")
        tokens = (
            int(hidden.shape[0] * hidden.shape[1]) if hidden is not None and hidden.ndim > 1 else 0
        )
        with self._lock:
            self.tokens_served += tokens
            self.runs += 1
            was = self.work.get(key) or StageWork(key)
            self.work[key] = StageWork(
                key,
                requests=was.requests + requests,
                tokens=was.tokens,
                positions=was.positions + tokens,
                runs=was.runs + 1,
                busy_s=was.busy_s + seconds,
            )

    def served(self, key: str, *, requests: int = 0, tokens: int = 0) -> None:
        """Count a generation session opened on stage `key` (a request) or the `tokens` a
        step of one generated (a row each), for the charts."""
        with self._lock:
            was = self.work.get(key) or StageWork(key)
            self.work[key] = msgspec.structs.replace(
                was, requests=was.requests + requests, tokens=was.tokens + tokens
            )

    def work_done(self) -> list[StageWork]:
        """Each stage's counters, for the heartbeat."""
        with self._lock:
            return sorted(self.work.values(), key=lambda w: w.key)

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
            committed = None
            if self.sign is not None and "hidden_states" in mine:  # (what the next one gets)
                passed, given = through_wire(hidden, wire), mine["hidden_states"]
                committed = hop_commitment(
                    request.chain, i, self.peer_id, stage.key, given, passed, self.sign
                )
            done.append(HopDone(self.peer_id, stage.key, ms, committed))
            if i + 1 == len(route) or route[i + 1].peer != self.peer_id:
                feeds = {**feeds, "hidden_states": hidden}
                break
            # the next hop is ours too: it gets what it would get from another provider
            feeds = {**feeds, "hidden_states": through_wire(hidden, wire)}
            i += 1
        sent = tensors(feeds, wire)
        if i + 1 == len(route):  # the last hop: the outputs go to the broker
            result = ChainResult(
                chain=request.chain, outputs={"hidden_states_out": sent["hidden_states"]}
            )
            return self._pass_on(self.broker_id, CHAIN, result, request.expires, done, None)
        nxt = route[i + 1]
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
        return self._pass_on(nxt.peer, FORWARD, message, request.expires, done, nxt)

    def _pass_on(
        self,
        peer: str,
        spec: ProtocolSpec,
        message: Message,
        expires: float,
        done: list[HopDone],
        nxt: Hop | StepHop | None,
    ) -> Relay:
        """A chain hop's `Relay` of `message` to `peer` (the next hop `nxt`, or None: the end
        of the route), counted until it is answered: a drain waits for the rest of the route
        too."""
        with self._lock:
            self._relaying += 1
        addrs = dial_addrs(nxt.peer, nxt.addrs) if nxt is not None else []
        if nxt is not None and self.before_relay is not None:  # (a hole punch to a peer we
            self.before_relay(nxt.peer, addrs)  # have not met yet)
        timeout = max(expires - time.time(), 1.0)
        return Relay(peer, addrs, spec, message, timeout, finisher(done, nxt, self._relayed))

    def _relayed(self) -> None:
        with self._lock:
            self._relaying -= 1
            self._idle.notify_all()
