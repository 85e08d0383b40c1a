"""Generation sessions on a provider: a KV cache per session, steps batched across sessions.

Part of `Server` (`serving.py`), which owns the state this uses: its lock, sessions, stages,
admission and compute gate. Sessions belong to the peer that opened them, expire after
`idle_timeout_s`, and their caches together stay under `kv_budget_bytes` (a step that would
exceed it is answered `busy`, its session intact). One step of a session runs at a time (a
second one meanwhile is answered `busy`); steps of different sessions are not held to the
per-peer limit, since one client runs many sessions. Steps that may share a run go through
the batcher (`batching.py`); the others run alone.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING

import numpy as np

from ir.errors import ExecutorError
from ir.executors.base import check_feeds
from ir.pipeline import CACHE_OUTPUTS, KEY_MASK, cache_feeds, next_cache
from ir.training import TrainingError, check_adapters
from p2p import ErrorCode, Refused, Tensor
from p2p.tensor import encode
from proto.session import (
    MAX_STEPS,
    Commitment,
    SessionClose,
    SessionClosed,
    SessionFailed,
    SessionHistory,
    SessionOpen,
    SessionOpened,
    SessionOutput,
    SessionOutputs,
    SessionStep,
    SessionSteps,
)
from provider.batching import Batcher, Step, batchable
from provider.commitments import Ledger, Sign, worker
from provider.gate import ComputeGate, Priority
from provider.stage import Array, LoadedStage, Session, SharedRows, arrays, run, wire_of

MAX_SESSION_ID = 128  # characters
SWEEP_EVERY_S = 1.0  # idle sessions are looked for at most this often (and every heartbeat)


class SessionServing:
    """The session half of `Server`."""

    if TYPE_CHECKING:  # provided by Server
        _lock: threading.Lock
        sessions: dict[tuple[str, str, str], Session]
        stages: dict[str, LoadedStage]
        draining: bool
        idle_timeout_s: float
        kv_budget: int
        sessions_per_peer: int
        max_sessions: int
        gate: ComputeGate
        batcher: Batcher
        _last_sweep: float
        _absent: set[str]  # peers with sessions found disconnected at the last sweep
        _kv_used: int  # bytes of the sessions' caches
        sign: Sign | None

        def _stage(self, key: str, check: bool = False) -> LoadedStage: ...
        def _admit(
            self, peer: str, training: bool = False, stepping: Session | None = None
        ) -> AbstractContextManager[int]: ...
        def _apply_fault(self, number: int, stage: str) -> None: ...
        def _count(
            self, key: str, feeds: dict[str, Array], seconds: float, *, requests: int = 0
        ) -> None: ...
        def served(self, key: str, *, requests: int = 0, tokens: int = 0) -> None: ...
        def _outputs(self, outputs: dict[str, Array], wire: str) -> dict[str, Tensor]: ...

    def session(
        self,
        peer: str,
        request: SessionOpen | SessionStep | SessionSteps | SessionClose | SessionHistory,
    ) -> SessionOpened | SessionOutput | SessionOutputs | SessionClosed:
        if time.monotonic() - self._last_sweep >= SWEEP_EVERY_S:  # not a scan per request
            self.expire()
        if isinstance(request, SessionOpen):
            return self._open(peer, request)
        if isinstance(request, SessionClose):
            with self._lock:
                taken = self._taken([(peer, request.stage, request.session)])
            if not taken:
                return SessionClosed(session=request.session)
            (gone,) = taken
            self.batcher.forget(gone)
            with gone.lock:  # (a step still running adds its rows first)
                last = gone.ledger.finish() if gone.ledger is not None else []
            return SessionClosed(session=request.session, commitments=last)
        if isinstance(request, SessionSteps):
            return self._steps(peer, request)
        if isinstance(request, SessionHistory):
            return self._history(peer, request)
        return self._step(peer, request)

    def _history(self, peer: str, request: SessionHistory) -> SessionOutput:
        """The session's outputs for every token so far (a replacement of the next stage is
        replayed with them)."""
        session = self._session(peer, request.stage, request.session)
        with session.lock:
            trail, past = list(session.trail), session.past_len
        if not trail or any(t.wire != trail[0].wire for t in trail):
            raise Refused(ErrorCode.NOT_FOUND, "this session has no outputs to give")
        joined = np.concatenate([t.to_numpy() for t in trail], axis=1)
        if joined.shape[1] != past:
            raise Refused(ErrorCode.NOT_FOUND, "this session's outputs are not whole")
        outputs = {"hidden_states_out": encode(joined, trail[0].wire)}
        return SessionOutput(session=request.session, outputs=outputs, past_len=past)

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
            self.sessions[key].route_key = request.route_key  # (checked: `SessionOpen`)
            if request.batch == 1 and not request.check and self.sign is not None:  # (a check's
                # session, a shadow step's or the broker's probe, is a check already)
                self.sessions[key].ledger = Ledger(
                    request.session, request.stage, self.sign, worker()
                )
        if not request.check:  # (a check's session is the broker's or a shadow: not a user's)
            self.served(request.stage, requests=1)
        return SessionOpened(session=request.session, idle_timeout_s=self.idle_timeout_s)

    def _step(self, peer: str, request: SessionStep) -> SessionOutput:
        (answer,) = self._run_steps(peer, [request])
        if isinstance(answer, Refused):
            raise answer
        return answer

    def _steps(self, peer: str, request: SessionSteps) -> SessionOutputs:
        """Several sessions' steps: run together where they can, each answered on its own."""
        steps = request.steps
        if not 1 <= len(steps) <= MAX_STEPS:
            raise Refused(ErrorCode.REFUSED, f"send 1 to {MAX_STEPS} steps, not {len(steps)}")
        if len({(s.stage, s.session) for s in steps}) != len(steps):
            raise Refused(ErrorCode.REFUSED, "a session's step twice in one message")
        answers = self._run_steps(peer, steps)
        return SessionOutputs(
            outputs=[
                SessionFailed(session=s.session, code=a.code, message=a.message)
                if isinstance(a, Refused)
                else a
                for s, a in zip(steps, answers, strict=True)
            ]
        )

    def _session(self, peer: str, stage: str, sid: str) -> Session:
        with self._lock:
            session = self.sessions.get((peer, stage, sid))
        if session is None:
            raise Refused(
                ErrorCode.NOT_FOUND,
                f"no session {sid!r} here (never opened, closed, or expired after "
                f"{self.idle_timeout_s:g} s idle): open it again and replay its history",
            )
        return session

    def _lookup(
        self, peer: str, request: SessionStep
    ) -> tuple[Session, LoadedStage, dict[str, Array]]:
        session = self._session(peer, request.stage, request.session)
        stage = self._stage(session.stage, session.check)
        ours = [n for n in request.inputs if n.startswith("past_") or n == KEY_MASK]
        if ours:
            raise Refused(ErrorCode.REFUSED, f"the provider keeps {ours} itself")
        return session, stage, arrays(request.inputs)

    def _run_steps(self, peer: str, requests: list[SessionStep]) -> list[SessionOutput | Refused]:
        """Each step's answer, or why it was refused. Batchable steps go to the batcher
        together (one run if they fit), the others run alone, one after the other."""
        answers: list[SessionOutput | Refused | None] = [None] * len(requests)
        steps: dict[int, tuple[LoadedStage, Step]] = {}
        with ExitStack() as held:  # each admitted step's count and session lock, until done
            for i, request in enumerate(requests):
                try:
                    session, stage, inputs = self._lookup(peer, request)
                    number = held.enter_context(self._admit(peer, stepping=session))
                    held.enter_context(session.lock)
                    session.last_used = time.monotonic()  # in use: not idle while it runs
                    if _repeated(session, request):  # run already: the same answer again
                        answers[i] = session.last[1] if session.last else None
                        continue
                    self._apply_fault(number, session.stage)
                    if self.batcher.max_batch > 1 and batchable(stage, session, inputs):
                        _check_step(stage, inputs)  # a bad step must not fail a shared run
                    steps[i] = (stage, Step(session, inputs))
                except Refused as exc:
                    answers[i] = exc
            by_stage: dict[str, tuple[LoadedStage, list[Step]]] = {}
            for stage, step in steps.values():
                if self.batcher.max_batch > 1 and batchable(stage, step.session, step.feeds):
                    by_stage.setdefault(stage.key, (stage, []))[1].append(step)
                else:
                    try:
                        step.outputs = self._alone(stage, step.session, step.feeds)
                    except Refused as exc:
                        step.error = exc
            for stage, group in by_stage.values():
                self.batcher.run(stage, group)
            for i, (_, step) in steps.items():
                answers[i] = self._answer(requests[i], step)
        return [a if a is not None else Refused(ErrorCode.REFUSED, "not run") for a in answers]

    def _answer(self, request: SessionStep, step: Step) -> SessionOutput | Refused:
        """A step's answer once run: its new cache kept (within the KV budget)."""
        if isinstance(step.error, Refused):
            return step.error
        if step.error is not None:
            raise step.error
        assert step.outputs is not None
        session, before = step.session, step.session.past_len
        visible = {k: v for k, v in step.outputs.items() if not k.startswith(CACHE_OUTPUTS)}
        outputs = self._outputs(visible, wire_of(request.inputs))
        hidden = outputs.get("hidden_states_out")
        try:
            self._keep(session, step.outputs, [hidden] if hidden is not None else [], step.shared)
        except Refused as exc:
            return exc
        made = _committed(session, request, hidden)
        answer = SessionOutput(
            session=request.session, outputs=outputs, past_len=session.past_len, commitments=made
        )
        session.last = (before, answer)
        if not session.check:
            self.served(session.stage, tokens=session.batch)  # a token a row
        return answer

    def _alone(
        self, stage: LoadedStage, session: Session, inputs: dict[str, Array]
    ) -> dict[str, Array]:
        """A step in a run of its own (a prompt, a replay, an adapter, an older package)."""
        lengths = [session.past_len] * session.batch
        feeds = {**inputs, **cache_feeds(stage.info, session.cache, lengths, _tokens(inputs))}
        stage.with_adapters(feeds, session.adapters)
        with self.gate.slot(Priority.SESSION):
            start = time.perf_counter()
            outputs = run(stage.executor, feeds)
        self._count(stage.key, feeds, time.perf_counter() - start)
        return outputs

    def _run_batch(self, stage: LoadedStage, feeds: dict[str, Array]) -> dict[str, Array]:
        """One batched run (the batcher's executor call): the base model's adapters."""
        stage.with_adapters(feeds, {})
        start = time.perf_counter()
        outputs = run(stage.executor, feeds)
        self._count(stage.key, feeds, time.perf_counter() - start)
        return outputs

    def _keep(
        self,
        session: Session,
        outputs: dict[str, Array],
        trail: list[Tensor],
        shared: tuple[SharedRows, int] | None = None,
    ) -> None:
        """The step's new cache (its cache outputs with the cache it ran on, or its row of a
        batched run's `shared` caches) becomes the session's, and its `trail` of outputs
        grows, if the KV budget has room for them."""
        kept = None
        if shared is None:
            kept = next_cache(session.peek(), [session.past_len] * session.batch, outputs)
        new_cache = kept[0] if kept is not None else {}
        trail_bytes = session.trail_bytes + sum(t.nbytes for t in trail)
        if shared is not None:
            new_bytes = shared[0].row_bytes + trail_bytes
        else:
            new_bytes = sum(a.nbytes for a in new_cache.values()) + trail_bytes
        with self._lock:
            counted = not session.dropped  # (dropped while this step ran: counted off already)
            others = self._kv_used - session.counted if counted else self._kv_used
            if counted and others + new_bytes > self.kv_budget:
                raise Refused(
                    ErrorCode.BUSY,
                    f"KV cache memory full ({others + new_bytes} of {self.kv_budget} "
                    f"bytes); the session is unchanged: retry later or elsewhere",
                )
            if shared is not None:
                session.kv, session.shared = {}, shared
                session.past_len = shared[0].lengths[shared[1]]
            elif kept is not None:
                session.cache, session.past_len = kept
            session.trail_bytes, session.counted = trail_bytes, new_bytes
            session.trail.extend(trail)
            if counted:
                self._kv_used = others + new_bytes
            session.last_used = time.monotonic()

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
            gone = self._taken(old)
        self._dropped(gone)
        self.batcher.report()
        return len(old)

    def disconnected(self, connected: set[str]) -> dict[str, int]:
        """Drop the sessions of peers not in `connected` at this sweep and the one before (a
        client that went away); returns how many each such peer had."""
        with self._lock:
            gone_peers = {s.peer for s in self.sessions.values()} - connected
            doomed = gone_peers & self._absent  # absent twice in a row: not a blip
            self._absent = gone_peers - doomed
            keys = [k for k, s in self.sessions.items() if s.peer in doomed]
            gone = self._taken(keys)
        self._dropped(gone)
        counts: dict[str, int] = {}
        for session in gone:
            counts[session.peer] = counts.get(session.peer, 0) + 1
        return counts

    def _taken(self, keys: list[tuple[str, str, str]]) -> list[Session]:
        """The open sessions of `keys`, taken out (the server's lock held): their bytes are
        no longer counted, nor those a step still running on one would add."""
        gone = [self.sessions.pop(k) for k in keys if k in self.sessions]
        for session in gone:
            self._kv_used -= session.counted
            session.dropped = True
        return gone

    def _dropped(self, gone: list[Session]) -> None:
        """Sessions dropped unclosed: not waited for in batches, their commitments not made
        (called on the daemon's event loop: nothing here waits for a step)."""
        for session in gone:
            self.batcher.forget(session)
            if session.ledger is not None:
                session.ledger.cancel()

    def kv_bytes(self) -> int:
        return self._kv_used


def _repeated(session: Session, request: SessionStep) -> bool:
    """Whether `request` is the session's last step again (its `past` is what was cached
    before that step); a step that is neither that nor the next one is refused."""
    if request.past < 0 or request.past == session.past_len:
        return False
    if session.last is not None and session.last[0] == request.past:
        return True
    raise Refused(
        ErrorCode.NOT_FOUND,
        f"this session holds {session.past_len} tokens, not the step's {request.past}: open "
        "it again and replay its history",
    )


def _committed(session: Session, request: SessionStep, hidden: Tensor | None) -> list[Commitment]:
    """The session's commitments finished since its last answer (the session's lock is held);
    this step's input and output rows, batch row 0, as they went over the wire, go in."""
    given = request.inputs.get("hidden_states")
    if session.ledger is None or hidden is None or given is None:
        return []
    try:
        rows_in, rows_out = given.to_numpy()[0], hidden.to_numpy()[0]
    except (ValueError, IndexError):
        return []
    if rows_in.ndim != 2 or rows_out.ndim != 2 or len(rows_in) != len(rows_out):
        return []
    return session.ledger.add(rows_in, rows_out)


def _tokens(inputs: dict[str, Array]) -> int:
    hidden = inputs.get("hidden_states")
    return int(hidden.shape[1]) if hidden is not None and hidden.ndim >= 2 else 0


def _check_step(stage: LoadedStage, inputs: dict[str, Array]) -> None:
    """A one-token step's inputs: the stage's own (but cache, mask and adapters), one row."""
    adapters = {n for a in stage.info.adapters for n in (a.a_input, a.b_input)}
    wanted = [
        i
        for i in stage.info.inputs
        if not i.name.startswith("past_") and i.name != KEY_MASK and i.name not in adapters
    ]
    try:
        check_feeds(wanted, inputs)
    except ExecutorError as exc:
        raise Refused(ErrorCode.REFUSED, str(exc)) from None
    odd = [k for k, v in inputs.items() if tuple(v.shape[:2]) != (1, 1)]
    if odd:
        raise Refused(ErrorCode.REFUSED, f"{odd} must hold one row of one token")
