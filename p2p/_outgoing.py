"""A message on its way out of a channel: cut into frames of at most one chunk each, so large
messages interleave with small ones (`_channel.py` decides the order)."""

from __future__ import annotations

from collections.abc import Callable

from p2p.codec import FLAG_MORE, HEADER, HEADER_SIZE


class Outgoing:
    __slots__ = ("call_id", "kind", "offset", "on_sent", "payload")

    def __init__(
        self, kind: int, call_id: int, payload: bytes, on_sent: Callable[[bool], None] | None
    ) -> None:
        self.kind = kind
        self.call_id = call_id
        self.payload = memoryview(payload)
        self.offset = 0
        self.on_sent = on_sent

    def next_frame_size(self, chunk: int) -> int:
        return HEADER_SIZE + min(chunk, len(self.payload) - self.offset)

    def take(self, chunk: int) -> bytes:
        start = self.offset
        end = min(start + chunk, len(self.payload))
        self.offset = end
        flags = FLAG_MORE if end < len(self.payload) else 0
        return HEADER.pack(end - start, self.kind, flags, self.call_id) + self.payload[start:end]

    @property
    def done(self) -> bool:
        return self.offset >= len(self.payload)
