"""Reachability: which of a peer's announced addresses answer a fresh connection.

A provider behind a home router announces addresses nobody outside can dial. The broker
learns the address it sees a peer connect from (`Host.observed`), and dials back only the
peer's announced TCP addresses on that same IP (at most `MAX_PROBES`, so a join cannot make
the broker dial strangers); an address answers when a libp2p listener there completes the
multistream-select greeting.
"""

from __future__ import annotations

import asyncio

MAX_PROBES = 3
GREETING = b"\x13/multistream/1.0.0\n"  # varint length, then the protocol line


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """(ip, port) of an /ip4/IP/tcp/PORT[/...] multiaddr; None for anything else."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[1] != "ip4" or parts[3] != "tcp":
        return None
    try:
        port = int(parts[4])
    except ValueError:
        return None
    return (parts[2], port) if 0 < port < 65536 else None


def candidates(announced: list[str], observed: str | None) -> list[str]:
    """The announced TCP addresses on the IP the peer was seen connecting from."""
    seen = tcp_endpoint(observed) if observed else None
    if seen is None:
        return []
    out = [a for a in announced if (e := tcp_endpoint(a)) is not None and e[0] == seen[0]]
    return list(dict.fromkeys(out))[:MAX_PROBES]


async def answers(addr: str, timeout: float = 3.0) -> bool:
    """Whether a libp2p listener at `addr` answers a fresh TCP connection."""
    endpoint = tcp_endpoint(addr)
    if endpoint is None:
        return False
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*endpoint), timeout)
    except (TimeoutError, OSError):
        return False
    try:
        writer.write(GREETING)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(64), timeout)
        return b"/multistream/1.0.0" in reply
    except (TimeoutError, OSError):
        return False
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
