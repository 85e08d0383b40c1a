"""The trio side of a host: the libp2p host, its channels, and handler dispatch.

Everything here runs in the p2p trio thread except `_run_compute`, which runs in a worker
thread and answers straight back into trio: compute requests never touch the asyncio loop.
A compute handler may also answer with a `Relay`: its result goes on to another peer first,
from the trio side (no thread waits on it), and the answer is made from that peer's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import trio

from p2p._answers import (
    COMPUTE,
    STREAM,
    HandlerEntry,
    decode_answer,
    encode_response,
    execute,
)
from p2p._channel import Channel
from p2p._runtime import TrioRuntime, post
from p2p._sinks import StreamInbox, TrioSink
from p2p.codec import (
    ErrorCode,
    Kind,
    Relay,
    encode_error,
    encode_message,
)
from p2p.config import HostConfig
from p2p.errors import (
    ConnectionLost,
    FrameError,
    HostClosed,
    P2PError,
    RequestTimeout,
)
from p2p.identity import Identity

log = logging.getLogger(__name__)


CLOSED = -1  # inbox item kind: the channel closed (item: the error or None)


class HostCore:
    """The libp2p host and everything it serves; lives in the trio thread."""

    def __init__(
        self,
        runtime: TrioRuntime,
        config: HostConfig,
        identity: Identity,
        loop: asyncio.AbstractEventLoop,
        handlers: dict[str, HandlerEntry],
        spawn_control: Callable[[Channel, int, HandlerEntry, bytes], None],
        spawn_stream: Callable[[Channel, HandlerEntry, StreamInbox], None],
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.identity = identity
        self.loop = loop
        self.handlers = handlers
        self._spawn_control = spawn_control
        self._spawn_stream = spawn_stream
        self.executor = ThreadPoolExecutor(
            max_workers=config.compute_threads, thread_name_prefix="fusionai-compute"
        )
        self.addrs: list[str] = []
        self._lp: Any = None
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._clients: dict[tuple[str, str], Channel] = {}
        self._opening: dict[tuple[str, str], list[tuple[bytes, Any]]] = {}
        self._channels: set[Channel] = set()
        self._inboxes: dict[Channel, StreamInbox] = {}
        self.closing = False

    # ---- lifecycle (trio) ---------------------------------------------------------------------

    async def start(self) -> list[str]:
        """Start listening; returns our multiaddrs (with /p2p/<peer id>)."""
        nursery = self.runtime._nursery
        assert nursery is not None
        await nursery.start(self._serve)
        return self.addrs

    async def _serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        import multiaddr

        from p2p._libp2p import make_host

        self._lp = make_host(self.identity)
        listen = [multiaddr.Multiaddr(a) for a in self.config.listen]
        try:
            async with self._lp.run(listen_addrs=listen):
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        for protocol_id in self.handlers:
                            self.register(protocol_id)
                        self.addrs = [str(a) for a in self._lp.get_addrs()]
                        task_status.started()
                        await self._stop.wait()
                        for channel in list(self._channels):
                            channel.abort()
                        nursery.cancel_scope.cancel()
                finally:
                    # Close inside run(): once run() has exited, libp2p's network service is
                    # gone and close() leaves dialled sockets open (seen as CLOSE_WAIT).
                    await self._close_libp2p()
        finally:
            await self._close_libp2p()
            self._stopped.set()

    async def _close_libp2p(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            try:
                await self._lp.close()  # idempotent
            except Exception:
                log.debug("closing the libp2p host", exc_info=True)

    async def stop(self) -> None:
        self.closing = True
        self._stop.set()
        await self._stopped.wait()

    def register(self, protocol_id: str) -> None:
        """Route inbound streams of `protocol_id` to its handler (trio thread)."""
        if self._lp is None:
            return  # registered when the host starts

        async def on_stream(stream: Any) -> None:
            await self._serve_stream(protocol_id, stream)

        from libp2p.custom_types import TProtocol

        self._lp.set_stream_handler(TProtocol(protocol_id), on_stream)

    # ---- inbound ---------------------------------------------------------------------------

    async def _serve_stream(self, protocol_id: str, stream: Any) -> None:
        """libp2p's handler for our protocols: must never let an exception escape."""
        channel: Channel | None = None
        try:
            entry = self.handlers[protocol_id]
            channel = Channel(
                stream,
                mode="stream" if entry.kind == STREAM else "server",
                protocol_id=protocol_id,
                owner=self,
                recv_window=self.config.recv_window,
                chunk_size=self.config.chunk_size,
                max_message=entry.max_message,
                max_concurrent=self.config.max_concurrent_requests,
            )
            self._channels.add(channel)
            if entry.kind == STREAM:
                inbox = StreamInbox(self.loop)
                self._inboxes[channel] = inbox
                post(self.loop, self._spawn_stream, channel, entry, inbox)
            await channel.run()
        except Exception:
            log.exception("serving a %s stream", protocol_id)
        finally:
            if channel is not None:
                self._channels.discard(channel)

    def on_request(self, channel: Channel, call_id: int, payload: bytes) -> None:
        entry = self.handlers.get(channel.protocol_id)
        if entry is None or self.closing:
            channel.respond(
                call_id, Kind.ERROR, encode_error(ErrorCode.SHUTTING_DOWN, "the peer is closing")
            )
        elif entry.kind == COMPUTE:
            try:
                self.executor.submit(self._run_compute, channel, call_id, entry, payload)
            except RuntimeError:  # executor shut down
                channel.respond(
                    call_id,
                    Kind.ERROR,
                    encode_error(ErrorCode.SHUTTING_DOWN, "the peer is closing"),
                )
        else:
            post(self.loop, self._spawn_control, channel, call_id, entry, payload)

    def _run_compute(
        self, channel: Channel, call_id: int, entry: HandlerEntry, payload: bytes
    ) -> None:
        result = execute(entry, channel.peer_id, payload)
        try:
            if isinstance(result, Relay):
                try:
                    out = encode_message(result.message)
                except Exception as exc:
                    failed = FrameError(ErrorCode.HANDLER_ERROR, f"cannot encode: {exc}")
                    self.runtime.call_soon(self._finish, channel, call_id, entry, result, failed)
                    return
                self.runtime.call_soon(self._start_relay, channel, call_id, entry, result, out)
            else:
                self.runtime.call_soon(channel.respond, call_id, *result)
        except HostClosed:
            pass

    def _start_relay(
        self, channel: Channel, call_id: int, entry: HandlerEntry, relay: Relay, payload: bytes
    ) -> None:
        if self.closing or self._nursery is None:
            self._finish(channel, call_id, entry, relay, HostClosed("the host is closing"))
        else:
            self._nursery.start_soon(self._relay, channel, call_id, entry, relay, payload)

    async def _relay(
        self, channel: Channel, call_id: int, entry: HandlerEntry, relay: Relay, payload: bytes
    ) -> None:
        """Send a handler's relayed message on, then answer `call_id` from its outcome."""
        outcome: Any
        try:
            outcome = await self.call(relay, payload)
        except P2PError as exc:
            outcome = exc
        except Exception as exc:  # nothing may escape a task: it would stop the host
            log.warning("relaying a %s call", entry.spec.protocol_id, exc_info=True)
            outcome = ConnectionLost(f"relay failed: {type(exc).__name__}: {exc}")
        self._finish(channel, call_id, entry, relay, outcome)

    @staticmethod
    def _finish(
        channel: Channel, call_id: int, entry: HandlerEntry, relay: Relay, outcome: Any
    ) -> None:
        """Answer a relayed call from its outcome (an answer or a `P2PError`); always called
        once per relay, so handlers may count on it."""
        answer: tuple[int, bytes]
        try:
            response = relay.finish(outcome)
        except Exception as exc:
            log.warning("finishing a relayed %s call", entry.spec.protocol_id, exc_info=True)
            answer = (Kind.ERROR, encode_error(ErrorCode.HANDLER_ERROR, f"relay: {exc}"))
        else:
            answer = encode_response(entry, response)
        channel.respond(call_id, *answer)

    async def call(self, relay: Relay, payload: bytes) -> Any:
        """Request `relay.message` (already encoded as `payload`) from `relay.peer`, from the
        trio thread; returns the decoded answer or raises a `P2PError`."""
        limit = relay.max_message or relay.spec.max_message_bytes
        if len(payload) > limit:
            raise FrameError(ErrorCode.TOO_LARGE, f"{len(payload)} bytes exceed {limit}")
        if not self.is_connected(relay.peer):
            errors = []
            for addr in relay.addrs:
                try:
                    if await self.connect(addr) == relay.peer:
                        break
                except (P2PError, ValueError) as exc:
                    errors.append(str(exc))
            else:
                raise ConnectionLost(f"could not reach {relay.peer}: {'; '.join(errors)}")
        sink = TrioSink()
        entry = HandlerEntry(relay.spec, "", lambda *_: None, limit)
        self.start_call(relay.peer, entry, payload, sink)
        with trio.move_on_after(relay.timeout):
            await sink.done.wait()
        if not sink.done.is_set():
            sink.cancelled = True
            if sink.channel is not None:
                sink.channel.forget(sink.call_id)
            raise RequestTimeout(
                f"{relay.peer} did not answer {relay.spec.protocol_id} within {relay.timeout} s"
            )
        outcome = sink.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return decode_answer(relay.spec, relay.peer, *outcome)

    def on_message(self, channel: Channel, kind: int, payload: bytes) -> None:
        inbox = self._inboxes.get(channel)
        if inbox is not None:
            inbox.put(kind, payload)

    def on_closed(self, channel: Channel, error: BaseException | None) -> None:
        key = (channel.peer_id, channel.protocol_id)
        if self._clients.get(key) is channel:
            del self._clients[key]
        inbox = self._inboxes.pop(channel, None)
        if inbox is not None:
            inbox.put(CLOSED, error)

    # ---- outbound --------------------------------------------------------------------------

    async def connect(self, addr: str) -> str:
        import multiaddr
        from libp2p.peer.peerinfo import info_from_p2p_addr

        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:
            raise ValueError(
                f"{addr!r} is not a peer multiaddr like /ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...: "
                f"{exc}"
            ) from None
        # An explicit dial is the caller's decision to try again: libp2p's negative cache of
        # peers that recently failed would otherwise refuse it for a while (a broker that
        # restarted could not be rejoined until the entry expired).
        network = self._lp.get_network()
        unblock = getattr(network, "unblock_peer", None)
        if unblock is not None:
            unblock(info.peer_id)
        # Dial this address: libp2p dials one TCP address per peer, the first it knows, and
        # what identify taught it may be stale or only valid where the peer runs (a broker
        # behind a router, restarted, was redialled at an address its providers cannot reach).
        self._lp.get_peerstore().clear_addrs(info.peer_id)
        try:
            with trio.fail_after(self.config.connect_timeout):
                await self._lp.connect(info)
        except trio.TooSlowError:
            raise ConnectionLost(
                f"could not reach {addr} within {self.config.connect_timeout} s"
            ) from None
        except Exception as exc:
            raise ConnectionLost(f"could not connect to {addr}: {exc}") from exc
        return str(info.peer_id)

    def connected_peers(self) -> list[str]:
        return [str(p) for p in self._lp.get_network().connections]

    def is_connected(self, peer_id: str) -> bool:
        """Whether a connection to `peer_id` is open. Safe from any thread: one lookup in the
        swarm's table of connections, atomic under the GIL (no trip to the trio thread)."""
        try:
            pid = _peer_id(peer_id)
        except ValueError:
            return False
        return bool(self._lp.get_network().connections.get(pid))

    def observed(self, peer_id: str) -> str | None:
        """/ip4/IP/tcp/PORT that a live connection to `peer_id` comes from (None if none)."""
        conns = self._lp.get_network().connections.get(_peer_id(peer_id)) or []
        for conn in conns if isinstance(conns, list) else [conns]:
            try:
                ip, port = conn.muxed_conn.get_remote_address()
            except (AttributeError, TypeError, ValueError):
                continue
            return f"/ip4/{ip}/tcp/{port}" if "." in str(ip) else f"/ip6/{ip}/tcp/{port}"
        return None

    async def disconnect(self, peer_id: str) -> None:
        from libp2p.peer.id import ID

        await self._lp.disconnect(ID.from_base58(peer_id))

    async def open_channel(self, peer_id: str, entry: HandlerEntry, mode: str) -> Channel:
        """Open a new stream of `entry`'s protocol to `peer_id` and serve it."""
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        if self.closing or self._nursery is None:
            raise HostClosed("the host is closing")
        protocol_id = entry.spec.protocol_id
        try:
            pid = ID.from_base58(peer_id)
        except Exception:
            raise ValueError(f"{peer_id!r} is not a peer id") from None
        try:
            with trio.fail_after(self.config.connect_timeout):
                stream = await self._lp.new_stream(pid, [TProtocol(protocol_id)])
        except trio.TooSlowError:
            raise ConnectionLost(
                f"could not open {protocol_id} to {peer_id} within {self.config.connect_timeout} s"
            ) from None
        except Exception as exc:
            raise ConnectionLost(f"could not open {protocol_id} to {peer_id}: {exc}") from exc
        channel = Channel(
            stream,
            mode=mode,
            protocol_id=protocol_id,
            owner=self,
            recv_window=self.config.recv_window,
            chunk_size=self.config.chunk_size,
            max_message=entry.max_message,
        )
        self._channels.add(channel)
        if mode == STREAM:
            self._inboxes[channel] = StreamInbox(self.loop)
        self._nursery.start_soon(self._run_channel, channel)
        return channel

    async def _run_channel(self, channel: Channel) -> None:
        try:
            await channel.run()
        finally:
            self._channels.discard(channel)

    def inbox(self, channel: Channel) -> StreamInbox:
        return self._inboxes[channel]

    def start_call(self, peer_id: str, entry: HandlerEntry, payload: bytes, sink: Any) -> None:
        """Send a request on the long-lived stream to `peer_id`, opening it if needed.

        Calls made while the stream is being opened queue up and go out in the order they
        were made.
        """
        if self.closing or self._nursery is None:
            sink.fail(HostClosed("the host is closing"))
            return
        key = (peer_id, entry.spec.protocol_id)
        channel = self._clients.get(key)
        if channel is not None and not channel.closed:
            sink.call_id = channel.call(payload, sink)
            sink.channel = channel
            return
        queued = self._opening.get(key)
        if queued is not None:
            queued.append((payload, sink))
            return
        self._opening[key] = [(payload, sink)]
        self._nursery.start_soon(self._open_and_send, peer_id, entry)

    async def _open_and_send(self, peer_id: str, entry: HandlerEntry) -> None:
        key = (peer_id, entry.spec.protocol_id)
        try:
            channel = await self.open_channel(peer_id, entry, "client")
        except (P2PError, ValueError) as exc:
            for _, sink in self._opening.pop(key):
                sink.fail(exc)
            return
        except BaseException:
            for _, sink in self._opening.pop(key):
                sink.fail(HostClosed("the host is closing"))
            raise
        self._clients[key] = channel
        for payload, sink in self._opening.pop(key):
            if not sink.cancelled:
                sink.call_id = channel.call(payload, sink)
                sink.channel = channel


@functools.lru_cache(maxsize=4096)
def _peer_id(peer_id: str) -> Any:
    """`peer_id` parsed (`libp2p.peer.id.ID`), cached: chained steps name the same few peers
    token after token."""
    from libp2p.peer.id import ID

    return ID.from_base58(peer_id)
