"""Membership: join the broker, then heartbeat; join again (with backoff) when it cannot be
reached or has forgotten us.

Joining sends the measured hardware profile, signed with the provider's identity, plus the
measured round trip and bandwidth to the broker, and the stages still loaded (a broker that
restarted learns what we have). While it decides, the broker may check the profile's FLOP/s
(`provider.challenge`: prepared before the join is sent, released once it is answered). A
heartbeat reports what is loaded, the queue, the KV-cache bytes, and whether we are draining;
the broker answers whether it knows us.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time

import msgspec

from p2p import Host, P2PError, heap
from p2p.reach import tcp_endpoint
from p2p.relay import RelayClient, RelayError
from proto.heartbeat import HEARTBEAT, Heartbeat
from proto.join import (
    JOIN,
    JOIN_DOMAIN,
    ExecutorInfo,
    Join,
    JoinProfile,
    JoinReply,
    signed_join_bytes,
)
from proto.ping import PING, Ping
from provider.addresses import announced, dialable, mapped
from provider.challenge import Checks
from provider.config import ProviderConfig
from provider.events import event, version
from provider.portmap import wants_mapping
from provider.profile import MachineProfile
from provider.serving import Server

log = logging.getLogger("fusionai.provider")

FAST_RETRY_S = 30.0  # seconds of an outage during which joins are retried about every second
JOIN_TIMEOUT_S = 60.0  # a join's answer may take this long (the broker's hardware check runs)
# the uplink's echo payload: grown from ECHO_MIN until an echo takes ECHO_S, at most ECHO_MAX
# (under the ping protocol's 1 MiB limit)
ECHO_MIN, ECHO_MAX, ECHO_S = 32 * 1024, 512 * 1024, 0.25


class Rejoin(Exception):
    """The broker does not know this provider (it restarted): join again."""


class Refused(Exception):
    """The broker refused the join; the message is its reason."""


class Membership:
    """This provider's membership of the broker's pool. `host`, `profile` and
    `memory_budget` are set by the daemon once known (attach, prepare)."""

    def __init__(self, config: ProviderConfig, server: Server, broker_id: str, boot: str):
        self.config = config
        self.server = server
        self.broker_id = broker_id
        self.boot = boot  # this process: joining again is not a restart
        self.host: Host | None = None
        self.profile: MachineProfile | None = None
        self.memory_budget = 0
        self.joined = asyncio.Event()
        self.heartbeat_s = 5.0
        self.wake = asyncio.Event()  # send a heartbeat now (draining started)
        self.told_draining = asyncio.Event()  # the broker acknowledged we are draining
        self.extra_addrs: list[str] = []  # announced first: a router's mapping to us
        self.relay: RelayClient | None = None  # our port at a relay, if we need one
        self.relay_offer: tuple[int, float] | None = None  # (port, bytes/s) of ours, offered
        self.checks: Checks | None = None  # answers the broker's hardware check
        self.pool = ""  # our pool and reachability, as the broker last said ("" unknown)
        self.reach = ""
        self._seq = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Join, then heartbeat; on any failure join again with backoff, until `stop`."""
        backoff = 0.5
        immediate = True  # one immediate re-join after the broker forgot us, then backoff
        outage_since: float | None = None
        while not stop.is_set():
            if self.server.draining and not self.joined.is_set():
                return  # leaving: no point in joining again
            try:
                await self.join()
                backoff = 0.5
                outage_since = None
                await self._heartbeats(stop)
            except (P2PError, OSError) as exc:
                self.joined.clear()
                event("broker_unreachable", error=str(exc), retry_s=round(backoff, 1))
            except Rejoin as exc:
                self.joined.clear()
                event("rejoin", reason=str(exc))
                if immediate:
                    immediate = False
                    continue
            except Refused as exc:
                self.joined.clear()
                event("join_refused", reason=str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an unexpected answer: say so, keep trying
                self.joined.clear()
                log.exception("membership with the broker failed")
                event("broker_error", error=f"{type(exc).__name__}: {exc}")
            if outage_since is None:
                outage_since = time.monotonic()
            # Retry about once a second for the first FAST_RETRY_S of an outage (a broker
            # restart takes seconds), then back off exponentially; jitter spreads the swarm.
            fast = time.monotonic() - outage_since < FAST_RETRY_S
            delay = min(1.0, backoff) if fast else backoff
            try:
                await asyncio.wait_for(stop.wait(), delay * random.uniform(0.5, 1.0))
            except TimeoutError:
                pass
            backoff = min(self.config.backoff_max_s, backoff * 2)

    async def measure_network(self) -> tuple[float, float]:
        """(upload bytes/s, rtt s) to the broker: pings, then echoes (assumed symmetric: the
        echo takes as long back) of a payload grown from 32 KiB to 512 KiB until one takes
        `ECHO_S` (a thin uplink is measured in seconds, not minutes: three 512 KiB echoes
        took over two minutes at 0.15 Mbit/s), the best of three at that size."""
        host = self.host
        assert host is not None
        rtts = []
        for i in range(5):
            start = time.perf_counter()
            await host.request(self.broker_id, PING, Ping(nonce=i), timeout=10.0)
            rtts.append(time.perf_counter() - start)
        rtt = statistics.median(rtts)

        async def echo(size: int, nonce: int) -> float:
            start = time.perf_counter()
            await host.request(
                self.broker_id, PING, Ping(nonce=nonce, payload=b"\0" * size), timeout=60.0
            )
            return max(1e-6, time.perf_counter() - start - rtt)

        size = ECHO_MIN
        took = await echo(size, 100)
        while took < ECHO_S and size < ECHO_MAX:
            size = min(ECHO_MAX, size * 4)
            took = await echo(size, 100)
        best = min([took, *[await echo(size, 101 + i) for i in range(2)]])
        return 2 * size / best, rtt

    def _announced(self) -> list[str]:
        assert self.host is not None
        if self.config.announce:
            return announced(self.config.announce, self.host.peer_id)
        return [*self.extra_addrs, *self._relayed(), *dialable(self.host.addrs)]

    def relay_endpoint(self) -> tuple[str, int] | None:
        """The relay we hold a port at: its control port tells a punch our public address."""
        return self.relay.relay if self.relay is not None and self.relay.alive else None

    def relay_origin(self, addr: str) -> str | None:
        """The client IP behind a connection our relay spliced to us (`RelayClient.origin`)."""
        return self.relay.origin(addr) if self.relay is not None else None

    def _relayed(self) -> list[str]:
        return [self.relay.address] if self.relay is not None and self.relay.alive else []

    async def _hold_relay(self, reply: JoinReply) -> bool:
        """Behind a NAT with no mapping: hold a port at a relay (the provider relay the
        broker named, else the broker's own; signed with our key), so that clients can dial
        us through it. True when a new one was reserved (the join must be sent again to
        announce it)."""
        assert self.host is not None
        if self._relayed() or self.config.announce or self.extra_addrs:
            return False
        broker = tcp_endpoint(self.config.broker)
        local = wants_mapping(dialable(self.host.addrs))
        mine = next((tcp_endpoint(a) for a in self.host.addrs if tcp_endpoint(a)), None)
        if broker is None or local is None or mine is None:
            return False  # a public or loopback-only provider needs no relay
        relays = [(tcp_endpoint(reply.relay), reply.relay_ticket)] if reply.relay else []
        if reply.relay_port:
            relays.append(((broker[0], reply.relay_port), ""))
        if self.relay is not None:
            await self.relay.close()
            self.relay = None
        for relay, ticket in relays:
            if relay is None:
                continue
            held = RelayClient(self.host.identity, relay, ("127.0.0.1", mine[1]), ticket)
            try:
                address = await held.reserve()
            except (OSError, RelayError, TimeoutError) as exc:
                event("relay", held=False, relay=f"{relay[0]}:{relay[1]}", error=str(exc))
                continue
            self.relay = held
            event("relay", held=True, address=address)
            return True
        return False

    async def close_relay(self) -> None:
        if self.relay is not None:
            await self.relay.close()
            self.relay = None

    async def join(self) -> None:
        """Join the broker once (raises `Refused` with its reason)."""
        assert self.host is not None and self.profile is not None
        await self.host.connect(self.config.broker)
        up, rtt = await self.measure_network()
        addrs, relayed = self._announced(), self._relayed()
        profile = JoinProfile(
            gpu=self.profile.gpu,
            cpu=self.profile.cpu,
            cpu_cores=self.profile.cpu_cores,
            executors=[
                ExecutorInfo(
                    e.executor,
                    e.device,
                    dict(e.flops),
                    e.mem_bandwidth,
                    e.memory_bytes,
                    e.memory_free_bytes,
                )
                for e in self.profile.executors
            ],
            executor=self.config.executor.kind,
            memory_limit_bytes=self.memory_budget,
            net_up_bytes_s=up,
            rtt_s=rtt,
            version=version(),
            addrs=addrs,
            mapped=[a for a in mapped(addrs) if a not in relayed],
            relayed=relayed,
            max_batch=self.config.max_batch,
            relay_port=self.relay_offer[0] if self.relay_offer else 0,
            relay_rate=self.relay_offer[1] if self.relay_offer else 0.0,
        )
        body = msgspec.json.encode(profile)
        if self.checks is not None:
            try:
                await asyncio.to_thread(self.checks.prepare)
            except Exception as exc:  # the broker's check will fail and say so
                event("warning", message=f"the hardware check cannot run here: {exc}")
        stamp = time.time()
        signature = self.host.identity.sign(
            signed_join_bytes(body, self.broker_id, stamp), domain=JOIN_DOMAIN
        )
        try:
            reply = await self.host.request(
                self.broker_id,
                JOIN,
                Join(
                    profile=body,
                    signature=signature,
                    broker=self.broker_id,
                    timestamp=stamp,
                    token=self.config.join_token,
                    loaded=sorted(self.server.stages),
                    boot=self.boot,
                ),
                timeout=JOIN_TIMEOUT_S,
            )
        finally:
            if self.checks is not None:
                await asyncio.to_thread(self.checks.release)
        if not reply.accepted:
            raise Refused(reply.reason or "the broker refused the join")
        self.heartbeat_s = max(0.2, reply.heartbeat_s)
        if await self._hold_relay(reply):
            await self.join()  # the same process again, announcing its relayed address
            return
        self.pool = reply.pool
        self.joined.set()
        settled = heap.settle() if self.config.settle_heap else 0.0  # (what it holds for good)
        event(
            "joined",
            broker=self.broker_id,
            pool=reply.pool,
            rtt_ms=round(rtt * 1e3, 2),
            up_mb_s=round(up / 1e6, 1),
            loaded=sorted(self.server.stages),
            heap_settle_ms=round(settled * 1e3, 1),
        )

    async def heartbeat(self) -> None:
        """One heartbeat; raises `Rejoin` if the broker does not know us."""
        assert self.host is not None
        self._seq += 1
        self.server.expire()
        self.wake.clear()  # (a wake while this heartbeat is on its way sends another)
        draining = self.server.draining
        ack = await self.host.request(
            self.broker_id,
            HEARTBEAT,
            Heartbeat(
                seq=self._seq,
                loaded=sorted(self.server.stages),
                queued=self.server.in_flight,
                kv_bytes=self.server.kv_bytes(),
                draining=draining,
                work=self.server.work_done(),
            ),
            timeout=max(2.0, 2 * self.heartbeat_s),
        )
        if not ack.known:
            raise Rejoin("the broker does not know this provider (it restarted)")
        self.pool, self.reach = ack.pool or self.pool, ack.reach or self.reach
        if self.relay is not None and not self.relay.alive:
            raise Rejoin(f"our relay at {self.relay.relay[0]}:{self.relay.relay[1]} closed")
        if draining:
            self.told_draining.set()

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.heartbeat()
            try:
                await asyncio.wait_for(self.wake.wait(), self.heartbeat_s)
            except TimeoutError:
                pass
