"""`Stream`: a flow-controlled message stream to one peer, opened by `Host.open_stream` or
handed to a stream handler. Its frames go through the host's trio thread; this side is
asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from p2p._answers import HandlerEntry
from p2p._channel import Channel
from p2p._runtime import TrioRuntime, post
from p2p._sinks import StreamInbox
from p2p.codec import ErrorCode, Kind, Message, decode_error, encode_message
from p2p.errors import ConnectionLost, FrameError, HostClosed, RemoteError


class StreamHost(Protocol):
    """The host side a stream needs: its trio runtime (the `Host` provides it)."""

    _runtime: TrioRuntime | None

    def _running(self) -> tuple[TrioRuntime, Any]: ...


class EndOfStream(ConnectionLost):
    """The peer finished sending on this stream."""


class Stream:
    """A flow-controlled message stream to one peer.

    `send` waits until the peer has room (credit) and the message is written; `recv` returns
    the next message, raising `EndOfStream` when the peer has finished, `RemoteError` if its
    handler failed, `ConnectionLost` if the stream broke. `async for msg in stream` reads to the
    end. Close it (or use `async with`) when done sending.
    """

    def __init__(
        self,
        host: StreamHost,
        channel: Channel,
        entry: HandlerEntry,
        inbox: StreamInbox,
        outbound: bool,
    ) -> None:
        self._host = host
        self._channel = channel
        self._entry = entry
        self._inbox = inbox
        self._decode = entry.spec.decode_response if outbound else entry.spec.decode_request
        self._closed = False
        self._ended: BaseException | None = None
        self.peer_id = channel.peer_id
        self.protocol_id = entry.spec.protocol_id

    async def send(self, message: Message) -> None:
        if self._closed:
            raise ConnectionLost("this stream was closed for sending")
        payload = encode_message(message)
        if len(payload) > self._entry.max_message:
            raise FrameError(
                ErrorCode.TOO_LARGE,
                f"message of {len(payload)} bytes exceeds the limit of "
                f"{self._entry.max_message} bytes for {self.protocol_id}",
            )
        await self._send_frame(Kind.MESSAGE, payload)

    async def _send_frame(self, kind: int, payload: bytes) -> None:
        runtime, _ = self._host._running()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        channel = self._channel

        def settle(ok: bool) -> None:
            if not done.done():
                if ok:
                    done.set_result(None)
                else:
                    done.set_exception(self._lost())

        def on_sent(ok: bool) -> None:
            post(loop, settle, ok)

        def enqueue() -> None:
            channel.send(kind, 1, payload, on_sent)

        runtime.call_soon(enqueue)
        await done

    def _lost(self) -> ConnectionLost:
        return ConnectionLost(f"the {self.protocol_id} stream to {self.peer_id} closed")

    async def recv(self) -> Any:
        if self._ended is not None:
            raise self._ended
        kind, item = await self._inbox.queue.get()
        if kind == Kind.MESSAGE:
            runtime, _ = self._host._running()
            runtime.call_soon(self._channel.consumed, len(item))
            return self._decode(item)
        if kind == Kind.END:
            self._ended = EndOfStream(f"{self.peer_id} finished sending on {self.protocol_id}")
        elif kind == Kind.ERROR:
            info = decode_error(item)
            self._ended = RemoteError(info.code, info.message, self.peer_id)
        else:  # CLOSED
            self._ended = ConnectionLost(
                f"the {self.protocol_id} stream to {self.peer_id} closed"
                + (f": {item}" if item else "")
            )
        raise self._ended

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.recv()
            except EndOfStream:
                return

    async def _discard_rest(self, timeout: float) -> None:
        """Read and drop what the peer still sends (granting it credit) until it finishes, so
        a handler that returns early never leaves the peer's `send` waiting; after `timeout`
        seconds the stream is reset."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await self.recv()
        except (ConnectionLost, RemoteError, HostClosed, FrameError):
            return
        except TimeoutError:
            runtime = self._host._runtime
            if runtime is not None:
                try:
                    runtime.call_soon(self._channel.abort)
                except HostClosed:
                    pass

    async def close(self) -> None:
        """Tell the peer we will send no more; the stream ends once both sides have."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._send_frame(Kind.END, b"")
        except (ConnectionLost, HostClosed):
            pass

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
