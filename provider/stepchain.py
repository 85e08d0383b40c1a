"""Chained session steps: a step of a client's sessions along a route the client signed, run
hop after hop by the providers on it, each sending the hidden states straight on to the next;
the last pushes the outputs to the client (`proto.session`, `/fusionai/session-chain/1`).

Part of `Server` (`serving.py`): each hop is a step of the client's own session, run like any
other (batched with other sessions' steps, its cache and trail kept), so a client that falls
back to plain steps after a broken chain finds every hop that ran it answering it again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ir.pipeline import KEY_MASK
from p2p import ErrorCode, Message, ProtocolSpec, Refused, Relay, verify
from proto.forward import MAX_HOPS, HopDone
from proto.session import (
    SESSION_CHAIN,
    SESSION_RESULT,
    STEP_ROUTE_DOMAIN,
    ChainStep,
    ChainStepResult,
    SessionOutput,
    SessionStep,
    StepHop,
    step_route_bytes,
)
from provider.stage import LoadedStage

MAX_ROUTE_S = 3600.0  # a route may not be valid for longer than this


def check_step_route(request: ChainStep, peer: str, me: str) -> None:
    """Refuse (`Refused`) a chained step that is not ours to run: a bad hop, the wrong
    sender, an expired route, or one its origin did not sign."""
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
    if request.past < 0:
        raise Refused(ErrorCode.REFUSED, "a chained step says how many tokens come before it")
    signed = step_route_bytes(request.chain, route, request.past, request.expires)
    if not verify(request.origin, signed, request.signature, domain=STEP_ROUTE_DOMAIN):
        raise Refused(ErrorCode.REFUSED, "the route is not signed by its origin")


class StepChains:
    """The chained-step half of `Server`."""

    if TYPE_CHECKING:  # provided by Server
        peer_id: str

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

    def chain_step(self, peer: str, request: ChainStep) -> Relay:
        """Run this hop (and the next ones while they are ours) on the origin's sessions,
        then send the hidden states to the next hop, or the outputs to the origin."""
        check_step_route(request, peer, self.peer_id)
        route, i = request.route, request.hop
        inputs = dict(request.inputs)
        done: list[HopDone] = []
        commitments = list(request.commitments)  # the hops' before us, for the origin
        while True:  # this hop, and the following ones while they are ours
            hop = route[i]
            names = {t.name for t in self._stage(hop.stage, True).info.inputs}
            mine = {
                k: v
                for k, v in inputs.items()
                if k in names and not k.startswith("past_") and k != KEY_MASK
            }
            step = SessionStep(session=hop.session, stage=hop.stage, inputs=mine, past=request.past)
            start = time.perf_counter()
            (answer,) = self._run_steps(request.origin, [step])
            if isinstance(answer, Refused):
                raise answer
            done.append(HopDone(self.peer_id, hop.stage, (time.perf_counter() - start) * 1e3))
            commitments += answer.commitments
            if i + 1 == len(route):
                break
            hidden = answer.outputs.get("hidden_states_out")
            if hidden is None:
                raise Refused(ErrorCode.REFUSED, f"stage {hop.stage!r} has no hidden_states_out")
            inputs["hidden_states"] = hidden
            if route[i + 1].peer != self.peer_id:
                break
            i += 1
        if i + 1 == len(route):  # the last hop: the outputs go to the origin
            result = ChainStepResult(
                chain=request.chain,
                outputs=answer.outputs,
                past_len=answer.past_len,
                commitments=commitments,
            )
            return self._pass_on(
                request.origin, SESSION_RESULT, result, request.expires, done, None
            )
        nxt = route[i + 1]
        message = ChainStep(
            chain=request.chain,
            origin=request.origin,
            route=route,
            hop=i + 1,
            past=request.past,
            inputs=inputs,
            expires=request.expires,
            signature=request.signature,
            commitments=commitments,
        )
        return self._pass_on(nxt.peer, SESSION_CHAIN, message, request.expires, done, nxt)
