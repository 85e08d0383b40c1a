"""How this provider reaches peers and lets peers reach others: hole punching before a
chained request (`ChainPunch`, wired by `punch_paths`), and the relay it may offer
(`offer_relay`).

Before this provider hands a chained request to a provider it has no connection to yet, it
dials that provider and punches a direct connection (`p2p.punch`), so that this request and the
ones after it do not cross a relay. A peer that is reachable directly answers the punch's first
message with "no address" (one round trip, once per connection). A punch that fails leaves the
relayed connection as it was, and the request goes through the relay as before. Requests to a
peer wait while a punch to it runs (at most `LIMIT_S`), because a punch that succeeds closes the
relayed connection and would end the calls on it. One punch per connection: a peer is punched
again only after its connection closed and a chained request dials it anew.

A provider others can reach may run a relay (`--offer-relay`) for providers nobody can dial;
it reserves ports only for those its broker sends, with the broker's ticket naming both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence

from p2p import Host, P2PError
from p2p.punch import Punched, Puncher
from p2p.relay import RelayServer
from proto.join import relay_ticket_ok
from provider.config import ProviderConfig
from provider.events import event

log = logging.getLogger(__name__)

LIMIT_S = 8.0  # longest a chained request waits for a punch to its next hop; seconds


class ChainPunch:
    """`before_relay(peer, addrs)` is called from a compute thread before a chained request
    goes to `peer`; `on_punched(peer, punched)` hears each punch's outcome."""

    def __init__(
        self,
        host: Host,
        puncher: Puncher,
        loop: asyncio.AbstractEventLoop,
        on_punched: Callable[[str, Punched], None],
    ) -> None:
        self.host, self.puncher, self.loop, self.on_punched = host, puncher, loop, on_punched
        self._lock = threading.Lock()
        self._running: dict[str, concurrent.futures.Future[None]] = {}

    def before_relay(self, peer: str, addrs: Sequence[str]) -> None:
        with self._lock:
            future = self._running.get(peer)
            if future is None:
                if self.host.is_connected(peer):
                    return
                future = asyncio.run_coroutine_threadsafe(self._reach(peer, addrs), self.loop)
                self._running[peer] = future
        try:
            future.result(LIMIT_S + 2)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the relayed connection stays; the request dials as before
        except Exception:
            log.warning("punching %s before a chained request", peer, exc_info=True)

    async def _reach(self, peer: str, addrs: Sequence[str]) -> None:
        try:
            async with asyncio.timeout(LIMIT_S):
                for addr in addrs:
                    try:
                        if await self.host.connect(addr) == peer:
                            break
                    except (P2PError, OSError, ValueError) as exc:
                        log.debug("dialling %s at %s: %s", peer, addr, exc)
                else:
                    return  # unreachable: the request's own dial says so
                self.on_punched(peer, await self.puncher.punch(peer))
        except TimeoutError:
            log.info("punch to %s: no outcome within %g s; it stays relayed", peer, LIMIT_S)
        finally:
            with self._lock:
                self._running.pop(peer, None)


def _punched(peer: str, punched: Punched) -> None:
    event("punched", peer=peer, direct=punched.direct, attempts=punched.attempts,
          seconds=round(punched.seconds, 3), reason=punched.reason)  # fmt: skip


def punch_paths(
    host: Host,
    observer: Callable[[], tuple[str, int] | None],
    origin: Callable[[str], str | None],
) -> tuple[Puncher, Callable[[str, Sequence[str]], None]]:
    """Serve punches on `host` (a peer that reached us through our relay may punch a direct
    connection), and the hook that punches to a chained request's next hop first."""
    puncher = Puncher(host, observer, origin=origin)
    chains = ChainPunch(host, puncher, asyncio.get_running_loop(), _punched)
    return puncher, chains.before_relay


async def offer_relay(config: ProviderConfig, broker: str, me: str) -> RelayServer | None:
    """Run a relay for providers nobody can dial (--offer-relay), carrying only those our
    broker sends (its ticket names us and them); None when not asked for, or it cannot
    listen (an event says why)."""
    rate = config.relay_rate_bytes_s
    if rate <= 0:
        return None

    def allowed(peer: str, ticket: str) -> bool:
        return relay_ticket_ok(broker, me, peer, ticket, time.time())

    relay = RelayServer("0.0.0.0", config.relay_port, rate_bytes_s=rate, allowed=allowed)
    try:
        port = await relay.start()
    except OSError as exc:
        event("relay_offer", running=False, error=str(exc))
        return None
    event("relay_offer", running=True, port=port, mbit=round(rate * 8 / 1e6, 3))
    return relay
