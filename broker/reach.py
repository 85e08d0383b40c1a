"""Whether the broker (and so clients and other providers) can dial a provider: checked at
each join by dialling back the provider's announced addresses on the IP the broker saw it
connect from (`p2p.reach`).

    direct       an address on the provider's own interface answered
    mapped       an address its router forwards to it answered (UPnP or a forwarded port,
                 which the provider lists as `mapped` in its join profile)
    relayed      nothing answered, and it holds a port at this broker's relay, or at a
                 relay a provider offers that answers for it: clients reach it through the relay
    unreachable  nothing answered, and no relay: only the broker's own connection reaches it
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from broker.events import EventLog
from p2p.reach import answers, candidates, tcp_endpoint
from proto.join import JoinProfile

log = logging.getLogger("fusionai.broker")


@dataclass(frozen=True)
class Reach:
    kind: str  # "checking", "direct", "mapped", "unreachable"
    address: str | None = None  # the address that answered
    observed: str | None = None  # where the broker saw it connect from


class Reachability:
    def __init__(
        self,
        observed: Callable[[str], str | None],
        events: EventLog,
        timeout: float = 3.0,
        relayed: Callable[[str], str | None] = lambda peer: None,
        relay_ip: Callable[[str], bool] = lambda ip: False,
    ) -> None:
        self.observed = observed
        self.relayed = relayed  # a peer's address at our relay, if it holds one
        self.relay_ip = relay_ip  # whether an IP is a provider's relay we took (may be dialled)
        self.events = events
        self.timeout = timeout
        self.reach: dict[str, Reach] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def check(self, peer: str, profile: JoinProfile) -> None:
        """Start checking `peer` (a join); the answer lands in `reach[peer]` shortly."""
        old = self._tasks.pop(peer, None)
        if old is not None:
            old.cancel()
        self.reach[peer] = Reach("checking")
        self._tasks[peer] = asyncio.get_running_loop().create_task(self._check(peer, profile))

    async def _check(self, peer: str, profile: JoinProfile) -> None:
        try:
            observed = self.observed(peer)
        except Exception:  # the connection went away meanwhile
            observed = None
        found = Reach("unreachable", None, observed)
        for addr in candidates(list(profile.addrs), observed):
            if await answers(addr, self.timeout):
                kind = "mapped" if addr in profile.mapped else "direct"
                found = Reach(kind, addr, observed)
                break
        at_relay = self.relayed(peer)
        if found.kind == "unreachable" and at_relay and at_relay in profile.relayed:
            found = Reach("relayed", at_relay, observed)
        for addr in profile.relayed if found.kind == "unreachable" else ():
            endpoint = tcp_endpoint(addr)
            if endpoint and self.relay_ip(endpoint[0]) and await answers(addr, self.timeout):
                found = Reach("relayed", addr, observed)
                break
        self.reach[peer] = found
        self._tasks.pop(peer, None)
        self.events.emit(
            "provider_reach", peer=peer, reach=found.kind, address=found.address,
            observed=observed,
        )  # fmt: skip

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
