"""The wire codec: typed messages, protocol specs, and the frame format of our streams.

Messages are frozen `msgspec` structs encoded as msgpack. Each carries a `type` field naming
its type and version (`"Ping/1"`), so a decoder for a protocol accepts exactly that protocol's
types at the versions it knows, and a peer speaking another revision gets a clear error rather
than a misread. A protocol id carries its version too (`/fusionai/<name>/<version>`), which
libp2p's protocol negotiation selects. Nothing is pickled.

Frames (one stream carries many calls):

    | length u32 | kind u8 | flags u8 | call_id u64 | payload (length bytes) |

A message larger than the chunk size is split into several frames of the same call id, all but
the last flagged `MORE`. `CREDIT` frames grant the peer more bytes to send (flow control).
The frame decoder and the reassembler here are sans-IO, so they are tested without sockets.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, Union

import msgspec

from p2p.errors import FrameError

HEADER = struct.Struct("!IBBQ")
HEADER_SIZE = HEADER.size
FLAG_MORE = 0x01
MAX_CHUNK = 1024 * 1024  # largest frame payload any peer may send; bytes
_PROTOCOL_RE = re.compile(r"\A/fusionai/[a-z0-9][a-z0-9_.-]*/[0-9]+(\.[0-9]+)*\Z")
_TAG_RE = re.compile(r"\A[A-Za-z][A-Za-z0-9_.]*/[0-9]+\Z")


class Kind(IntEnum):
    """What a frame carries."""

    REQUEST = 1  # a call's request (client -> server)
    RESPONSE = 2  # a call's response (server -> client)
    ERROR = 3  # a call failed; payload is an `ErrorInfo`; call id 0: the whole stream
    CREDIT = 4  # payload: u64 more bytes the receiver of this frame may send
    MESSAGE = 5  # a message on a message stream
    END = 6  # the sender will send no more messages on this stream


class ErrorCode(StrEnum):
    HANDLER_ERROR = "handler_error"  # the remote handler raised
    BAD_REQUEST = "bad_request"  # the message did not decode or validate
    TOO_LARGE = "too_large"  # a frame or message exceeded its limit
    PROTOCOL_ERROR = "protocol_error"  # the peer broke the frame protocol
    SHUTTING_DOWN = "shutting_down"  # the peer is closing
    BUSY = "busy"  # the handler's queue is full: retry later or elsewhere
    REFUSED = "refused"  # the handler will not do this (invalid input, not allowed, over budget)
    NOT_FOUND = "not_found"  # what the request names (a stage, a session) is not here


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    """Base of every wire message: frozen, typed, tagged with its class name.

    Subclasses repeat `frozen=True` (so type checkers see it) and set a versioned tag:
    `class Ping(Message, frozen=True, tag="Ping/1")`; an incompatible change bumps the number.
    Unknown fields are ignored on decode, so a newer peer may add optional fields without one.
    """


class ErrorInfo(msgspec.Struct, frozen=True):
    code: str
    message: str


_error_encoder = msgspec.msgpack.Encoder()
_error_decoder = msgspec.msgpack.Decoder(ErrorInfo)
_credit = struct.Struct("!Q")


def encode_error(code: str, message: str) -> bytes:
    return _error_encoder.encode(ErrorInfo(code, message[:4096]))


def decode_error(payload: bytes) -> ErrorInfo:
    try:
        return _error_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return ErrorInfo(ErrorCode.PROTOCOL_ERROR, f"undecodable error frame: {exc}")


def encode_credit(amount: int) -> bytes:
    return _credit.pack(amount)


def decode_credit(payload: bytes) -> int:
    if len(payload) != _credit.size:
        raise FrameError(ErrorCode.PROTOCOL_ERROR, f"credit frame of {len(payload)} bytes")
    return int(_credit.unpack(payload)[0])


def _union(types: type[Message] | tuple[type[Message], ...]) -> Any:
    for t in types if isinstance(types, tuple) else (types,):
        tag = t.__struct_config__.tag
        if not isinstance(tag, str) or not _TAG_RE.match(tag):
            raise ValueError(
                f"{t.__name__} needs a versioned tag, e.g. "
                f'`class {t.__name__}(Message, frozen=True, tag="{t.__name__}/1")`'
            )
    if isinstance(types, tuple):
        if not types:
            raise ValueError("a protocol needs at least one message type each way")
        return Union[types]  # noqa: UP007 - built at runtime from a tuple
    return types


@dataclass(frozen=True)
class ProtocolSpec:
    """A protocol: its id, the message types each way, and its largest message in bytes.

    For request/response protocols `request` flows client -> server and `response` back; for
    message streams, `request` is what the opener sends and `response` what it receives.
    """

    protocol_id: str
    request: type[Message] | tuple[type[Message], ...]
    response: type[Message] | tuple[type[Message], ...]
    # Largest encoded message accepted on this protocol; bytes.
    max_message_bytes: int = 1024 * 1024
    _req_decoder: Any = field(init=False, repr=False, compare=False)
    _resp_decoder: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _PROTOCOL_RE.match(self.protocol_id):
            raise ValueError(
                f"protocol id {self.protocol_id!r} must look like /fusionai/<name>/<version>"
            )
        if self.max_message_bytes < 1:
            raise ValueError("max_message_bytes must be positive")
        object.__setattr__(self, "_req_decoder", msgspec.msgpack.Decoder(_union(self.request)))
        object.__setattr__(self, "_resp_decoder", msgspec.msgpack.Decoder(_union(self.response)))

    def decode_request(self, payload: bytes | memoryview) -> Any:
        return _decode(self._req_decoder, payload, self.protocol_id)

    def decode_response(self, payload: bytes | memoryview) -> Any:
        return _decode(self._resp_decoder, payload, self.protocol_id)


_encoder = msgspec.msgpack.Encoder()


def encode_message(message: Message) -> bytes:
    """Encode a message to msgpack bytes."""
    return _encoder.encode(message)


def _decode(decoder: Any, payload: bytes | memoryview, protocol_id: str) -> Any:
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise FrameError(
            ErrorCode.BAD_REQUEST, f"invalid message for {protocol_id}: {exc}"
        ) from None
    except Exception as exc:  # DecodeError, and e.g. UnicodeDecodeError for a bad tag string
        raise FrameError(
            ErrorCode.BAD_REQUEST, f"malformed message for {protocol_id}: {exc}"
        ) from None


def encode_frames(
    kind: int, call_id: int, payload: bytes | memoryview, chunk_size: int
) -> Iterator[bytes]:
    """Split one message into frames of at most `chunk_size` payload bytes each."""
    view = memoryview(payload)
    total = len(view)
    if total <= chunk_size:
        yield HEADER.pack(total, kind, 0, call_id) + view
        return
    for start in range(0, total, chunk_size):
        part = view[start : start + chunk_size]
        flags = FLAG_MORE if start + chunk_size < total else 0
        yield HEADER.pack(len(part), kind, flags, call_id) + part


@dataclass(frozen=True)
class Frame:
    kind: int
    flags: int
    call_id: int
    payload: bytes


class FrameDecoder:
    """Turns a byte stream into frames. Sans-IO: feed bytes, get frames.

    A frame longer than `max_frame` raises `FrameError(too_large)`: the stream can no longer be
    trusted and must be closed. Unknown kinds are returned as they are (the caller answers them).
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEADER_SIZE:
            length, kind, flags, call_id = HEADER.unpack_from(buf, pos)
            if length > self.max_frame:
                raise FrameError(
                    ErrorCode.TOO_LARGE,
                    f"frame of {length} bytes exceeds the limit of {self.max_frame} bytes",
                )
            end = pos + HEADER_SIZE + length
            if len(buf) < end:
                break
            frames.append(Frame(kind, flags, call_id, bytes(buf[pos + HEADER_SIZE : end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)


class Reassembler:
    """Joins the chunks of multi-frame messages, enforcing a limit on each message's size.

    `add` returns the whole payload when a message completes, else None. A message over the
    limit raises `FrameError(too_large)` once; its later chunks are dropped silently, so the
    stream stays usable.
    """

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._partial: dict[tuple[int, int], bytearray] = {}
        self._dropping: set[tuple[int, int]] = set()

    def add(self, frame: Frame) -> bytes | None:
        key = (frame.kind, frame.call_id)
        more = bool(frame.flags & FLAG_MORE)
        if key in self._dropping:
            if not more:
                self._dropping.discard(key)
            return None
        parts = self._partial.get(key)
        size = len(frame.payload) + (len(parts) if parts is not None else 0)
        if size > self.max_message:
            self._partial.pop(key, None)
            if more:
                self._dropping.add(key)
            raise FrameError(
                ErrorCode.TOO_LARGE,
                f"message exceeds the limit of {self.max_message} bytes for this protocol",
            )
        if parts is None:
            if not more:
                return frame.payload
            self._partial[key] = bytearray(frame.payload)
            return None
        parts += frame.payload
        if more:
            return None
        del self._partial[key]
        return bytes(parts)

    def discard(self, kind: int, call_id: int) -> None:
        self._partial.pop((kind, call_id), None)

    @property
    def buffered(self) -> int:
        return sum(len(p) for p in self._partial.values())


@dataclass(frozen=True)
class Relay:
    """A compute handler's answer that is not ready yet.

    `message` is sent to `peer`'s handler of `spec` (dialling `addrs` first if there is no
    connection), from the trio thread; `finish` then turns that peer's answer, or the
    `P2PError` the call ended with, into this handler's answer. `finish` runs in the trio
    thread, so it must be quick; the message is encoded in the worker thread.
    """

    peer: str
    addrs: Sequence[str]
    spec: ProtocolSpec
    message: Message
    timeout: float
    finish: Callable[[Any], Message]
    max_message: int = 0  # 0: the spec's limit
