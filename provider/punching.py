"""Hole punching for chained requests: before this provider hands a chained request to a
provider it has no connection to yet, it dials that provider and punches a direct connection
(`p2p.punch`), so that this request and the ones after it do not cross a relay.

A peer that is reachable directly answers the punch's first message with "no address" (one
round trip, once per connection). A punch that fails leaves the relayed connection as it was,
and the request goes through the relay as before. Requests to a peer wait while a punch to it
runs (at most `LIMIT_S`), because a punch that succeeds closes the relayed connection and would
end the calls on it. One punch per connection: a peer is punched again only after its
connection closed and a chained request dials it anew.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence

from p2p import Host, P2PError
from p2p.punch import Punched, Puncher

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
                if peer in self.host.connected_peers():
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
