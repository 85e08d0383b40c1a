"""Chained session steps, the client's side: a step goes client → stage 1 → … → stage n →
client along a route the client signs (`proto.session`, `/fusionai/session-chain/1`), n + 1
trips over the network where the star (client → each stage → client) makes 2n.

`ChainInbox` (one per host) sends the steps (those of sessions along the same providers and
stages asked for together as one `ChainSteps`, a batch on each hop) and is where the last hop
pushes the outputs. `chained_step` runs one
step of a `GenerationSession` that way; when the chain breaks (a hop died, two providers cannot
reach each other, an older provider) it answers None and the session runs the step the star
way instead: hops that ran it answer it again from what they kept, a dead one fails over. A
session whose chains broke twice without a provider failing goes on the star way.
`fill_history` gives a replacement of stage k what it is replayed with, stage k-1's outputs
so far, which a chained session does not see.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from client.errors import GenerationError
from p2p import ErrorCode, Host, P2PError, Refused, RemoteError, RequestTimeout
from p2p.tensor import encode
from proto.forward import (
    BAD_ANSWER,
    TIMEOUT,
    UNREACHABLE,
    ChainAccepted,
    ChainBroken,
    ForwardResult,
)
from proto.session import (
    MAX_STEPS,
    ROUTE_KEY_BYTES,
    SESSION,
    SESSION_CHAIN,
    SESSION_RESULT,
    STEP_ROUTE_DOMAIN,
    ChainRow,
    ChainStep,
    ChainStepResult,
    ChainSteps,
    ChainStepsResult,
    SessionHistory,
    SessionOutput,
    StepHop,
    hop_addrs,
    route_tag,
    step_route_bytes,
    steps_route_bytes,
)

if TYPE_CHECKING:
    from client.session import GenerationSession

log = logging.getLogger("fusionai.client")
Array = np.ndarray[Any, Any]
STRIKES = 2  # chains broken with every provider still serving: then the star way only


class ChainFailed(Exception):
    """A chained step that brought no outputs back (why). `refused`: a hop answered that it
    would not run a step (not that the route is broken); `excused`: that was in a chain of
    several sessions, perhaps for another's step, so it counts against none of them."""

    def __init__(self, why: str, *, refused: bool = False, excused: bool = False) -> None:
        super().__init__(why)
        self.refused, self.excused = refused, excused


class ChainInbox:
    """Where the last hop of each of this host's chained steps pushes the outputs. Steps of
    several sessions along the same providers and stages asked for in the same turn of the
    event loop (sessions generating together, kept in step by `client.stepmux`) go as one
    `ChainSteps`, run as one batch on each hop."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.waiting: dict[str, tuple[str, asyncio.Future[Any]]] = {}
        self.acks: set[asyncio.Future[Any]] = set()  # answers still travelling back
        self.batched = 0  # ChainSteps sent (for figures and tests)
        self._pending: dict[tuple[Any, ...], list[_Asked]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._keys: dict[str, bytes] = {}  # provider -> the key its sessions are opened with
        host.add_control_handler(SESSION_RESULT, self._arrived)

    def key_for(self, peer: str) -> bytes:
        """This host's key for `peer`'s chained-step tags (`proto.session.route_tag`): given
        to it with each session opened there, so that it checks a step's tag, not the
        route's signature."""
        key = self._keys.get(peer)
        if key is None:
            key = self._keys[peer] = secrets.token_bytes(ROUTE_KEY_BYTES)
        return key

    def _tags(self, route: list[StepHop], signed: bytes) -> list[bytes]:
        return [route_tag(self.key_for(h.peer), signed) for h in route]

    async def _arrived(self, peer: str, msg: ChainStepResult | ChainStepsResult) -> ChainAccepted:
        waiting = self.waiting.get(msg.chain)
        if waiting is None or waiting[0] != peer:
            raise Refused(ErrorCode.NOT_FOUND, "no chained step of ours with that id is waiting")
        if not waiting[1].done():
            waiting[1].set_result(msg)
        return ChainAccepted(chain=msg.chain)

    async def step(
        self, route: list[StepHop], inputs: dict[str, Any], past: int, timeout: float
    ) -> ChainStepResult:
        """Send a step along `route` (signed here), with the other steps along the same
        providers and stages asked for in this turn; its outputs, or `ChainFailed`."""
        loop = asyncio.get_running_loop()
        key = tuple((h.peer, h.stage, tuple(h.addrs)) for h in route)
        asked = _Asked(route, inputs, past, timeout, loop.create_future())
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = []
            loop.call_soon(self._flush, key)  # after the others of this turn have asked
        pending.append(asked)
        return await asked.future

    def _flush(self, key: tuple[Any, ...]) -> None:
        asked = [a for a in self._pending.pop(key) if not a.future.done()]
        for start in range(0, len(asked), MAX_STEPS):
            task = asyncio.ensure_future(self._run(asked[start : start + MAX_STEPS]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, asked: list[_Asked]) -> None:
        """Send `asked` as one chained message (a `ChainStep` for one session, else a
        `ChainSteps`) and hand each its outputs, or each the failure."""
        chain, timeout = uuid.uuid4().hex, max(a.timeout for a in asked)
        msg = self._message(chain, asked, time.time() + timeout + 5.0)
        try:
            results = _each(chain, asked, await self._send(chain, msg.route, msg, timeout))
        except BaseException as exc:
            if isinstance(exc, ChainFailed) and exc.refused and len(asked) > 1:
                exc = ChainFailed(str(exc), refused=True, excused=True)
            _fail(asked, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for a, result in zip(asked, results, strict=True):
            if not a.future.done():
                a.future.set_result(result)

    def _message(self, chain: str, asked: list[_Asked], expires: float) -> ChainStep | ChainSteps:
        """The signed message of one chained step of `asked`' sessions."""
        sign = self.host.identity.sign
        if len(asked) == 1:
            (a,) = asked
            signed = step_route_bytes(chain, a.route, a.past, expires)
            return ChainStep(
                chain=chain, origin=self.host.peer_id, route=a.route, hop=0, past=a.past,
                inputs=a.inputs, expires=expires,
                signature=sign(signed, domain=STEP_ROUTE_DOMAIN),
                tags=self._tags(a.route, signed),
            )  # fmt: skip
        route = [StepHop(h.peer, h.stage, "", h.addrs) for h in asked[0].route]
        rows = [ChainRow([h.session for h in a.route], a.past, a.inputs) for a in asked]
        self.batched += 1
        signed = steps_route_bytes(chain, route, rows, expires)
        return ChainSteps(
            chain=chain, origin=self.host.peer_id, route=route, rows=rows, hop=0,
            expires=expires, signature=sign(signed, domain=STEP_ROUTE_DOMAIN),
            tags=self._tags(route, signed),
        )  # fmt: skip

    async def _send(
        self, chain: str, route: list[StepHop], msg: ChainStep | ChainSteps, timeout: float
    ) -> ChainStepResult | ChainStepsResult:
        """Send `msg` to the route's first hop; what its last hop pushes back."""
        arrived: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[chain] = (route[-1].peer, arrived)
        call = asyncio.ensure_future(
            self.host.request(route[0].peer, SESSION_CHAIN, msg, timeout=timeout)
        )
        try:
            await asyncio.wait({arrived, call}, timeout=timeout, return_when="FIRST_COMPLETED")
            answer = call.result() if _answered(call) else None
            if not arrived.done() and answer is not None and not isinstance(answer, ChainBroken):
                await asyncio.wait({arrived}, timeout=1.0)  # (the push comes first, normally;
                # a route that broke sends none)
            if arrived.done():
                if not call.done():  # its answer travels back along the route meanwhile
                    self.acks.add(call)
                    call.add_done_callback(self._acked)
                result: ChainStepResult | ChainStepsResult = arrived.result()
                return result
            raise ChainFailed(_why(call), refused=_refused(call))
        finally:
            del self.waiting[chain]
            if not call.done() and call not in self.acks:
                call.cancel()

    def _acked(self, call: asyncio.Future[Any]) -> None:
        self.acks.discard(call)
        if not call.cancelled():
            call.exception()  # (retrieved: the step's outputs had come)


_INBOXES: weakref.WeakKeyDictionary[Host, ChainInbox] = weakref.WeakKeyDictionary()


def inbox_of(host: Host) -> ChainInbox:
    """`host`'s `ChainInbox` (one per host: it serves the host's session-result protocol), so
    that the SDK and a gateway on the same host share it."""
    inbox = _INBOXES.get(host)
    if inbox is None:
        inbox = _INBOXES[host] = ChainInbox(host)
    return inbox


@dataclass
class _Asked:
    """A session's chained step, waiting to be sent."""

    route: list[StepHop]
    inputs: dict[str, Any]
    past: int
    timeout: float
    future: asyncio.Future[ChainStepResult]


def _each(
    chain: str, asked: list[_Asked], result: ChainStepResult | ChainStepsResult
) -> list[ChainStepResult]:
    """Each session's outputs and commitments from what the chain's last hop pushed."""
    if len(asked) == 1 and isinstance(result, ChainStepResult):
        return [result]
    if not isinstance(result, ChainStepsResult) or len(result.rows) != len(asked):
        raise ChainFailed("the outputs came back unlike the steps sent")
    out = []
    for a, row in zip(asked, result.rows, strict=True):
        mine = {(h.session, h.stage) for h in a.route}
        commitments = [c for c in result.commitments if (c.session, c.stage) in mine]
        out.append(ChainStepResult(chain, row.outputs, row.past_len, commitments))
    return out


def _fail(asked: list[_Asked], exc: BaseException) -> None:
    for a in asked:
        if not a.future.done():
            a.future.set_exception(exc if isinstance(exc, Exception) else ChainFailed(str(exc)))


def _answered(call: asyncio.Future[Any]) -> bool:
    return call.done() and not call.cancelled() and call.exception() is None


def _refused(call: asyncio.Future[Any]) -> bool:
    """Whether a hop answered that it would not run the step (refused, busy, no such
    session), rather than the route failing (a timeout, an unreachable hop, a bad answer)."""
    if not _answered(call):
        return False
    answer = call.result()
    return isinstance(answer, ChainBroken) and answer.code not in (TIMEOUT, UNREACHABLE, BAD_ANSWER)


def _why(call: asyncio.Future[Any]) -> str:
    if not call.done():
        return "no answer in time"
    if call.cancelled():
        return "cancelled"
    exc = call.exception()
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    answer = call.result()
    if isinstance(answer, ChainBroken):
        where = f"{answer.peer or 'the client'} ({answer.stage})"
        return f"broken at {where}: {answer.code}: {answer.reason}"
    if isinstance(answer, ForwardResult):
        return "the route answered but the outputs never came"
    return f"unexpected {type(answer).__name__}"


def chainable(session: GenerationSession) -> bool:
    """Whether `session`'s next step may go as a chain: every stage has an open session, no
    shadow checks, and fewer than `STRIKES` chains broken without a failover. (Concurrent
    sessions' chained steps along the same providers travel together: `ChainInbox`.)"""
    return (
        session.chains is not None
        and not session.verify
        and session.chain_strikes < STRIKES
        and len(session.stages) > 1
        and all(s.sid is not None and s.peer is not None for s in session.stages)
    )


async def chained_step(
    session: GenerationSession, hidden: Array, positions: Array, expect: int
) -> Array | None:
    """Run a step through every stage as one chain; the last stage's hidden states, or None
    when the chain broke (the session then runs the step the star way)."""
    assert session.chains is not None
    session.chain_excused = False
    addrs = session.router.addrs
    route = [
        StepHop(s.peer, s.key, s.sid, hop_addrs(s.peer, addrs.get(s.peer, [])))
        for s in session.stages
        if s.peer is not None and s.sid is not None
    ]
    sent = encode(hidden, session.wire)
    inputs = {"hidden_states": sent}
    if any(i.name == "position_ids" for s in session.stages for i in s.info.inputs):
        inputs["position_ids"] = encode(positions, "native")
    try:
        result = await session.chains.step(
            route, inputs, session.past, session.timeout * len(route)
        )
    except (ChainFailed, P2PError) as exc:
        log.info("session %s: a chained step broke (%s); the star way", session.id, exc)
        session.chain_excused = isinstance(exc, ChainFailed) and exc.excused
        return None
    session.commitments.add(result.commitments)
    out = result.outputs.get("hidden_states_out")
    if result.past_len != expect or out is None or out.wire != session.wire:
        log.info("session %s: a chained step answered unlike a step; the star way", session.id)
        return None
    session.hidden_bytes += sent.nbytes + out.nbytes
    try:
        return out.to_numpy()
    except ValueError:
        return None


async def fill_history(session: GenerationSession, pos: int) -> None:
    """Stage `pos`'s inputs so far (for a replay), from the outputs that stage `pos - 1`'s
    provider kept: chained steps went there without the client."""
    stage, prev = session.stages[pos], session.stages[pos - 1]
    if prev.peer is None or prev.sid is None:
        raise GenerationError(f"the inputs of {stage.key} so far are lost with {prev.key}'s")
    try:
        answer = await session.host.request(
            prev.peer,
            SESSION,
            SessionHistory(session=prev.sid, stage=prev.key),
            timeout=session.timeout,
        )
        if not isinstance(answer, SessionOutput):
            raise ValueError(f"it answered {type(answer).__name__}")
        out = answer.outputs.get("hidden_states_out")
        if out is None:
            raise ValueError("it answered no hidden states")
        hidden = out.to_numpy()
    except (RemoteError, RequestTimeout, P2PError, ValueError) as exc:
        raise GenerationError(
            f"the inputs of {stage.key} so far went with {prev.key}'s provider {prev.peer}: {exc}"
        ) from None
    if hidden.ndim != 3 or hidden.shape[1] < session.past:
        raise GenerationError(f"{prev.key}'s provider kept {hidden.shape} of its outputs")
    feeds = {"hidden_states": np.ascontiguousarray(hidden[:, : session.past])}
    if any(i.name == "position_ids" for i in stage.info.inputs):
        feeds["position_ids"] = np.arange(session.past, dtype=np.int64)[None, :]
    stage.history[:] = [feeds]
