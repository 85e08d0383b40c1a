"""Announced addresses: parsed as multiaddrs (the `multiaddr` package libp2p uses), and
refused where nobody should be sent to dial: link-local and cloud-metadata addresses (a
client or the broker dialling 169.254.169.254 would talk to its own cloud's metadata
service), addresses no one can dial (0.0.0.0, multicast), and a `/p2p/` component naming
another peer than the one announcing it (a provider passing itself off as another)."""

from __future__ import annotations

import ipaddress

# cloud instance metadata services: AWS (IPv4, IPv6, ECS), GCP and Azure, Alibaba
METADATA_IPS = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata", "instance-data"})
NAMES = ("dns", "dns4", "dns6", "dnsaddr")


def address_problem(addr: str, peer_id: str, *, link_local: bool = False) -> str | None:
    """Why `addr`, announced by `peer_id`, must not be stored or handed out; None if it may.
    `link_local`: link-local and metadata addresses are allowed (a lab on one link)."""
    import multiaddr

    try:
        parts = [(proto.name, value) for proto, value in multiaddr.Multiaddr(addr).items()]
    except Exception as exc:
        return f"{addr!r} is not a multiaddr like /ip4/203.0.113.7/tcp/7370 ({exc})"
    for i, (name, value) in enumerate(parts):
        if name in ("ip4", "ip6"):
            ip = ipaddress.ip_address(value)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            if not link_local and ip in METADATA_IPS:
                return f"{addr!r} is a cloud metadata service's address"
            if not link_local and ip.is_link_local:
                return f"{addr!r} is link-local (169.254.0.0/16, fe80::/10)"
            if ip.is_unspecified or ip.is_multicast:
                return f"{addr!r} cannot be dialled (an unspecified or multicast address)"
        elif name in NAMES and not link_local:
            if str(value).lower().rstrip(".") in METADATA_NAMES:
                return f"{addr!r} names a cloud metadata service"
        elif name == "p2p":
            relay = i + 1 < len(parts) and parts[i + 1][0] == "p2p-circuit"
            if not relay and value != peer_id:
                return f"{addr!r} names another peer ({value}) than the one announcing it"
    return None
