"""Chained session steps: a step of a client's sessions along a route the client signed, run
hop after hop by the providers on it, each sending the hidden states straight on to the next;
the last pushes the outputs to the client (`proto.session`, `/fusionai/session-chain/1`). A
`ChainSteps` carries a step of several sessions along the same providers and stages, run as
one batch on each hop.

Part of `Server` (`serving.py`): each hop is a step of the client's own session, run like any
other (batched with other sessions' steps, its cache and trail kept), so a client that falls
back to plain steps after a broken chain finds every hop that ran it answering it again.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ir.pipeline import KEY_MASK
from p2p import ErrorCode, Message, ProtocolSpec, Refused, Relay, verify
from proto.forward import MAX_HOPS, HopDone
from proto.session import (
    MAX_STEPS,
    SESSION_CHAIN,
    SESSION_RESULT,
    STEP_ROUTE_DOMAIN,
    ChainRow,
    ChainRowResult,
    ChainStep,
    ChainStepResult,
    ChainSteps,
    ChainStepsResult,
    SessionOutput,
    SessionStep,
    StepHop,
    route_tag,
    step_route_bytes,
    steps_route_bytes,
)
from provider.stage import LoadedStage, Session

MAX_ROUTE_S = 3600.0  # a route may not be valid for longer than this


def check_step_route(
    request: ChainStep | ChainSteps,
    peer: str,
    me: str,
    session_of: Callable[[str, str], Session | None],
) -> None:
    """Refuse (`Refused`) a chained step that is not ours to run: a bad hop, the wrong
    sender, an expired route, bad rows, or one its origin did not ask for: this hop's tag
    checks with the key its sessions (`session_of(stage, session)`, the origin's) were
    opened with, or else the origin's signature of the route checks."""
    route, i = request.route, request.hop
    if len(route) > MAX_HOPS or not 0 <= i < len(route):
        raise Refused(ErrorCode.REFUSED, f"a route has 1 to {MAX_HOPS} hops, hop within it")
    if route[i].peer != me:
        raise Refused(ErrorCode.REFUSED, f"hop {i} of this route is not this provider's")
    if peer != (request.origin if i == 0 else route[i - 1].peer):
        raise Refused(ErrorCode.REFUSED, f"hop {i} of this route comes from another peer")
    now = time.time()
    if not now <= request.expires <= now + MAX_ROUTE_S:
        raise Refused(ErrorCode.REFUSED, "the route has expired (or claims too long a life)")
    if isinstance(request, ChainSteps):
        rows = request.rows
        if not 1 <= len(rows) <= MAX_STEPS:
            raise Refused(ErrorCode.REFUSED, f"a chained step has 1 to {MAX_STEPS} rows")
        if any(len(r.sessions) != len(route) or r.past < 0 for r in rows):
            raise Refused(ErrorCode.REFUSED, "each row names a session a hop and its past")
        for hop in range(len(route)):
            if len({r.sessions[hop] for r in rows}) != len(rows):
                raise Refused(ErrorCode.REFUSED, "a session's step twice in one message")
        signed = steps_route_bytes(request.chain, route, rows, request.expires)
    else:
        if request.past < 0:
            raise Refused(ErrorCode.REFUSED, "a chained step says how many tokens come before it")
        signed = step_route_bytes(request.chain, route, request.past, request.expires)
    if len(request.tags) == len(route):
        sids = (
            [r.sessions[i] for r in request.rows]
            if isinstance(request, ChainSteps)
            else [route[i].session]
        )
        sessions = [session_of(route[i].stage, sid) for sid in sids]
        keys = {s.route_key if s is not None else b"" for s in sessions}
        key = keys.pop() if len(keys) == 1 else b""
        if key and hmac.compare_digest(request.tags[i], route_tag(key, signed)):
            return
    if not verify(request.origin, signed, request.signature, domain=STEP_ROUTE_DOMAIN):
        raise Refused(ErrorCode.REFUSED, "the route is not signed by its origin")


class StepChains:
    """The chained-step half of `Server`."""

    if TYPE_CHECKING:  # provided by Server
        peer_id: str
        _lock: threading.Lock
        sessions: dict[tuple[str, str, str], Session]

        def _stage(self, key: str, check: bool = False) -> LoadedStage: ...
        def _run_steps(
            self, peer: str, requests: list[SessionStep]
        ) -> list[SessionOutput | Refused]: ...
        def _pass_on(
            self,
            peer: str,
            spec: ProtocolSpec,
            message: Message,
            expires: float,
            done: list[HopDone],
            nxt: StepHop | None,
        ) -> Relay: ...

    def _owned(self, origin: str) -> Callable[[str, str], Session | None]:
        """`origin`'s session on a stage here, by stage and session id (or None)."""

        def session_of(stage: str, sid: str) -> Session | None:
            with self._lock:
                return self.sessions.get((origin, stage, sid))

        return session_of

    def chain_step(self, peer: str, request: ChainStep | ChainSteps) -> Relay:
        """Run this hop (and the next ones while they are ours) on the origin's sessions
        (one step, or a row's each as one batch), then send the hidden states to the next
        hop, or the outputs to the origin."""
        check_step_route(request, peer, self.peer_id, self._owned(request.origin))
        route, i = request.route, request.hop
        if isinstance(request, ChainSteps):
            rows = [(r.sessions, r.past, dict(r.inputs)) for r in request.rows]
        else:
            rows = [([h.session for h in route], request.past, dict(request.inputs))]
        done: list[HopDone] = []
        commitments = list(request.commitments)  # the hops' before us, for the origin
        while True:  # this hop, and the following ones while they are ours
            hop = route[i]
            names = {t.name for t in self._stage(hop.stage, True).info.inputs}
            steps = [
                SessionStep(
                    session=sessions[i],
                    stage=hop.stage,
                    inputs={
                        k: v
                        for k, v in inputs.items()
                        if k in names and not k.startswith("past_") and k != KEY_MASK
                    },
                    past=past,
                )
                for sessions, past, inputs in rows
            ]
            start = time.perf_counter()
            answers: list[SessionOutput] = []
            for answer in self._run_steps(request.origin, steps):
                if isinstance(answer, Refused):
                    raise answer
                answers.append(answer)
                commitments += answer.commitments
            done.append(HopDone(self.peer_id, hop.stage, (time.perf_counter() - start) * 1e3))
            if i + 1 == len(route):
                break
            for (_, _, inputs), answer in zip(rows, answers, strict=True):
                hidden = answer.outputs.get("hidden_states_out")
                if hidden is None:
                    raise Refused(
                        ErrorCode.REFUSED, f"stage {hop.stage!r} has no hidden_states_out"
                    )
                inputs["hidden_states"] = hidden
            if route[i + 1].peer != self.peer_id:
                break
            i += 1
        if i + 1 == len(route):  # the last hop: the outputs go to the origin
            result: Message
            if isinstance(request, ChainSteps):
                outs = [ChainRowResult(a.outputs, a.past_len) for a in answers]
                result = ChainStepsResult(chain=request.chain, rows=outs, commitments=commitments)
            else:
                result = ChainStepResult(
                    chain=request.chain,
                    outputs=answers[0].outputs,
                    past_len=answers[0].past_len,
                    commitments=commitments,
                )
            return self._pass_on(
                request.origin, SESSION_RESULT, result, request.expires, done, None
            )
        nxt = route[i + 1]
        message: Message
        if isinstance(request, ChainSteps):
            message = msgspec.structs.replace(
                request,
                rows=[ChainRow(sessions, past, inputs) for sessions, past, inputs in rows],
                hop=i + 1,
                commitments=commitments,
            )
        else:
            message = msgspec.structs.replace(
                request, hop=i + 1, inputs=rows[0][2], commitments=commitments
            )
        return self._pass_on(nxt.peer, SESSION_CHAIN, message, request.expires, done, nxt)
