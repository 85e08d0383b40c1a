"""Steps of many generation sessions to one provider, sent as one message; and their client
stages (embedding, head) run as one batch.

A client (the SDK, or the broker's gateway) running many sessions at once sends a step of
each to the same provider at about the same moment: those asked for in the same turn of the
event loop go as one `SessionSteps`, and the provider runs them in one batch and answers them
in one `SessionOutputs`. One message instead of one per session saves the per-message cost
(encoding, the p2p layer, a worker thread) on both sides, which on small models is most of a
step's time. Each step still gets its own answer or its own error (a `RemoteError` with the
provider's code, as if sent alone); a failure of the message itself (a timeout, a lost
connection) fails each step in it. A provider that does not know `SessionSteps` (it answers
`bad_request`) gets single steps from then on.

Likewise one-token embeddings and heads of a model run as one batch (`embed`, `head`): rows of
a batch come out as they would alone (the stages' matrix products compute each row on its
own; an embedding is a lookup). An embedding waits a few milliseconds at most for the model's
other active sessions, so that sessions that fell out of step (their prompts differ in
length) come back in step and their steps travel together from then on. The sessions'
sampled tokens are then picked together too (`sample`; each with its own sampler, so each
gets what it would alone): a temperature over a large vocabulary takes milliseconds a row.
A batch runs in a worker thread, off the event loop, unless the last run of its kind took
under `INLINE_S` a row times its rows: then it runs on the loop, where a small model's
one-token embedding or head takes less time than the hand-off to a thread and back (two
wake-ups, about half a millisecond of a token's time on a busy machine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from client.sampling import Sampler
from client.stages import ClientStages
from p2p import ErrorCode, Host, RemoteError
from proto.session import (
    MAX_STEPS,
    SESSION,
    SessionFailed,
    SessionOutput,
    SessionOutputs,
    SessionStep,
    SessionSteps,
)

Array = np.ndarray[Any, Any]
GATHER_S = 0.005  # a one-token embedding waits at most this long for the other sessions'
ACTIVE_S = 1.0  # a session that asked this recently is expected back, seconds
INLINE_S = 0.0005  # a run expected to take less than this runs on the event loop, seconds


Rows = list[tuple[Any, ...]]  # each row's arguments


@dataclass
class _Run:
    """Rows gathering for one run: `fn` gives each row's result, or the exception it raised."""

    fn: Callable[[Rows], list[Any]]
    rows: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


def _stacked(fn: Callable[..., Array]) -> Callable[[Rows], list[Any]]:
    """A client stage run on rows stacked into one batch, cut back into rows."""

    def run(rows: Rows) -> list[Any]:
        out = fn(*[np.concatenate(c) for c in zip(*rows, strict=True)])
        return [out[i : i + 1] for i in range(len(rows))]

    return run


def _picks(rows: Rows) -> list[Any]:
    """Each row's sampler's token from its logits (or why it has none: that row's alone)."""
    out: list[Any] = []
    for sampler, logits in rows:
        try:
            out.append(sampler.pick(logits))
        except Exception as exc:
            out.append(exc)
    return out


@dataclass
class _Pending:
    steps: list[tuple[SessionStep, asyncio.Future[SessionOutput]]] = field(default_factory=list)
    timeout: float = 0.0


class StepMux:
    """Sends session steps to each provider, those of one event-loop turn as one message."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.messages = 0  # SessionSteps sent (for figures and tests)
        self._pending: dict[str, _Pending] = {}
        self._single: set[str] = set()  # providers that take one step a message
        self._tasks: set[asyncio.Task[None]] = set()
        self._runs: dict[tuple[int, str], _Run] = {}  # (id(stages), "embed" or "head"),
        # or (0, "sample")
        self._active: dict[int, dict[str, float]] = {}  # id(stages) -> session -> last embed
        self._row_s: dict[tuple[int, str], float] = {}  # a run's seconds a row, the last run
        # of each kind (none yet: the first runs in a thread)
        self.inline = 0  # runs on the event loop (for figures and tests)

    async def embed(self, stages: ClientStages, ids: Array, positions: Array, who: str) -> Array:
        """`stages.embed(ids, positions)`, one-token rows together (see the module): a
        session's (`who`) waits up to `GATHER_S` for the model's other active sessions, so
        that their steps stay in step and travel together."""
        seen = self._active.setdefault(id(stages), {})
        now = asyncio.get_running_loop().time()
        seen[who] = now
        for old in [w for w, t in seen.items() if now - t > ACTIVE_S]:
            del seen[old]
        return await self._batched(stages, "embed", len(seen), stages.embed, ids, positions)

    async def head(self, stages: ClientStages, hidden: Array) -> Array:
        """`stages.head(hidden, ones)`, one-token rows together (see the module)."""

        def head(hidden: Array) -> Array:
            return stages.head(hidden, np.ones(hidden.shape[:2], dtype=np.int64))

        return await self._batched(stages, "head", 1, head, hidden)

    async def sample(self, sampler: Sampler, logits: Array) -> int:
        """`sampler.pick(logits)`, with the other sessions' picks of this turn (see the
        module); a greedy pick (an argmax) at once."""
        if sampler.greedy:
            return sampler.pick(logits)
        token: int = await self._gather((0, "sample"), 1, _picks, sampler, logits)
        return token

    def forget(self, stages: ClientStages, who: str) -> None:
        """A session that ended is not waited for."""
        self._active.get(id(stages), {}).pop(who, None)

    async def _batched(
        self,
        stages: ClientStages,
        kind: str,
        expected: int,
        fn: Callable[..., Array],
        *args: Array,
    ) -> Array:
        if args[0].shape[:2] != (1, 1):  # a prompt: alone
            return await asyncio.to_thread(fn, *args)
        out: Array = await self._gather((id(stages), kind), expected, _stacked(fn), *args)
        return out

    async def _gather(
        self, key: tuple[int, str], expected: int, fn: Callable[[Rows], list[Any]], *args: Any
    ) -> Any:
        """`args`' row's result of a run of `fn` on the rows gathered under `key`: at the end
        of this turn once `expected` rows are in, else after `GATHER_S`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run(fn)
            run.timer = loop.call_later(GATHER_S, self._run, key)
        run.rows.append((args, future))
        if len(run.rows) >= expected:  # everyone is in: at the end of this turn
            if run.timer is not None:
                run.timer.cancel()
            run.timer = loop.call_later(0, self._run, key)
        return await future

    def _run(self, key: tuple[int, str]) -> None:
        gathered = self._runs.pop(key, None)
        if gathered is None:
            return
        rows, fn = gathered.rows, gathered.fn

        def timed() -> list[Any]:
            start = time.perf_counter()
            out = fn([a for a, _ in rows])
            self._row_s[key] = (time.perf_counter() - start) / len(rows)
            return out

        def deliver(out: list[Any] | BaseException) -> None:  # (the run's failure: every row's)
            for i, (_, future) in enumerate(rows):
                result = out if isinstance(out, BaseException) else out[i]
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(
                        result if isinstance(result, Exception) else RuntimeError()
                    )
                else:
                    future.set_result(result)

        row_s = self._row_s.get(key)
        if row_s is not None and row_s * len(rows) < INLINE_S:  # quicker than a thread
            self.inline += 1
            try:
                out = timed()
            except Exception as exc:
                deliver(exc)
            else:
                deliver(out)
            return

        async def run() -> None:
            try:
                out = await asyncio.to_thread(timed)
            except BaseException as exc:
                deliver(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            deliver(out)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def step(self, peer: str, step: SessionStep, timeout: float) -> SessionOutput:
        """`step`'s answer from `peer` (raises what a single request would)."""
        if peer in self._single:
            return await self._one(peer, step, timeout)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SessionOutput] = loop.create_future()
        pending = self._pending.get(peer)
        if pending is None:
            pending = self._pending[peer] = _Pending()
            loop.call_soon(self._flush, peer)  # after the others of this turn have asked
        pending.steps.append((step, future))
        pending.timeout = max(pending.timeout, timeout)
        return await future

    def _flush(self, peer: str) -> None:
        pending = self._pending.pop(peer)
        steps = [(s, f) for s, f in pending.steps if not f.done()]  # (not given up on)
        for start in range(0, len(steps), MAX_STEPS):
            task = asyncio.ensure_future(
                self._send(peer, steps[start : start + MAX_STEPS], pending.timeout)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, peer: str, step: SessionStep, timeout: float) -> SessionOutput:
        answer = await self.host.request(peer, SESSION, step, timeout=timeout)
        if not isinstance(answer, SessionOutput):
            raise RemoteError(ErrorCode.PROTOCOL_ERROR, f"{type(answer).__name__} to a step")
        return answer

    async def _send(
        self,
        peer: str,
        steps: list[tuple[SessionStep, asyncio.Future[SessionOutput]]],
        timeout: float,
    ) -> None:
        try:
            if len(steps) == 1:
                results: list[SessionOutput | SessionFailed] = [
                    await self._one(peer, steps[0][0], timeout)
                ]
            else:
                self.messages += 1
                message = SessionSteps(steps=[s for s, _ in steps])
                answer = await self.host.request(peer, SESSION, message, timeout=timeout)
                if not isinstance(answer, SessionOutputs) or len(answer.outputs) != len(steps):
                    raise RemoteError(ErrorCode.PROTOCOL_ERROR, "a wrong answer to the steps")
                results = list(answer.outputs)
        except RemoteError as exc:
            if exc.code == ErrorCode.BAD_REQUEST and len(steps) > 1:  # an older provider
                self._single.add(peer)
                for step, future in steps:
                    self._resend(peer, step, future, timeout)
                return
            _fail(steps, exc)
            return
        except BaseException as exc:  # the message failed: each step in it did
            _fail(steps, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(steps, results, strict=True):
            if future.done():
                continue
            if isinstance(result, SessionFailed):
                future.set_exception(RemoteError(result.code, result.message, peer))
            else:
                future.set_result(result)

    def _resend(
        self,
        peer: str,
        step: SessionStep,
        future: asyncio.Future[SessionOutput],
        timeout: float,
    ) -> None:
        async def again() -> None:
            try:
                result = await self._one(peer, step, timeout)
            except BaseException as exc:
                _fail([(step, future)], exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                if not future.done():
                    future.set_result(result)

        task = asyncio.ensure_future(again())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _fail(
    steps: list[tuple[SessionStep, asyncio.Future[SessionOutput]]], exc: BaseException
) -> None:
    for _, future in steps:
        if not future.done():
            future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
