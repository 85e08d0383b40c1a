"""A relay for peers nobody can dial: it forwards TCP bytes it cannot read.

A provider behind NAT keeps one outbound control connection to a relay (the broker runs one)
and reserves a public port there, proving its peer id by signing the relay's challenge. The
relay listens on that port; each connection a client makes to it is spliced, byte for byte,
to a fresh data connection the provider opens on the relay's request, which the provider
splices to its own libp2p listener. Clients dial `/ip4/RELAY/tcp/PORT/p2p/<provider>` like
any address: the multistream, Noise and yamux handshakes run end to end between client and
provider, so the relay sees only encrypted bytes, and a relay that answers itself instead of
forwarding fails the Noise handshake (the provider's key is checked end to end).

What a relay does learn: which addresses connect to which reserved port (who talks to whom),
when, and how many bytes. Its forwarding rate is capped (`rate_bytes_s`, shared by all).

Control lines (provider to relay, on the relay's control port):
    relay   FUSIONAI-RELAY/1 <challenge hex>
    peer    RESERVE <peer id> <signature hex> [<ticket>]
                                                   (the signature over the challenge and the
                                                   relay's port; a ticket if the relay asks)
    relay   OK <public port> | ERR <reason>
    relay   OPEN <token> <client ip>               (a client is waiting: open a data link)
    relay   PING                                   (every KEEPALIVE_S: keeps NAT state alive)
Data lines (provider to relay, a new connection to the same port):
    peer    DATA <token>                           (then raw bytes both ways)
Observation (anyone, a new connection to the same port; for hole punching, `p2p.punch`):
    peer    OBSERVE
    relay   SEEN <ip> <port>                       (where the connection came from; then closes)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p.identity import Identity, verify

log = logging.getLogger("fusionai.p2p")

DOMAIN = "fusionai/relay/1"
KEEPALIVE_S = 20.0
OPEN_TIMEOUT_S = 10.0  # a provider that does not open the data link by then: client dropped
MAX_LINE = 512
MAX_PENDING = 32  # clients waiting at once for one provider's data links
CHUNK = 64 * 1024


class RelayError(Exception):
    """A reservation the relay refused, or a relay that did not answer as one."""


def reserve_bytes(challenge: bytes, port: int) -> bytes:
    return challenge + b"\0" + str(port).encode()


async def _line(reader: asyncio.StreamReader, timeout: float) -> str:
    raw = await asyncio.wait_for(reader.readline(), timeout)
    if not raw.endswith(b"\n") or len(raw) > MAX_LINE:
        raise RelayError("the other side closed or sent no line")
    return raw.decode("ascii", "replace").strip()


class _Bucket:
    """A token bucket shared by every spliced byte (the relay's bandwidth cap)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.level, self.stamp = rate, rate, time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            now = time.monotonic()
            self.level = min(self.rate, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.level >= n or self.level >= self.rate:
                self.level -= n
                return
            await asyncio.sleep((n - self.level) / self.rate)


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    bucket: _Bucket | None = None,
    seen: Callable[[bytes], None] | None = None,
) -> None:
    """Pump bytes both ways until either side closes; then close both."""

    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while chunk := await r.read(CHUNK):
                if bucket is not None:
                    await bucket.take(len(chunk))
                if seen is not None:
                    seen(chunk)
                w.write(chunk)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError):
                if w.can_write_eof():
                    w.write_eof()

    try:
        await asyncio.gather(pump(a[0], b[1]), pump(b[0], a[1]))
    finally:
        for _, w in (a, b):
            w.close()


@dataclass
class _Reservation:
    peer: str
    port: int
    control: asyncio.StreamWriter
    server: asyncio.Server | None = None
    waiting: dict[str, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(
        default_factory=dict
    )


class RelayServer:
    """The relay: a control port, and one public port per reservation."""

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        rate_bytes_s: float = 0.0,
        max_reservations: int = 256,
        allowed: Callable[[str, str], bool] = lambda peer, ticket: True,
        seen: Callable[[bytes], None] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.bucket = _Bucket(rate_bytes_s)
        self.max_reservations = max_reservations
        self.allowed = allowed  # (peer, ticket): e.g. only providers that joined this broker
        self.seen = seen  # every forwarded chunk (tests check what a relay could read)
        self.reservations: dict[str, _Reservation] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[object]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._control, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def relayed_port(self, peer: str) -> int | None:
        r = self.reservations.get(peer)
        return r.port if r is not None else None

    async def close(self) -> None:
        """Stop: reservations dropped, connections closed, handlers finished."""
        if self._server is not None:
            self._server.close()
        for r in list(self.reservations.values()):
            self._drop(r)
        for w in list(self._writers):
            w.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)

    def _track(self, writer: asyncio.StreamWriter) -> None:
        """Count the running handler (and its connection) until it returns."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._writers.add(writer)

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._track(writer)
        handed = False
        try:
            handed = await self._handle(reader, writer)
        finally:
            self._writers.discard(writer)
            if not handed:
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve a control connection; True when it was a data link handed to a client's
        splice (which owns it from then on)."""
        challenge = secrets.token_bytes(16)
        try:
            writer.write(f"FUSIONAI-RELAY/1 {challenge.hex()}\n".encode())
            first = await _line(reader, 10.0)
            if first.startswith("DATA "):
                return self._data(first[5:], reader, writer)
            if first == "OBSERVE":
                ip, port = writer.get_extra_info("peername")[:2]
                writer.write(f"SEEN {ip} {port}\n".encode())
                return False
            parts = first.split()
            if len(parts) not in (3, 4) or parts[0] != "RESERVE":
                raise RelayError("expected RESERVE or DATA")
            peer, signature = parts[1], bytes.fromhex(parts[2])
            if not verify(peer, reserve_bytes(challenge, self.port), signature, domain=DOMAIN):
                raise RelayError("the signature does not prove that peer id")
            if not self.allowed(peer, parts[3] if len(parts) == 4 else ""):
                raise RelayError("this relay serves only the providers of its broker")
            if peer not in self.reservations and len(self.reservations) >= self.max_reservations:
                raise RelayError("the relay is full")
        except (TimeoutError, RelayError, ValueError, OSError) as exc:
            with contextlib.suppress(OSError):
                writer.write(f"ERR {exc}\n".encode())
            return False
        old = self.reservations.get(peer)
        if old is not None:
            self._drop(old)
        reservation = _Reservation(peer, 0, writer)
        server = await asyncio.start_server(
            lambda r, w: self._client(reservation, r, w), self.host, 0
        )
        reservation.server, reservation.port = server, server.sockets[0].getsockname()[1]
        self.reservations[peer] = reservation
        writer.write(f"OK {reservation.port}\n".encode())
        log.info("relay: %s reserved port %d", peer, reservation.port)

        async def until_closed() -> None:
            with contextlib.suppress(OSError):
                while await reader.read(MAX_LINE):
                    pass  # (its PONGs)

        watch = asyncio.ensure_future(until_closed())
        try:
            while not watch.done():
                writer.write(b"PING\n")
                await writer.drain()
                await asyncio.wait([watch], timeout=KEEPALIVE_S)
        except OSError:
            pass
        finally:
            watch.cancel()
            if self.reservations.get(peer) is reservation:
                self._drop(reservation)
        return False

    def _drop(self, r: _Reservation) -> None:
        self.reservations.pop(r.peer, None)
        if r.server is not None:
            r.server.close()
        r.control.close()
        for waiter in r.waiting.values():
            waiter.cancel()

    async def _client(
        self, r: _Reservation, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._track(writer)
        try:
            await self._forward(r, reader, writer)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _forward(
        self, r: _Reservation, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(r.waiting) >= MAX_PENDING:
            return  # more clients waiting for this provider than it would open links for
        token = secrets.token_hex(16)
        waiter = asyncio.get_running_loop().create_future()
        r.waiting[token] = waiter
        try:
            origin = writer.get_extra_info("peername")[0]
            r.control.write(f"OPEN {token} {origin}\n".encode())
            await r.control.drain()
            data = await asyncio.wait_for(waiter, OPEN_TIMEOUT_S)
        except (TimeoutError, OSError, asyncio.CancelledError):
            writer.close()
            return
        finally:
            r.waiting.pop(token, None)
        await splice((reader, writer), data, self.bucket, self.seen)

    def _data(self, token: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Hand a provider's data link to the client waiting for it (False: nobody is)."""
        for r in self.reservations.values():
            waiter = r.waiting.get(token.strip())
            if waiter is not None and not waiter.done():
                waiter.set_result((reader, writer))
                return True
        return False  # an unknown or late token


class RelayClient:
    """A provider's reservation at a relay, kept until `close()`: dialled by clients at
    `address`, each of their connections is spliced to `local` (our libp2p listener)."""

    def __init__(
        self, identity: Identity, relay: tuple[str, int], local: tuple[str, int], ticket: str = ""
    ):
        self.identity, self.relay, self.local = identity, relay, local
        self.ticket = ticket  # what the relay asks for besides our signature, if anything
        self.port: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._links: set[asyncio.Task[None]] = set()
        self._origins: dict[int, str] = {}  # our end's port of a spliced link -> client IP

    @property
    def address(self) -> str:
        return f"/ip4/{self.relay[0]}/tcp/{self.port}/p2p/{self.identity.peer_id}"

    async def reserve(self, timeout: float = 10.0) -> str:
        """Reserve a port (raises `RelayError` or `OSError`); then serve it in the background
        until the control connection ends. Returns the relayed address."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.relay), timeout)
        try:
            hello = (await _line(reader, timeout)).split()
            if len(hello) != 2 or hello[0] != "FUSIONAI-RELAY/1":
                raise RelayError("not a relay")
            signed = reserve_bytes(bytes.fromhex(hello[1]), self.relay[1])
            sig = self.identity.sign(signed, domain=DOMAIN)
            ticket = f" {self.ticket}" if self.ticket else ""
            writer.write(f"RESERVE {self.identity.peer_id} {sig.hex()}{ticket}\n".encode())
            answer = (await _line(reader, timeout)).split(maxsplit=1)
            if answer[0] != "OK":
                raise RelayError(answer[1] if len(answer) > 1 else "refused")
            self.port = int(answer[1])
        except BaseException:
            writer.close()
            raise
        self._task = asyncio.ensure_future(self._serve(reader, writer))
        return self.address

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await _line(reader, KEEPALIVE_S * 3)
                if line == "PING":
                    writer.write(b"PONG\n")
                elif line.startswith("OPEN "):
                    parts = line.split()
                    origin = parts[2] if len(parts) > 2 else ""
                    task = asyncio.ensure_future(self._open(parts[1], origin))
                    self._links.add(task)
                    task.add_done_callback(self._links.discard)
        except (TimeoutError, RelayError, OSError):
            log.info("relay %s:%d: the control connection ended", *self.relay)
        finally:
            writer.close()

    def origin(self, addr: str) -> str | None:
        """The client IP (as the relay saw it) of a relayed connection that our libp2p
        listener sees coming from `addr` (/ip4/127.0.0.1/tcp/PORT: our end of the splice)."""
        parts = addr.split("/")
        if len(parts) < 5 or parts[2] != self.local[0] or not parts[4].isdigit():
            return None
        return self._origins.get(int(parts[4])) or None

    async def _open(self, token: str, origin: str = "") -> None:
        try:
            remote = await asyncio.wait_for(asyncio.open_connection(*self.relay), 10.0)
            await _line(remote[0], 10.0)  # its greeting
            remote[1].write(f"DATA {token}\n".encode())
            local = await asyncio.wait_for(asyncio.open_connection(*self.local), 10.0)
        except (TimeoutError, OSError, RelayError) as exc:
            log.info("relay: could not open a data link: %s", exc)
            return
        port = local[1].get_extra_info("sockname")[1]
        self._origins[port] = origin
        try:
            await splice(remote, local)
        finally:
            self._origins.pop(port, None)

    async def close(self) -> None:
        for task in [self._task, *self._links]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._links] if t), return_exceptions=True)
