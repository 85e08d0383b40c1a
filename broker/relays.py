"""Relays for providers nobody can dial: the broker's own (`p2p.relay` on its IP) and those
that reachable providers offer.

A provider offers a relay in its join profile (`relay_port`, its cap `relay_rate`). The offer
is taken once the broker has connected to that port on the IP the provider's own connection
comes from and been greeted there as by a relay (so an offer cannot point other providers at
a stranger), and only while that provider stays alive. A provider that needs a relay is told
in its join reply the one with the most bandwidth per provider it would then carry: an offer
(at its cap) when it beats the broker's relay (at the broker's cap; uncapped beats every
offer), with a ticket, the broker's signature naming the relay's provider, the provider that
may reserve and an expiry, which a provider's relay asks for before it reserves a port (so it
carries only this broker's providers).

The cost model sees a relayed provider's bandwidth as its share of its relay's cap (`share`),
so placement and routing send no more through a relay than its cap carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from p2p.identity import Identity
from p2p.reach import tcp_endpoint
from proto.join import RELAY_TICKET_DOMAIN, RELAY_TICKET_S, JoinProfile, relay_ticket_bytes

CHECK_TIMEOUT_S = 3.0  # connecting to an offered relay and reading its greeting; seconds


@dataclass(frozen=True)
class Offer:
    peer: str  # the provider running the relay
    ip: str  # where the broker reached it
    port: int
    rate: float  # its cap, bytes/s

    @property
    def addr(self) -> str:
        return f"/ip4/{self.ip}/tcp/{self.port}"


def relay_ip(profile: JoinProfile) -> str | None:
    """The IP of the relay a provider holds its port at (from its relayed address)."""
    for addr in profile.relayed:
        endpoint = tcp_endpoint(addr)
        if endpoint is not None:
            return endpoint[0]
    return None


class Relays:
    """`own_rate`: the broker's relay's cap in bytes/s (0: none); `has_own`: whether the
    broker runs a relay."""

    def __init__(
        self,
        identity: Identity,
        own_rate: float,
        has_own: bool,
        alive: Callable[[str], bool],
        profiles: Callable[[], Iterable[JoinProfile]],
    ) -> None:
        self.identity, self.own_rate, self.has_own = identity, own_rate, has_own
        self.alive, self.profiles = alive, profiles
        self.offers: dict[str, Offer] = {}

    async def offer(self, peer: str, observed: str | None, profile: JoinProfile) -> str:
        """Take (or drop) `peer`'s offer from its join; "" or why it was not taken."""
        self.offers.pop(peer, None)
        if not profile.relay_port or profile.relay_rate <= 0:
            return ""
        endpoint = tcp_endpoint(observed) if observed else None
        if endpoint is None:
            return "the broker does not know the IP it connects from"
        found = Offer(peer, endpoint[0], profile.relay_port, profile.relay_rate)
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(found.ip, found.port)
                try:
                    greeting = await reader.readline()
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except (OSError, TimeoutError) as exc:
            return f"its relay at {found.addr} did not answer: {exc or type(exc).__name__}"
        if not greeting.startswith(b"FUSIONAI-RELAY/1 "):
            return f"{found.addr} did not greet as a relay"
        self.offers[peer] = found
        return ""

    def _carried(self) -> dict[str | None, int]:
        """Providers per relay IP (None: not relayed)."""
        counts: dict[str | None, int] = {}
        for profile in self.profiles():
            ip = relay_ip(profile)
            counts[ip] = counts.get(ip, 0) + 1
        return counts

    def _live(self) -> list[Offer]:
        return [o for o in self.offers.values() if self.alive(o.peer)]

    def _own_share(self, carried: dict[str | None, int], offered: set[str]) -> float:
        if not self.has_own:
            return 0.0
        if self.own_rate <= 0:
            return math.inf
        own = sum(n for ip, n in carried.items() if ip is not None and ip not in offered)
        return self.own_rate / (own + 1)

    def choose(self, peer: str) -> tuple[str, str]:
        """(address, ticket) of the provider relay `peer` should hold its port at, or ("", "")
        for the broker's own."""
        carried, live = self._carried(), self._live()
        best, share = None, self._own_share(carried, {o.ip for o in live})
        for o in live:
            if o.peer != peer and o.rate / (carried.get(o.ip, 0) + 1) > share:
                best, share = o, o.rate / (carried.get(o.ip, 0) + 1)
        if best is None:
            return "", ""
        expires = int(time.time() + RELAY_TICKET_S)
        signed = relay_ticket_bytes(best.peer, peer, expires)
        signature = self.identity.sign(signed, domain=RELAY_TICKET_DOMAIN)
        return best.addr, f"{expires}.{signature.hex()}"

    def share(self, profile: JoinProfile) -> float:
        """A relayed provider's bandwidth through its relay: the relay's cap over the providers
        it carries (bytes/s; inf: uncapped)."""
        ip, carried = relay_ip(profile), self._carried()
        n = max(1, carried.get(ip, 0))
        for o in self._live():
            if o.ip == ip:
                return o.rate / n
        return self.own_rate / n if self.own_rate else math.inf

    def is_relay(self, ip: str) -> bool:
        """Whether `ip` is a live offered relay's (its ports may be dialled)."""
        return any(o.ip == ip for o in self._live())
