"""Addresses: the broker's peer id from its multiaddr, and the addresses this provider
announces for others (clients, other providers) to dial."""

from __future__ import annotations


def announced(announce: tuple[str, ...], peer_id: str) -> list[str]:
    """`--announce` addresses, each ending in /p2p/<our peer id>."""
    return [a if "/p2p/" in a else f"{a.rstrip('/')}/p2p/{peer_id}" for a in announce]


def local_ips() -> set[str]:
    """This machine's IPv4 addresses (interfaces that are up)."""
    import socket

    import psutil

    stats = psutil.net_if_stats()
    return {
        a.address
        for name, nic in psutil.net_if_addrs().items()
        if name not in stats or stats[name].isup
        for a in nic
        if a.family == socket.AF_INET
    }


def mapped(addrs: list[str]) -> list[str]:
    """Those of `addrs` on an IP this machine does not have: a router forwards them here."""
    mine = local_ips()
    return [a for a in addrs if a.startswith("/ip4/") and a.split("/")[2] not in mine]


def dialable(addrs: list[str]) -> list[str]:
    """Listen addresses as others can dial them: one on 0.0.0.0 becomes one per IPv4
    address of this machine's interfaces (clients open sessions to them), loopback last."""

    out: list[str] = []
    for addr in addrs:
        if not addr.startswith("/ip4/0.0.0.0/"):
            out.append(addr)
            continue
        rest = addr[len("/ip4/0.0.0.0/") :]
        ips = [ip for ip in local_ips() if not ip.startswith("169.254.")]
        for ip in sorted(set(ips), key=lambda ip: (ip.startswith("127."), ip)):
            out.append(f"/ip4/{ip}/{rest}")
    return out or list(addrs)


def broker_peer_id(addr: str) -> str:
    """The peer id at the end of a broker multiaddr; ValueError saying what is wrong."""
    from p2p.identity import public_key_from_peer_id

    head, sep, peer = addr.rpartition("/p2p/")
    if not sep or not head.startswith("/") or not peer:
        raise ValueError(f"{addr!r} is not a multiaddr ending in /p2p/<peer id>")
    try:
        public_key_from_peer_id(peer)
    except ValueError:
        raise ValueError(f"{addr!r} does not end in a valid peer id ({peer!r})") from None
    return peer
