"""A port mapping on the home router (UPnP IGD, through the `miniupnpc` package), so that a
provider behind NAT can be dialled: asked for at start, renewed before its lease ends,
removed on exit. Its address is announced first, and listed as `mapped` in the join.

Only a provider listening on a private address tries (one on loopback or with `--announce`
does not); no router answering within `DISCOVER_MS`, or one that refuses, leaves the provider
as it was (then it is reached through a relay). The mapping's external port is the local one
when free, else the next ones.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("fusionai.provider")

DISCOVER_MS = 1500
LEASE_S = 3600  # asked for; renewed at half of it (routers may ignore leases: removed on exit)
TRIES = 8  # external ports tried: the local one, then the next ones


@dataclass(frozen=True)
class Mapping:
    external_ip: str
    external_port: int
    local_ip: str
    local_port: int

    @property
    def addr(self) -> str:
        return f"/ip4/{self.external_ip}/tcp/{self.external_port}"


def wants_mapping(listen: list[str]) -> tuple[str, int] | None:
    """(ip, port) of the first private IPv4 TCP listen address (after 0.0.0.0 is expanded),
    which a router could forward to; None when there is none (loopback, public, IPv6)."""
    for addr in listen:
        parts = addr.split("/")
        if len(parts) < 5 or parts[1] != "ip4" or parts[3] != "tcp":
            continue
        ip = ipaddress.ip_address(parts[2])
        if ip.is_private and not ip.is_loopback and not ip.is_link_local:
            return parts[2], int(parts[4])
    return None


class PortMapper:
    def __init__(self, description: str) -> None:
        self.description = description[:64]
        self.mapping: Mapping | None = None
        self._upnp: Any = None

    async def open(self, local: tuple[str, int]) -> Mapping | None:
        """Ask the router for a mapping to `local`; the mapping, or None (and why, logged)."""
        try:
            self.mapping = await asyncio.to_thread(self._open, *local)
        except Exception as exc:  # no router, UPnP off, refused: the provider goes on
            log.info("no UPnP port mapping: %s", exc)
            self.mapping = None
        return self.mapping

    def _open(self, local_ip: str, local_port: int) -> Mapping:
        import miniupnpc

        upnp = miniupnpc.UPnP()
        upnp.discoverdelay = DISCOVER_MS
        if upnp.discover() < 1:
            raise OSError("no UPnP device answered")
        upnp.selectigd()
        external = upnp.externalipaddress()
        if not external:
            raise OSError("the router has no external address")
        for port in range(local_port, local_port + TRIES):
            if port > 65535:
                break
            taken = upnp.getspecificportmapping(port, "TCP")
            if taken and (taken[0], taken[1]) != (local_ip, local_port):
                continue  # someone else's
            upnp.addportmapping(port, "TCP", local_ip, local_port, self.description, "", LEASE_S)
            self._upnp = upnp
            return Mapping(external, port, local_ip, local_port)
        raise OSError(f"external ports {local_port}..{local_port + TRIES - 1} are taken")

    async def renew(self, stop: asyncio.Event) -> None:
        """Renew the mapping at half its lease until `stop` (a router may forget it)."""
        while self.mapping is not None:
            try:
                await asyncio.wait_for(stop.wait(), LEASE_S / 2)
                return
            except TimeoutError:
                pass
            m = self.mapping
            try:
                await asyncio.to_thread(
                    self._upnp.addportmapping, m.external_port, "TCP", m.local_ip,
                    m.local_port, self.description, "", LEASE_S,
                )  # fmt: skip
            except Exception as exc:
                log.warning("renewing the UPnP port mapping failed: %s", exc)

    async def close(self) -> None:
        """Remove the mapping (best effort: the router may be gone)."""
        m, self.mapping = self.mapping, None
        if m is None or self._upnp is None:
            return
        try:
            await asyncio.to_thread(self._upnp.deleteportmapping, m.external_port, "TCP")
        except Exception as exc:
            log.warning("removing the UPnP port mapping failed: %s", exc)
