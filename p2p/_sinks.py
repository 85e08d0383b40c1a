"""Where the trio side of a host leaves what it receives: a call's outcome for a waiter in
the trio thread (`TrioSink`), a message stream's items for asyncio (`StreamInbox`)."""

from __future__ import annotations

import asyncio
from typing import Any

import trio

from p2p._channel import Channel
from p2p._runtime import post


class TrioSink:
    """A call's outcome, for a waiter in the trio thread."""

    __slots__ = ("call_id", "cancelled", "channel", "done", "outcome")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.outcome: tuple[int, bytes] | BaseException | None = None
        self.channel: Channel | None = None
        self.call_id = 0
        self.cancelled = False

    def resolve(self, kind: int, payload: bytes) -> None:
        self.outcome = (kind, payload)
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.outcome = exc
        self.done.set()


class StreamInbox:
    """What a message stream's channel delivers to asyncio: (kind, payload or error) items."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    def put(self, kind: int, item: Any) -> None:
        post(self.loop, self.queue.put_nowait, (kind, item))
