"""The provider registry: checks joins and turns what providers say into core events.

Joins are checked (signature over the profile, this broker's peer id and a fresh, finite
timestamp; the join token; allow and deny lists; the profile's figures within bounds, its
addresses multiaddrs that are neither link-local nor a cloud's metadata service nor another
peer's; its FLOP/s against a hardware check, `broker.challenge`, which caps claims beyond what
it showed), then become `ProviderJoined` events; heartbeats, leaves and silence (a ticker
sends `ClockTicked`) become events too. The decision core (`broker.core`) decides who is
alive and what happens to their stages; the registry answers the provider as the core says
(`Welcome`, `AskToRejoin`) and keeps what only the shell needs: join profiles (addresses),
reported load, hardware checks, and the lost flags that abandon requests to a provider the
moment it is declared lost. Time is the broker's injected monotonic clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import msgspec

from broker.challenge import Checked, CheckFailed, HardwareChecks
from broker.config import BrokerConfig
from broker.core import Core
from broker.core.actions import ProviderLost
from broker.core.events import (
    ClockTicked,
    HeartbeatReceived,
    HeartbeatsMissed,
    ProviderJoined,
    ProviderLeft,
    RebalanceCheck,
    StageTimed,
)
from broker.driver import CoreDriver
from broker.events import EventLog
from broker.reach import Reachability
from broker.relays import Relays
from dag.cost import HardwareProfile, Workload
from p2p import Identity, verify
from p2p.addresses import address_problem
from proto.api.swarm import Provider, Reputation
from proto.heartbeat import Heartbeat, HeartbeatAck, StageWork
from proto.join import (
    JOIN_DOMAIN,
    MAX_CLOCK_SKEW_S,
    Join,
    JoinProfile,
    JoinReply,
    Leave,
    LeaveAck,
    signed_join_bytes,
)

log = logging.getLogger("fusionai.broker")

MAX_PROFILE_BYTES = 64 * 1024


def address_refusal(profile: JoinProfile, peer: str, link_local: bool) -> str:
    """Why the profile's announced addresses are refused ("" if they are not)."""
    for addr in dict.fromkeys([*profile.addrs, *profile.mapped, *profile.relayed]):
        problem = address_problem(addr, peer, link_local=link_local)
        if problem is not None:
            return (
                f"an announced address is refused: {problem}; announce (--announce) only "
                "addresses others can dial"
            )
    return ""


def hardware(profile: JoinProfile, peer: str) -> HardwareProfile:
    """The cost model's view of a provider: the executor it runs stages with."""
    chosen = [e for e in profile.executors if e.executor == profile.executor]
    if not chosen:
        raise ValueError(f"the profile lists no measurement of its executor {profile.executor}")
    best = max(chosen, key=lambda e: max(e.flops.values(), default=0.0))
    if not any(v > 0 for v in best.flops.values()):
        raise ValueError("the profile has no positive FLOP/s figure for its executor")
    if profile.memory_limit_bytes <= 0:
        raise ValueError("the profile's memory limit must be positive")
    return HardwareProfile(
        name=profile.gpu or profile.cpu or peer,
        flops={k: v for k, v in best.flops.items() if v > 0},
        memory_bytes=float(profile.memory_limit_bytes),
        mem_bandwidth=max(1.0, best.mem_bandwidth),
        net_bandwidth=max(1.0, profile.net_up_bytes_s),
        rtt=max(0.0, profile.rtt_s),
    )


class Registry:
    def __init__(
        self,
        config: BrokerConfig,
        broker_id: str,
        events: EventLog,
        driver: CoreDriver,
        clock: Callable[[], float] = time.monotonic,
        reachability: Reachability | None = None,
        relay_port: Callable[[], int] = lambda: 0,
        checks: HardwareChecks | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.checks = checks  # the hardware check at join (None: claims are believed)
        self.checked: dict[str, Checked] = {}  # peer -> its last hardware check
        self.reachability = reachability
        self.relay_port = relay_port  # the broker's relay, for providers nobody can dial
        self.config = config
        self.broker_id = broker_id
        self.events = events
        self.driver = driver
        self.clock = clock
        self.profiles: dict[str, JoinProfile] = {}
        self.load: dict[str, tuple[int, int]] = {}  # peer -> (queued, kv bytes), last heartbeat
        self.lost: dict[str, asyncio.Event] = {}  # set when the provider is declared lost
        self.quarantined: dict[str, str] = {}  # peer -> why its answers are not trusted
        # told each live provider's work counters as its heartbeats bring them (the charts)
        self.on_work: Callable[[str, list[StageWork]], None] = lambda peer, work: None
        driver.carry(ProviderLost, self._on_lost)
        # relays providers offer (signed tickets need our identity); and our own relay's cap
        self.relays = None
        if identity is not None:
            own, has_own = config.relay_rate_bytes_s, config.relay_port is not None
            self.relays = Relays(identity, own, has_own, self.alive, self._live)

    @property
    def core(self) -> Core:
        return self.driver.core

    def _on_lost(self, action: ProviderLost) -> None:
        self.load.pop(action.peer_id, None)
        self.lost.setdefault(action.peer_id, asyncio.Event()).set()

    def lost_event(self, peer: str) -> asyncio.Event:
        """Set once `peer` is declared lost (a fresh one after each join)."""
        return self.lost.setdefault(peer, asyncio.Event())

    def alive(self, peer: str) -> bool:
        return self.core.alive(peer)

    def holders(self, key: str, avoid: set[str]) -> list[str]:
        """Live, trusted providers with stage `key` loaded (serving it or standing by with
        it), but for those in `avoid`: who can check an answer of that stage."""
        return [
            p
            for p, keys in sorted(self.core.loaded.items())
            if key in keys and p not in avoid and p not in self.quarantined and self.alive(p)
        ]

    def quarantine(self, peer: str, reason: str) -> None:
        """Take `peer` out of the pool and refuse its joins from now on."""
        self.quarantined[peer] = reason
        if self.alive(peer):
            self.driver.handle(ProviderLeft(peer, self.clock()))

    def timed(self, peer: str, model: str, hidden: tuple[int, ...], seconds: float) -> None:
        """A stage of `model` took `seconds` on `peer` on hidden states of shape `hidden` (a
        spot check's second opinion, timed here): its profile is corrected, its speed seen."""
        if seconds > 0 and len(hidden) >= 2:
            work = Workload(hidden[0] * hidden[1], hidden[0], hidden[1], dtype="float32")
            self.driver.handle(StageTimed(peer, model, work, seconds, self.clock()))

    def mark_dead(self, peer: str, why: str) -> None:
        if self.alive(peer):
            self.events.emit("provider_unreachable", peer=peer, reason=why)
            self.driver.handle(HeartbeatsMissed(peer, self.clock()))

    # ---- protocol handlers -----------------------------------------------------------------

    def _refusal(self, peer: str, msg: Join) -> str:
        if peer in self.config.deny:
            return "this provider is on the broker's deny list"
        if peer in self.quarantined:
            return f"this provider is quarantined: {self.quarantined[peer]}"
        if self.config.allow and peer not in self.config.allow:
            return "this provider is not on the broker's allow list"
        if msg.broker != self.broker_id:
            return "this join is signed for another broker"
        if not math.isfinite(msg.timestamp):
            return "the join's timestamp is not a finite number: sign it with the unix time"
        if abs(time.time() - msg.timestamp) > MAX_CLOCK_SKEW_S:
            return (
                f"the join's timestamp is more than {MAX_CLOCK_SKEW_S:.0f} s from the broker's "
                f"clock: set this machine's clock"
            )
        if len(msg.profile) > MAX_PROFILE_BYTES:
            return "the hardware profile is too large"
        signed = signed_join_bytes(msg.profile, msg.broker, msg.timestamp)
        if not verify(peer, signed, msg.signature, domain=JOIN_DOMAIN):
            return "bad signature: the profile was not signed by this peer's key"
        if self.config.join_token is not None and msg.token != self.config.join_token:
            return "this broker needs a valid join token (--join-token)"
        return ""

    async def on_join(self, peer: str, msg: Join | Leave) -> JoinReply | LeaveAck:
        if isinstance(msg, Leave):
            if self.alive(peer):
                self.events.emit("provider_left", peer=peer, reason=msg.reason)
                self.driver.handle(ProviderLeft(peer, self.clock()))
            return LeaveAck()
        reason = self._refusal(peer, msg)
        profile: JoinProfile | None = None
        hw: HardwareProfile | None = None
        if not reason:
            try:
                profile = msgspec.json.decode(msg.profile, type=JoinProfile)
                hw = hardware(profile, peer)
            except (msgspec.DecodeError, ValueError) as exc:
                reason = f"the hardware profile is not valid: {exc}"
        if profile is not None and not reason:
            reason = address_refusal(profile, peer, self.config.allow_link_local)
        if hw is not None and not reason and self.checks is not None:
            try:
                hw = await self._check(peer, hw, msg.boot)
            except CheckFailed as exc:
                reason = f"the hardware check failed: {exc}"
        if reason or profile is None or hw is None:
            self.events.emit("join_refused", peer=peer, reason=reason)
            return JoinReply(accepted=False, reason=reason)
        self.profiles[peer] = profile
        if profile.relayed:
            hw = self._through_relay(hw, profile)
        relay, ticket = await self._relays(peer, profile)
        if self.reachability is not None:
            self.reachability.check(peer, profile)
        # A provider we thought alive joining again restarted (unless it is the same process,
        # `boot`): the core loses it first, which abandons requests to it.
        self.driver.handle(
            ProviderJoined(
                peer,
                hw,
                self.clock(),
                loaded=frozenset(msg.loaded),
                executor=profile.executor,
                memory_bytes=profile.memory_limit_bytes,
                boot=msg.boot,
            )
        )
        if self.lost_event(peer).is_set():  # requests from now on wait on a fresh one
            self.lost[peer] = asyncio.Event()
        return JoinReply(
            accepted=True,
            pool="backup",
            heartbeat_s=self.config.heartbeat_s,
            relay_port=self.relay_port(),
            relay=relay,
            relay_ticket=ticket,
        )

    async def _check(self, peer: str, hw: HardwareProfile, boot: str) -> HardwareProfile:
        """`hw` capped to what the hardware check showed (raises `CheckFailed`); a check
        that ran is logged (a re-join of the same process reuses the last)."""
        assert self.checks is not None
        hw, checked = await self.checks.check(peer, hw, boot)
        if self.checked.get(peer) is checked:
            return hw
        self.checked[peer] = checked
        self.events.emit(
            "provider_checked", peer=peer, claimed_flops=round(checked.claimed),
            shown_flops=round(checked.shown), capped=checked.capped,
            scale=round(checked.scale, 4), rounds=checked.rounds,
            seconds=round(checked.seconds, 3),
        )  # fmt: skip
        return hw

    def _through_relay(self, hw: HardwareProfile, profile: JoinProfile) -> HardwareProfile:
        """A relayed provider as the cost model sees it: every exchange crosses the relay
        leg too (about its own round trip to the broker, again), and its bandwidth is at most
        its share of its relay's cap."""
        if self.relays is not None:
            share = self.relays.share(profile)
        else:
            cap = self.config.relay_rate_bytes_s
            relayed = sum(1 for p in self._live() if p.relayed)
            share = cap / max(1, relayed) if cap > 0 else math.inf
        bandwidth = min(hw.net_bandwidth, share)
        return dataclasses.replace(hw, rtt=2 * hw.rtt, net_bandwidth=max(1.0, bandwidth))

    def _live(self) -> list[JoinProfile]:
        return [p for peer, p in self.profiles.items() if self.alive(peer)]

    async def _relays(self, peer: str, profile: JoinProfile) -> tuple[str, str]:
        """Take the relay `peer` offers, if any; (address, ticket) of the provider relay it
        should hold a port at if it needs one, or ("", "") for ours."""
        if self.relays is None:
            return "", ""
        observed = self.reachability.observed(peer) if self.reachability is not None else None
        why = await self.relays.offer(peer, observed, profile)
        if profile.relay_port:
            self.events.emit("relay_offer", peer=peer, taken=not why, reason=why,
                             rate=profile.relay_rate)  # fmt: skip
        return self.relays.choose(peer)

    async def on_heartbeat(self, peer: str, msg: Heartbeat) -> HeartbeatAck:
        known = self.alive(peer)
        self.driver.handle(
            HeartbeatReceived(
                peer,
                self.clock(),
                loaded=frozenset(msg.loaded) if known else None,
                draining=msg.draining and known,
            )
        )
        if not known:
            return HeartbeatAck(known=False)  # the core says: join again
        self.load[peer] = (msg.queued, msg.kv_bytes)
        self.on_work(peer, msg.work)
        member = self.core.pool.providers.get(peer)
        return HeartbeatAck(
            known=True,
            pool=member.status.value if member is not None else "",
            reach=self.reach_kind(peer),
        )

    def reach_kind(self, peer: str) -> str:
        """How `peer` was reached back at its join: direct, mapped, relayed ("" not known)."""
        reach = self.reachability.reach.get(peer) if self.reachability else None
        return reach.kind if reach is not None else ""

    # ---- the clock -------------------------------------------------------------------------

    async def tick(self, stop: asyncio.Event) -> None:
        """Turn silence into deaths: a tick four times per heartbeat interval; and now and
        then, a check whether idle models would gain from a fresh placement."""
        every = self.core.config.pool.tick_every
        rebalance_at = self.clock() + self.config.rebalance_every_s
        while not stop.is_set():
            try:
                self.driver.handle(ClockTicked(self.clock()))
                if self.clock() >= rebalance_at:
                    rebalance_at = self.clock() + self.config.rebalance_every_s
                    self.driver.handle(RebalanceCheck(self.clock()))
            except Exception:  # a bug must not stop failure detection for good
                log.exception("the membership tick failed; trying again")
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass

    def summary(
        self, reputation_of: Callable[[str], Reputation] = lambda peer: Reputation()
    ) -> list[Provider]:
        """Every provider known, as the API shows it (`reputation_of(peer)`: the verifier's
        account of it)."""
        out = []
        now = self.clock()
        state = self.core.pool
        for peer, p in sorted(state.providers.items()):
            profile = self.profiles.get(peer)
            queued, kv = self.load.get(peer, (0, 0))
            reach = self.reachability.reach.get(peer) if self.reachability else None
            out.append(
                Provider(
                    peer_id=peer,
                    pool=p.status.value,
                    stage=p.stage,
                    hardware=p.profile.name,
                    executor=profile.executor if profile else None,
                    flops=dict(p.profile.flops),
                    memory_bytes=int(p.profile.memory_bytes),
                    net_up_bytes_s=float(p.profile.net_bandwidth),
                    rtt_s=float(p.profile.rtt),
                    correction=round(p.correction.factor, 3),
                    last_seen_s=round(now - p.last_seen, 3),
                    queued=queued,
                    kv_bytes=kv,
                    loaded=sorted(self.core.loaded.get(peer, ())),
                    addrs=list(profile.addrs) if profile else [],
                    flapping=p.flapping(state.now, state.config),
                    reputation=reputation_of(peer),
                    reach=reach.kind if reach else "unknown",
                    observed=reach.observed if reach else None,
                    checked_flops=checked.shown if (checked := self.checked.get(peer)) else None,
                )
            )
        return out
