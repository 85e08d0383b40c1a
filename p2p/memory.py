"""An in-memory network of hosts for tests: no sockets, no trio, the same typed API as `Host`.

    net = MemoryNetwork()
    async with net.host() as a, net.host() as b:
        b.add_control_handler(SPEC, handler)
        answer = await a.request(b.peer_id, SPEC, message)

Requests go through the real wire codec (messages are encoded, size-checked and decoded on
each side, errors travel as error frames), control handlers run on the event loop and compute
handlers in a worker thread, as on a `Host`; a compute handler's `Relay` is carried out. The
network can take a host away (`kill`: its calls fail as a dropped connection would, and
calls to it raise `ConnectionLost`), freeze it (`freeze`: calls to it time out), or stop one
host from dialling another (`block`). Message streams are not provided.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

from p2p._answers import (
    COMPUTE,
    CONTROL,
    HandlerEntry,
    decode_answer,
    encode_response,
    error,
    execute,
)
from p2p.codec import ErrorCode, Message, ProtocolSpec, Relay, encode_message
from p2p.errors import ConnectionLost, FrameError, HostClosed, P2PError, Refused, RequestTimeout
from p2p.identity import Identity

_names = itertools.count()


class MemoryNetwork:
    def __init__(self) -> None:
        self.hosts: dict[str, MemoryHost] = {}
        self.blocked: set[tuple[str, str]] = set()  # (dialler, target) pairs that cannot connect
        self.calls: list[tuple[str, str, str]] = []  # (from, to, protocol id), in order

    def host(self, identity: Identity | None = None) -> MemoryHost:
        return MemoryHost(self, identity)

    def kill(self, peer: str) -> None:
        """`peer` is gone at once (a SIGKILL): calls to it fail, its own calls in flight too."""
        host = self.hosts.pop(peer, None)
        if host is not None:
            host._dead()

    def freeze(self, peer: str, frozen: bool = True) -> None:
        """`peer` stops answering (a SIGSTOP), or answers again: calls to it wait."""
        host = self.hosts.get(peer)
        if host is not None:
            (host._awake.clear if frozen else host._awake.set)()

    def block(self, dialler: str, target: str) -> None:
        self.blocked.add((dialler, target))


class MemoryHost:
    """A peer on a `MemoryNetwork`: `Host`'s request/response API, in one process."""

    def __init__(self, network: MemoryNetwork, identity: Identity | None = None) -> None:
        self.network = network
        self._identity = identity or Identity.ephemeral()
        self._handlers: dict[str, HandlerEntry] = {}
        self._calls: set[asyncio.Task[Any]] = set()
        self._awake = asyncio.Event()  # cleared while frozen
        self.addrs: list[str] = []
        self.running = False

    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    @property
    def identity(self) -> Identity:
        return self._identity

    async def start(self) -> None:
        if self.running:
            raise RuntimeError("the host is already running")
        self.network.hosts[self.peer_id] = self
        self._awake.set()
        self.addrs = [f"/dns4/memory-{next(_names)}.invalid/tcp/1/p2p/{self.peer_id}"]
        self.running = True

    async def close(self) -> None:
        if self.network.hosts.get(self.peer_id) is self:
            del self.network.hosts[self.peer_id]
        self._dead()

    def _dead(self) -> None:
        self.running = False
        for task in list(self._calls):
            task.cancel()

    async def __aenter__(self) -> MemoryHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- handlers --------------------------------------------------------------------------

    def _add(self, spec: ProtocolSpec, kind: str, fn: Callable[..., Any]) -> None:
        if spec.protocol_id in self._handlers:
            raise ValueError(f"a handler for {spec.protocol_id} is already registered")
        self._handlers[spec.protocol_id] = HandlerEntry(spec, kind, fn, spec.max_message_bytes)

    def add_control_handler(self, spec: ProtocolSpec, fn: Callable[..., Any]) -> None:
        self._add(spec, CONTROL, fn)

    def add_compute_handler(self, spec: ProtocolSpec, fn: Callable[..., Any]) -> None:
        self._add(spec, COMPUTE, fn)

    def add_stream_handler(self, spec: ProtocolSpec, fn: Callable[..., Any]) -> None:
        raise NotImplementedError("a MemoryHost has no message streams")

    # ---- outbound --------------------------------------------------------------------------

    async def connect(self, addr: str) -> str:
        peer = addr.rsplit("/p2p/", 1)[-1]
        if peer not in self.network.hosts or (self.peer_id, peer) in self.network.blocked:
            raise ConnectionLost(f"could not dial {addr}")
        return peer

    async def disconnect(self, peer_id: str) -> None:
        pass

    def observed(self, peer_id: str) -> str | None:
        """An in-memory network has no addresses."""
        return None

    def connected_peers(self) -> list[str]:
        return sorted(p for p in self.network.hosts if p != self.peer_id)

    def is_connected(self, peer_id: str) -> bool:
        return peer_id != self.peer_id and peer_id in self.network.hosts

    async def request(
        self, peer_id: str, spec: ProtocolSpec, message: Message, *, timeout: float | None = None
    ) -> Any:
        """As `Host.request`: the typed answer, or `RemoteError`, `RequestTimeout`,
        `ConnectionLost`."""
        if not self.running:
            raise HostClosed("the host is not running")
        payload = encode_message(message)
        if len(payload) > spec.max_message_bytes:
            raise FrameError(
                ErrorCode.TOO_LARGE,
                f"request of {len(payload)} bytes exceeds the limit of {spec.max_message_bytes} "
                f"bytes for {spec.protocol_id}",
            )
        target = self.network.hosts.get(peer_id)
        if target is None or (self.peer_id, peer_id) in self.network.blocked:
            raise ConnectionLost(f"{peer_id} cannot be reached")
        self.network.calls.append((self.peer_id, peer_id, spec.protocol_id))
        deadline = 60.0 if timeout is None else timeout
        call = asyncio.ensure_future(target._serve(self.peer_id, spec, payload))
        self._calls.add(call)
        target._calls.add(call)
        try:
            async with asyncio.timeout(deadline):
                kind, answer = await asyncio.shield(call)
        except TimeoutError:
            call.cancel()
            raise RequestTimeout(
                f"{peer_id} did not answer {spec.protocol_id} within {deadline} s"
            ) from None
        except asyncio.CancelledError:
            if call.cancelled() and self.running:  # the peer died under the call
                raise ConnectionLost(f"{peer_id} went away during the call") from None
            call.cancel()  # the caller gave up: so does the handler, as a closed stream would
            raise
        finally:
            self._calls.discard(call)
            target._calls.discard(call)
        return decode_answer(spec, peer_id, kind, answer)

    # ---- inbound ---------------------------------------------------------------------------

    async def _serve(self, caller: str, spec: ProtocolSpec, payload: bytes) -> tuple[int, bytes]:
        await self._awake.wait()  # frozen: the caller's timeout decides
        entry = self._handlers.get(spec.protocol_id)
        if entry is None:
            return error(ErrorCode.PROTOCOL_ERROR, f"{self.peer_id} serves no {spec.protocol_id}")
        if entry.kind == COMPUTE:
            result = await asyncio.to_thread(execute, entry, caller, payload)
            if isinstance(result, Relay):
                return await self._relay(entry, result)
            return result
        assert entry.kind == CONTROL
        try:
            request = entry.spec.decode_request(payload)
        except FrameError as exc:
            return error(exc.code, exc.message)
        try:
            response = await entry.fn(caller, request)
        except Refused as exc:
            return error(exc.code, exc.message)
        except Exception as exc:
            return error(ErrorCode.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")
        return encode_response(entry, response)

    async def _relay(self, entry: HandlerEntry, relay: Relay) -> tuple[int, bytes]:
        outcome: Any
        if relay.peer not in self.network.hosts and relay.addrs:
            with contextlib.suppress(P2PError):
                for addr in relay.addrs:
                    await self.connect(addr)
        try:
            outcome = await self.request(
                relay.peer, relay.spec, relay.message, timeout=relay.timeout
            )
        except P2PError as exc:
            outcome = exc
        try:
            return encode_response(entry, relay.finish(outcome))
        except Exception as exc:
            return error(ErrorCode.HANDLER_ERROR, f"relay: {exc}")


__all__ = ["MemoryHost", "MemoryNetwork"]
