"""Errors raised by the p2p layer. Each says what went wrong and what to do next."""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error this package raises."""


class IdentityError(P2PError):
    """The identity key file is missing, unreadable, corrupt or has unsafe permissions."""


class IdentityInUse(IdentityError):
    """Another process holds the identity in this data directory."""


class HostClosed(P2PError):
    """The host is not running (not started yet, or already closed)."""


class ConnectionLost(P2PError):
    """The stream or connection to the peer closed before the call finished; retry the call."""


class RequestTimeout(P2PError, TimeoutError):
    """The peer did not answer within the deadline."""


class FrameError(P2PError):
    """A frame or message could not be decoded: malformed, unknown type or too large.

    `code` is one of the `ErrorCode` values in `p2p.codec`.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Refused(P2PError):
    """Raised by a handler to answer with a typed error instead of `handler_error`: the caller
    gets a `RemoteError` with this `code` (an `ErrorCode`: busy, refused, not_found, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RemoteError(P2PError):
    """The peer answered with an error: its handler raised, or it rejected our request.

    `code` is one of the `ErrorCode` values in `p2p.codec` (for example `handler_error`,
    `bad_request`, `too_large`); `message` is the peer's explanation.
    """

    def __init__(self, code: str, message: str, peer_id: str = "") -> None:
        where = f" from {peer_id}" if peer_id else ""
        super().__init__(f"remote error{where}: {code}: {message}")
        self.code = code
        self.message = message
        self.peer_id = peer_id
