"""Handler dispatch shared by the libp2p host and the in-memory one (no trio here): decode a
request, run a handler, encode its answer or an error frame, and decode a call's answer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2p.codec import (
    ErrorCode,
    Kind,
    ProtocolSpec,
    Relay,
    decode_error,
    encode_error,
    encode_message,
)
from p2p.errors import FrameError, Refused, RemoteError

log = logging.getLogger("p2p._core")

# Handler kinds
CONTROL = "control"  # coroutine on the asyncio loop
COMPUTE = "compute"  # plain function in a worker thread
STREAM = "stream"  # coroutine on the asyncio loop, given a message stream


@dataclass(frozen=True)
class HandlerEntry:
    spec: ProtocolSpec
    kind: str
    fn: Callable[..., Any]
    max_message: int


def decode_answer(spec: ProtocolSpec, peer_id: str, kind: int, payload: bytes) -> Any:
    """A call's answer: the typed response, or `RemoteError` for an error frame."""
    if kind == Kind.ERROR:
        info = decode_error(payload)
        raise RemoteError(info.code, info.message, peer_id)
    return spec.decode_response(payload)


def execute(entry: HandlerEntry, peer_id: str, payload: bytes) -> tuple[int, bytes] | Relay:
    """Decode, run a compute handler, encode: (RESPONSE or ERROR, payload), or the handler's
    `Relay`. Never raises."""
    try:
        request = entry.spec.decode_request(payload)
    except FrameError as exc:
        return Kind.ERROR, encode_error(exc.code, exc.message)
    try:
        response = entry.fn(peer_id, request)
    except Refused as exc:
        return Kind.ERROR, encode_error(exc.code, exc.message)
    except Exception as exc:
        log.warning("%s handler raised for %s", entry.spec.protocol_id, peer_id, exc_info=True)
        return Kind.ERROR, encode_error(ErrorCode.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")
    if isinstance(response, Relay):
        return response
    return encode_response(entry, response)


def encode_response(entry: HandlerEntry, response: Any) -> tuple[int, bytes]:
    """Check and encode a handler's answer: (RESPONSE or ERROR, payload). Never raises."""
    allowed = entry.spec.response
    if not isinstance(response, allowed):
        names = (
            ", ".join(t.__name__ for t in allowed)
            if isinstance(allowed, tuple)
            else allowed.__name__
        )
        return Kind.ERROR, encode_error(
            ErrorCode.HANDLER_ERROR,
            f"handler returned {type(response).__name__}, the protocol answers {names}",
        )
    try:
        out = encode_message(response)
    except Exception as exc:
        return Kind.ERROR, encode_error(ErrorCode.HANDLER_ERROR, f"cannot encode answer: {exc}")
    if len(out) > entry.max_message:
        return Kind.ERROR, encode_error(
            ErrorCode.TOO_LARGE,
            f"answer of {len(out)} bytes exceeds the limit of {entry.max_message} bytes",
        )
    return Kind.RESPONSE, out


def error(code: str, message: str) -> tuple[int, bytes]:
    """An error frame's (kind, payload)."""
    return Kind.ERROR, encode_error(code, message)
