"""Chained requests: a route the broker signed, run hop after hop by the providers on it, each
relaying the hidden states straight to the next (the broker hears only the end).

`check_route` is what a provider checks before it computes anything for a chained request;
`finisher` turns the next hop's outcome into this hop's answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from p2p import ErrorCode, P2PError, Refused, RemoteError, RequestTimeout, verify
from proto.forward import (
    BAD_ANSWER,
    MAX_HOPS,
    ROUTE_DOMAIN,
    TIMEOUT,
    UNREACHABLE,
    ChainAccepted,
    ChainBroken,
    Forward,
    ForwardResult,
    Hop,
    HopDone,
    route_bytes,
)
from proto.session import StepHop


def check_route(request: Forward, peer: str, me: str, broker: str) -> None:
    """Refuse (`Refused`) a chained request that is not ours to run: no broker, a bad hop,
    the wrong sender, an expired route, or one our broker did not sign."""
    route, i = request.route, request.hop
    if not broker:
        raise Refused(ErrorCode.REFUSED, "this provider takes no chained requests")
    if len(route) > MAX_HOPS or not 0 <= i < len(route):
        raise Refused(ErrorCode.REFUSED, f"a route has 1 to {MAX_HOPS} hops, hop within it")
    if route[i].peer != me or route[i].stage != request.stage:
        raise Refused(ErrorCode.REFUSED, f"hop {i} of this route is not this provider's")
    if peer != (broker if i == 0 else route[i - 1].peer):
        raise Refused(ErrorCode.REFUSED, f"hop {i} of this route comes from another peer")
    if request.expires < time.time():
        raise Refused(ErrorCode.REFUSED, "the route has expired")
    signed = route_bytes(request.chain, route, request.expires)
    if not verify(broker, signed, request.signature, domain=ROUTE_DOMAIN):
        raise Refused(ErrorCode.REFUSED, "the route is not signed by this provider's broker")


def finisher(
    done: list[HopDone], nxt: Hop | StepHop | None, relayed: Callable[[], None]
) -> Callable[[Any], ForwardResult | ChainBroken]:
    """How a chain hop answers once the next hop (`nxt`; None: the broker, or the client
    that sent a chained session step) has answered."""

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
