"""The trio side of hole punching: a dial from our libp2p listening port, and the choice of
which of a peer's connections to keep.

py-libp2p 0.8.1's TCP listener sets SO_REUSEADDR and SO_REUSEPORT, and its swarm can dial
from a given source port (`_dial_addr_single_attempt(..., source)`) or dial and then upgrade
as the responder (`dial_addr_as_responder`). Both sides of a punch dial each other's public
address from their own listening port at the same moment: the SYNs cross, each opens its NAT
for the other's, and the kernels merge them into one TCP connection (simultaneous open).
Exactly one side upgrades as the Noise initiator (the punch's initiator, which dials RTT/2
after sending Sync; the other dials when Sync arrives), so the roles agree on a merged
connection. When one side's SYN comes too early, the other's router answers with a reset (or
drops it); the later SYN then passes the early side's NAT and reaches its listener, which
upgrades as the responder: that agrees when the early side is the Noise responder, and the
attempt fails (and is tried again) when it is the initiator. Without any NAT (one machine)
an early SYN lands on a listener at once, so there the roles often disagree: punching is for
NATs, which is where the lab tests it.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

log = logging.getLogger(__name__)


def _connections(core: Any, peer_id: str) -> list[Any]:
    from libp2p.peer.id import ID

    conns = core._lp.get_network().connections.get(ID.from_base58(peer_id)) or []
    return list(conns) if isinstance(conns, list) else [conns]


def _remote(conn: Any) -> str | None:
    try:
        ip, port = conn.muxed_conn.get_remote_address()
    except (AttributeError, TypeError, ValueError):
        return None
    return f"/ip4/{ip}/tcp/{port}"


def remote_addrs(core: Any, peer_id: str) -> list[str]:
    """/ip4/IP/tcp/PORT of each open connection to `peer_id`, as its socket sees the far end
    (a relayed one: the relay's address, or 127.0.0.1 on the side the relay splices into)."""
    out = []
    for conn in _connections(core, peer_id):
        addr = _remote(conn)
        if addr is not None and not getattr(conn, "is_closed", False):
            out.append(addr)
    return out


async def dial(
    core: Any, peer_id: str, addr: str, port: int, initiator: bool, timeout: float
) -> bool:
    """Dial `addr` (/ip4/IP/tcp/PORT) from our listening `port`, upgrading as the Noise
    initiator or as the responder, for at most `timeout` seconds. True when a connection to
    `peer_id` from `addr` is open afterwards (ours, or one the listener accepted meanwhile).
    Never raises for a failed dial: failing is an expected outcome of a punch."""
    import multiaddr
    from libp2p.peer.id import ID

    network = core._lp.get_network()
    target = multiaddr.Multiaddr(f"{addr}/p2p/{peer_id}")
    pid = ID.from_base58(peer_id)
    source = ("0.0.0.0", port)
    with trio.move_on_after(timeout):
        try:
            if initiator:
                await network._dial_addr_single_attempt(target, pid, source)
            else:
                await network.dial_addr_as_responder(target, pid, source)
        except Exception as exc:  # refused, reset, a failed handshake: this try failed
            log.debug("punch: dialling %s failed: %s", addr, exc)
    if addr not in remote_addrs(core, peer_id):
        # the other side's SYN may have reached our listener: give its upgrade a moment
        for _ in range(50):  # up to 1 s
            if addr in remote_addrs(core, peer_id):
                break
            await trio.sleep(0.02)
    return addr in remote_addrs(core, peer_id)


async def keep_only(core: Any, peer_id: str, addr: str) -> int:
    """Close every connection to `peer_id` but the one from `addr`; how many were closed.
    Streams on them end (their calls fail with `ConnectionLost`; the next opens on the
    connection kept)."""
    closed = 0
    for conn in _connections(core, peer_id):
        if _remote(conn) != addr:
            with trio.move_on_after(5):
                try:
                    await conn.close()
                    closed += 1
                except Exception as exc:
                    log.debug("punch: closing a relayed connection: %s", exc)
    return closed
