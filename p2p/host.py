"""`Host`: a libp2p peer behind an asyncio API. Nothing that uses it needs to know about trio.

    async with Host(HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))) as host:
        host.add_control_handler(PING, on_ping)        # coroutine on this event loop
        host.add_compute_handler(FORWARD, run_stage)   # plain function in a worker thread
        peer = await host.connect("/ip4/.../p2p/12D3KooW...")
        pong = await host.request(peer, PING, Ping(nonce=1))

Requests to one peer and protocol share one long-lived stream, multiplexed by call id, so a
request costs no stream negotiation after the first. Control handlers run on the event loop
the host was started on; compute handlers run in the host's worker threads and answer from
there, never crossing into asyncio. A handler that raises makes the caller get a
`RemoteError`; the host keeps serving. Closing the host (leaving the `async with`) closes every
stream, connection and listener, stops its worker threads, and stops the trio thread when it
was the process's last host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from p2p import _runtime
from p2p._answers import (
    COMPUTE,
    CONTROL,
    STREAM,
    HandlerEntry,
    decode_answer,
    encode_response,
)
from p2p._channel import Channel
from p2p._core import HostCore
from p2p._runtime import TrioRuntime, post
from p2p._sinks import StreamInbox
from p2p.codec import (
    ErrorCode,
    Kind,
    Message,
    ProtocolSpec,
    encode_error,
    encode_message,
)
from p2p.config import HostConfig
from p2p.errors import (
    ConnectionLost,
    FrameError,
    HostClosed,
    Refused,
    RequestTimeout,
)
from p2p.identity import Identity
from p2p.stream import EndOfStream, Stream

log = logging.getLogger(__name__)
DRAIN_TIMEOUT = 60.0  # seconds a finished stream handler keeps reading what the peer still sends

ControlHandler = Callable[[str, Any], Awaitable[Message]]
ComputeHandler = Callable[[str, Any], Any]  # a Message, or a Relay
StreamHandler = Callable[["Stream"], Awaitable[None]]


class _CallSink:
    """Receives a call's outcome in the trio thread and hands it to the waiting coroutine."""

    __slots__ = ("call_id", "cancelled", "channel", "fut", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        self.channel: Channel | None = None
        self.call_id = 0
        self.cancelled = False

    def resolve(self, kind: int, payload: bytes) -> None:
        post(self.loop, self._set, (kind, payload))

    def fail(self, exc: BaseException) -> None:
        post(self.loop, self._set_exc, exc)

    def _set(self, value: tuple[int, bytes]) -> None:
        if not self.fut.done():
            self.fut.set_result(value)

    def _set_exc(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)

    def forget(self) -> None:  # trio thread
        self.cancelled = True
        if self.channel is not None:
            self.channel.forget(self.call_id)


class Host:
    """A peer: identity, listeners, connections, handlers. An async context manager."""

    def __init__(self, config: HostConfig | None = None, *, identity: Identity | None = None):
        self.config = config or HostConfig()
        self._identity = identity
        self._owns_identity = False
        self._handlers: dict[str, HandlerEntry] = {}
        self._runtime: TrioRuntime | None = None
        self._core: HostCore | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.addrs: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        if self._identity is None:
            raise HostClosed("the host has no identity until it starts")
        return self._identity.peer_id

    @property
    def identity(self) -> Identity:
        if self._identity is None:
            raise HostClosed("the host has no identity until it starts")
        return self._identity

    async def start(self) -> None:
        """Load the identity, start the trio thread if needed, and listen."""
        if self._core is not None:
            raise RuntimeError("the host is already running")
        if self._identity is None:
            if self.config.data_dir is not None:
                self._identity = Identity.load_or_create(self.config.data_dir)
            else:
                self._identity = Identity.ephemeral()
            self._owns_identity = True
        runtime = _runtime.acquire()
        core = HostCore(
            runtime,
            self.config,
            self._identity,
            asyncio.get_running_loop(),
            self._handlers,
            self._spawn_control,
            self._spawn_stream,
        )
        try:
            self.addrs = await runtime.run(core.start)
        except BaseException:
            core.executor.shutdown(wait=False)
            _runtime.release(runtime)
            self._release_identity()
            raise
        self._runtime, self._core = runtime, core

    async def close(self) -> None:
        """Close every stream, connection and listener; stop worker threads. Idempotent."""
        core, runtime = self._core, self._runtime
        if core is None or runtime is None:
            return
        self._core = None
        try:
            await runtime.run(core.stop)
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            core.executor.shutdown(wait=True, cancel_futures=True)
            self._runtime = None
            _runtime.release(runtime)
            self._release_identity()

    def _release_identity(self) -> None:
        if self._owns_identity and self._identity is not None:
            self._identity.close()

    async def __aenter__(self) -> Host:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _running(self) -> tuple[TrioRuntime, HostCore]:
        if self._core is None or self._runtime is None:
            raise HostClosed("the host is not running; use `async with Host(...)`")
        return self._runtime, self._core

    # ---- handlers --------------------------------------------------------------------------

    def _add(self, spec: ProtocolSpec, kind: str, fn: Callable[..., Any]) -> None:
        if spec.protocol_id in self._handlers:
            raise ValueError(f"a handler for {spec.protocol_id} is already registered")
        limit = self.config.max_message_bytes.get(spec.protocol_id, spec.max_message_bytes)
        self._handlers[spec.protocol_id] = HandlerEntry(spec, kind, fn, limit)
        if self._core is not None and self._runtime is not None:
            self._runtime.run_blocking(self._core.register, spec.protocol_id)

    def add_control_handler(self, spec: ProtocolSpec, fn: ControlHandler) -> None:
        """Serve `spec` with `async fn(peer_id, request) -> response` on this event loop."""
        self._add(spec, CONTROL, fn)

    def add_compute_handler(self, spec: ProtocolSpec, fn: ComputeHandler) -> None:
        """Serve `spec` with `fn(peer_id, request) -> response` in a worker thread.

        For the hot path (model stages): the request is decoded, run and answered without
        touching the event loop. `fn` must be thread-safe. It may return a `Relay` to pass its
        result on to another peer and answer from that peer's answer.
        """
        self._add(spec, COMPUTE, fn)

    def add_stream_handler(self, spec: ProtocolSpec, fn: StreamHandler) -> None:
        """Serve message streams of `spec` with `async fn(stream)`; the stream closes after."""
        self._add(spec, STREAM, fn)

    def _entry(self, spec: ProtocolSpec) -> HandlerEntry:
        limit = self.config.max_message_bytes.get(spec.protocol_id, spec.max_message_bytes)
        return HandlerEntry(spec, "", lambda *_: None, limit)

    def _track(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn_control(
        self, channel: Channel, call_id: int, entry: HandlerEntry, payload: bytes
    ) -> None:
        self._track(self._run_control(channel, call_id, entry, payload))

    async def _run_control(
        self, channel: Channel, call_id: int, entry: HandlerEntry, payload: bytes
    ) -> None:
        kind: int
        out: bytes
        try:
            request = entry.spec.decode_request(payload)
        except FrameError as exc:
            kind, out = Kind.ERROR, encode_error(exc.code, exc.message)
        else:
            try:
                response = await entry.fn(channel.peer_id, request)
            except Refused as exc:
                kind, out = Kind.ERROR, encode_error(exc.code, exc.message)
            except asyncio.CancelledError:
                kind, out = Kind.ERROR, encode_error(ErrorCode.SHUTTING_DOWN, "the peer is closing")
            except Exception as exc:
                log.warning(
                    "%s handler raised for %s",
                    entry.spec.protocol_id,
                    channel.peer_id,
                    exc_info=True,
                )
                kind, out = (
                    Kind.ERROR,
                    encode_error(ErrorCode.HANDLER_ERROR, f"{type(exc).__name__}: {exc}"),
                )
            else:
                kind, out = encode_response(entry, response)
        if self._runtime is not None:
            try:
                self._runtime.call_soon(channel.respond, call_id, kind, out)
            except HostClosed:
                pass

    def _spawn_stream(self, channel: Channel, entry: HandlerEntry, inbox: StreamInbox) -> None:
        stream = Stream(self, channel, entry, inbox, outbound=False)
        self._track(self._run_stream_handler(stream, entry))

    async def _run_stream_handler(self, stream: Stream, entry: HandlerEntry) -> None:
        try:
            await entry.fn(stream)
        except (ConnectionLost, HostClosed):
            pass
        except Exception as exc:
            log.warning(
                "%s stream handler raised for %s",
                entry.spec.protocol_id,
                stream.peer_id,
                exc_info=True,
            )
            await stream._send_frame(
                Kind.ERROR, encode_error(ErrorCode.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")
            )
        finally:
            await stream.close()
            await stream._discard_rest(DRAIN_TIMEOUT)

    # ---- outbound --------------------------------------------------------------------------

    async def connect(self, addr: str) -> str:
        """Dial a peer by multiaddr (ending in /p2p/<peer id>); returns its peer id."""
        runtime, core = self._running()
        return await runtime.run(core.connect, addr)

    async def disconnect(self, peer_id: str) -> None:
        runtime, core = self._running()
        await runtime.run(core.disconnect, peer_id)

    def connected_peers(self) -> list[str]:
        runtime, core = self._running()
        return runtime.run_blocking(core.connected_peers)

    def is_connected(self, peer_id: str) -> bool:
        """Whether a connection to `peer_id` is open; from any thread, without waiting on the
        p2p thread (`connected_peers` does: a chained step asks this each token)."""
        return self._running()[1].is_connected(peer_id)

    def observed(self, peer_id: str) -> str | None:
        """The address a connected peer's connection comes from, as this host sees it
        (`/ip4/IP/tcp/PORT`: behind NAT, its router's public address), or None."""
        runtime, core = self._running()
        return runtime.run_blocking(core.observed, peer_id)

    async def request(
        self, peer_id: str, spec: ProtocolSpec, message: Message, *, timeout: float | None = None
    ) -> Any:
        """Send `message` to `peer_id`'s handler of `spec`; return its typed answer.

        Raises `RemoteError` if the handler failed or refused the request, `RequestTimeout`
        after `timeout` seconds (default `config.request_timeout`), `ConnectionLost` if the
        stream broke (safe to retry: a new stream is opened next time).
        """
        runtime, core = self._running()
        entry = self._entry(spec)
        payload = encode_message(message)
        if len(payload) > entry.max_message:
            raise FrameError(
                ErrorCode.TOO_LARGE,
                f"request of {len(payload)} bytes exceeds the limit of {entry.max_message} "
                f"bytes for {spec.protocol_id}",
            )
        sink = _CallSink(asyncio.get_running_loop())
        runtime.call_soon(core.start_call, peer_id, entry, payload, sink)
        deadline = self.config.request_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                kind, answer = await sink.fut
        except TimeoutError:
            self._forget(runtime, sink)
            raise RequestTimeout(
                f"{peer_id} did not answer {spec.protocol_id} within {deadline} s"
            ) from None
        except asyncio.CancelledError:
            self._forget(runtime, sink)
            raise
        return decode_answer(spec, peer_id, kind, answer)

    @staticmethod
    def _forget(runtime: TrioRuntime, sink: _CallSink) -> None:
        try:
            runtime.call_soon(sink.forget)
        except HostClosed:
            pass

    async def open_stream(self, peer_id: str, spec: ProtocolSpec) -> Stream:
        """Open a message stream to `peer_id`'s stream handler of `spec`."""
        runtime, core = self._running()
        entry = self._entry(spec)
        channel = await runtime.run(core.open_channel, peer_id, entry, STREAM)
        return Stream(self, channel, entry, core.inbox(channel), outbound=True)


__all__ = ["EndOfStream", "Host", "Stream"]
