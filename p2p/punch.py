"""Hole punching: two peers behind cone NATs that met through a relay move to a direct TCP
connection (TCP simultaneous open from each side's libp2p listening port).

Why our own protocol: py-libp2p's DCUtR needs its circuit relay v2, which fails here (see
FINDINGS.md); our relay (`p2p.relay`) forwards plain TCP, so the coordination runs as one
small protocol, `/fusionai/punch/1`, over the relayed libp2p connection (end to end Noise):

    initiator -> Hello                  responder -> Ready(observer, addr)
    initiator observes its own public address for its listening port (at its observer, or
        the responder's: a relay's control port answers OBSERVE with the address it sees)
    per attempt:
    initiator -> Connect(addr)          responder -> Ack          (the initiator times it: RTT)
    initiator -> Sync(attempt)          the responder dials at once, as the Noise responder;
                                        the initiator dials RTT/2 after sending, as initiator
                                        responder -> Outcome(direct)
On success the initiator closes the relayed connection; new streams use the direct one.

A public address is the IP and port a relay saw a connection from our listening port come
from: behind a cone NAT (Linux MASQUERADE keeps the port, and the mapping is the same for
every destination) the other peer reaches that port; behind a symmetric NAT the port differs
per destination and a punch cannot work: a NAT that changed our listening port is taken for
one (`PunchConfig.only_kept_ports`), no try is made, and the peers stay relayed. A punch
dials only the address the other peer gave, and observes at one observer, over TCP.

The two SYNs must each leave their own router before the other's arrives there: the start
skew must stay under the one-way delay between the homes. A router that answers an early SYN
with a reset (Linux does) keeps that connection's conntrack entry for its close timeout
(10 s), and its NAT then gives our peer's next SYN another port: measured in the lab, 20 of
20 direct with 25 ms per access link, but 2 of 5 with 0 ms links (no delay to hide the skew).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2p import _punch
from p2p.codec import Message, ProtocolSpec
from p2p.errors import P2PError
from p2p.host import Host
from p2p.reach import tcp_endpoint

log = logging.getLogger(__name__)


class Hello(Message, frozen=True, tag="PunchHello/1"):
    pass


class Ready(Message, frozen=True, tag="PunchReady/1"):
    observer: str = ""  # /ip4/IP/tcp/PORT that answers OBSERVE ("": the responder has none)
    addr: str = ""  # the responder's public /ip4/IP/tcp/PORT ("": no punch, `reason` says why)
    reason: str = ""


class Connect(Message, frozen=True, tag="PunchConnect/1"):
    addr: str  # the initiator's public /ip4/IP/tcp/PORT


class Ack(Message, frozen=True, tag="PunchAck/1"):
    pass


class Sync(Message, frozen=True, tag="PunchSync/1"):
    attempt: int


class Outcome(Message, frozen=True, tag="PunchOutcome/1"):
    direct: bool  # the responder has a direct connection from the initiator's address


PUNCH = ProtocolSpec("/fusionai/punch/1", (Hello, Connect, Sync), (Ready, Ack, Outcome), 4096)


@dataclass(frozen=True)
class PunchConfig:
    # Synchronized tries before giving up (the peers stay relayed); tries.
    attempts: int = 3
    # How long one try's dial may take (SYN, a retransmission, Noise, yamux); seconds.
    attempt_timeout: float = 3.0
    # Pause between tries; seconds.
    pause: float = 0.5
    # Deadline of each coordination message and of the observation; seconds.
    message_timeout: float = 10.0
    # Try only when both NATs kept our listening port as the public one (a NAT that changes
    # it most likely maps each destination anew, symmetric, where every try fails and costs
    # attempt_timeout); False tries with the observed port whatever it is.
    only_kept_ports: bool = True


@dataclass(frozen=True)
class Punched:
    """A punch's outcome: `direct` is the peer's address of the direct connection (None:
    still relayed, `reason` says why)."""

    direct: str | None
    attempts: int
    seconds: float  # from the first message to the direct connection (or giving up)
    rtt: float  # the relayed round trip measured last; seconds
    reason: str = ""


async def observe(port: int, observer: tuple[str, int], timeout: float = 10.0) -> str:
    """Our public /ip4/IP/tcp/PORT for local `port`: what `observer` (a relay's control port)
    saw a connection from that port come from. Raises OSError or TimeoutError."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("0.0.0.0", port))
        sock.setblocking(False)
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, observer)
            reader, writer = await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise
    try:
        async with asyncio.timeout(timeout):
            await reader.readline()  # the relay's greeting
            writer.write(b"OBSERVE\n")
            answer = (await reader.readline()).decode("ascii", "replace").split()
            await reader.read()  # the relay closes first (its side keeps TIME_WAIT)
    finally:
        writer.close()
    if len(answer) != 3 or answer[0] != "SEEN":
        raise OSError(f"{observer[0]}:{observer[1]} did not answer OBSERVE: {answer}")
    return f"/ip4/{answer[1]}/tcp/{int(answer[2])}"


class Puncher:
    """Serves `/fusionai/punch/1` on `host` and punches to its peers.

    `observer` gives the (ip, port) of a relay control port to observe our public address at
    (None: we have none, and ask the peer for its). `origin` maps the far end of a relayed
    connection (as our listener sees it) to the IP the relay saw its client come from
    (`RelayClient.origin`): when given, a peer may only make us dial its own IP, so a punch
    cannot make us dial anyone else. Punches to one peer run one at a time;
    `outcomes` keeps the latest ones, (peer, Punched) each."""

    def __init__(
        self,
        host: Host,
        observer: Callable[[], tuple[str, int] | None] = lambda: None,
        config: PunchConfig | None = None,
        origin: Callable[[str], str | None] | None = None,
    ) -> None:
        self.host, self.observer, self.origin = host, observer, origin
        self.config = config or PunchConfig()
        self._offers: dict[str, str] = {}  # initiator peer -> its public address
        self._locks: dict[str, asyncio.Lock] = {}
        self.outcomes: collections.deque[tuple[str, Punched]] = collections.deque(maxlen=1024)
        host.add_control_handler(PUNCH, self._serve)

    def _port(self) -> int:
        for addr in self.host.addrs:
            endpoint = tcp_endpoint(addr)
            if endpoint is not None:
                return endpoint[1]
        raise P2PError("the host listens on no TCP port to punch from")

    async def _mine(self, observer: tuple[str, int] | None) -> tuple[str, str]:
        """Our public address to punch from, or "" and why not."""
        if observer is None:
            return "", "it knows no public address of its own (no observer)"
        try:
            port = self._port()
            mine = await observe(port, observer, self.config.message_timeout)
        except (OSError, TimeoutError, P2PError) as exc:
            log.info("punch: could not observe our address at %s:%d: %s", *observer, exc)
            return "", f"it could not observe its address: {exc}"
        seen = tcp_endpoint(mine)
        if self.config.only_kept_ports and (seen is None or seen[1] != port):
            return "", f"its NAT changed its port {port} to {mine} (symmetric, most likely)"
        return mine, ""

    async def _serve(self, peer_id: str, msg: Message) -> Message:
        if isinstance(msg, Hello):
            observer = self.observer()
            where = f"/ip4/{observer[0]}/tcp/{observer[1]}" if observer else ""
            addr, why = await self._mine(observer)
            return Ready(observer=where, addr=addr, reason=why)
        if isinstance(msg, Connect):
            endpoint = tcp_endpoint(msg.addr)
            if endpoint is None:
                raise ValueError(f"{msg.addr!r} is not an /ip4/IP/tcp/PORT address")
            if self.origin is not None:
                came = {self.origin(a) for a in self.remote_addrs(peer_id)}
                if endpoint[0] not in came:
                    raise ValueError(f"{endpoint[0]} is not where your connection comes from")
            self._offers[peer_id] = msg.addr
            return Ack()
        if isinstance(msg, Sync):
            offer = self._offers.pop(peer_id, None)  # one dial per Connect
            if offer is None:
                raise ValueError("Sync before Connect")
            runtime, core = self.host._running()
            port, limit = self._port(), self.config.attempt_timeout
            direct = await runtime.run(_punch.dial, core, peer_id, offer, port, False, limit)
            return Outcome(direct=direct)
        raise ValueError(f"unexpected {type(msg).__name__}")

    def remote_addrs(self, peer_id: str) -> list[str]:
        """The far end of each open connection to `peer_id` (/ip4/IP/tcp/PORT)."""
        runtime, core = self.host._running()
        return runtime.run_blocking(_punch.remote_addrs, core, peer_id)

    async def punch(self, peer_id: str) -> Punched:
        """Try to replace our (relayed) connection to `peer_id` by a direct one. Never
        raises for a punch that fails: the answer says so, and the relayed one stays."""
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            punched = await self._punch(peer_id)
        self.outcomes.append((peer_id, punched))  # the latest punches' outcomes, per peer
        return punched

    async def _punch(self, peer_id: str) -> Punched:
        cfg, start, rtt = self.config, time.monotonic(), 0.0

        def failed(reason: str, attempts: int = 0) -> Punched:
            log.info("punch to %s: still relayed: %s", peer_id, reason)
            return Punched(None, attempts, time.monotonic() - start, rtt, reason)

        try:
            ready = await self.host.request(peer_id, PUNCH, Hello(), timeout=cfg.message_timeout)
        except P2PError as exc:
            return failed(f"the peer does not punch: {exc}")
        if not isinstance(ready, Ready) or not ready.addr:
            return failed(f"the peer: {getattr(ready, 'reason', '') or 'no address'}")
        theirs = ready.addr
        mine, why = await self._mine(self.observer() or tcp_endpoint(ready.observer))
        if not mine:
            return failed(f"this peer: {why}")
        runtime, core = self.host._running()
        port = self._port()
        for attempt in range(1, cfg.attempts + 1):
            try:
                sent = time.monotonic()
                await self.host.request(
                    peer_id, PUNCH, Connect(addr=mine), timeout=cfg.message_timeout
                )
                rtt = time.monotonic() - sent
                sync = asyncio.ensure_future(
                    self.host.request(
                        peer_id, PUNCH, Sync(attempt=attempt), timeout=cfg.message_timeout
                    )
                )
                await asyncio.sleep(rtt / 2)
                direct = await runtime.run(
                    _punch.dial, core, peer_id, theirs, port, True, cfg.attempt_timeout
                )
                with contextlib.suppress(P2PError):
                    await sync
            except P2PError as exc:
                return failed(f"the relayed connection failed: {exc}", attempt)
            if direct:
                closed = await runtime.run(_punch.keep_only, core, peer_id, theirs)
                took = time.monotonic() - start
                log.info(
                    "punch to %s: direct at %s after %d tries, %.3f s (%d relayed closed)",
                    peer_id, theirs, attempt, took, closed,
                )  # fmt: skip
                return Punched(theirs, attempt, took, rtt)
            await asyncio.sleep(cfg.pause)
        return failed(f"no direct connection in {cfg.attempts} tries", cfg.attempts)
