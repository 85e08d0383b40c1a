"""What a join and a heartbeat may carry: finite figures within bounds, and addresses that
are multiaddrs, neither link-local nor a cloud's metadata service nor another peer's. Each
case is a crafted, correctly signed join sent to a real broker's registry (in-process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from p2p import Identity, RemoteError
from proto.heartbeat import HEARTBEAT, Heartbeat
from proto.join import ExecutorInfo
from tests.test_broker.inproc import crafted_profile, signed_join, swarm

pytestmark = pytest.mark.timeout(60)


async def _join(tmp_path: Path, profile: Any, settings: dict[str, Any] | None = None,
                **fields: Any) -> tuple[bool, str, bool]:  # fmt: skip
    """(accepted, reason, in the pool) of one crafted join."""
    s = await swarm(tmp_path, **(settings or {}))
    try:
        identity = Identity.ephemeral()
        if callable(profile):
            profile = profile(identity.peer_id)
        join = signed_join(identity, s.broker.peer_id, profile, **fields)
        reply = await s.broker.registry.on_join(identity.peer_id, join)
        assert not isinstance(reply, type(None))
        pooled = identity.peer_id in s.broker.registry.core.pool.providers
        refused = [e for e in s.events("join_refused") if e["peer"] == identity.peer_id]
        assert bool(refused) != reply.accepted  # a refusal is in the event log too
        return reply.accepted, reply.reason, pooled
    finally:
        await s.close()


@pytest.mark.parametrize("stamp", [float("nan"), float("inf"), float("-inf")])
async def test_a_join_stamped_with_a_non_finite_time_is_refused(
    tmp_path: Path, stamp: float
) -> None:
    """`abs(now - nan) > skew` is False: such a join would pass the freshness check and never
    expire."""
    accepted, reason, pooled = await _join(tmp_path, crafted_profile(), timestamp=stamp)
    assert not accepted and not pooled
    assert "not a finite number" in reason


def _executor(**figures: Any) -> list[ExecutorInfo]:
    base: dict[str, Any] = {"flops": {"float32": 5e10}, "mem_bandwidth": 1e10,
                            "memory_bytes": 8 << 30, "memory_free_bytes": 8 << 30}  # fmt: skip
    return [ExecutorInfo("ort", "cpu", **{**base, **figures})]


OUT_OF_BOUNDS = {
    "flops above any machine": {"executors": _executor(flops={"float32": 1e30})},
    "negative flops": {"executors": _executor(flops={"float32": -5e10})},
    "negative bandwidth": {"executors": _executor(mem_bandwidth=-1.0)},
    "negative memory": {"executors": _executor(memory_bytes=-1)},
    "a round trip of a day": {"rtt_s": 86400.0},
    "a negative uplink": {"net_up_bytes_s": -1.0},
    "an uplink beyond any link": {"net_up_bytes_s": 1e20},
}


@pytest.mark.parametrize("case", sorted(OUT_OF_BOUNDS))
async def test_a_profile_figure_out_of_bounds_is_refused(tmp_path: Path, case: str) -> None:
    profile = crafted_profile(**OUT_OF_BOUNDS[case])
    accepted, reason, pooled = await _join(tmp_path, profile)
    assert not accepted and not pooled
    assert reason.startswith("the hardware profile is not valid:"), reason


@pytest.mark.parametrize("literal", [b"1e999", b"-1e999", b"NaN", b"Infinity"])
async def test_a_profile_with_a_non_finite_figure_is_refused(
    tmp_path: Path, literal: bytes
) -> None:
    """JSON has no NaN; an overflowing literal decodes to infinity in most parsers."""
    body = msgspec.json.encode(crafted_profile()).replace(b'"rtt_s":0.05', b'"rtt_s":' + literal)
    assert literal in body
    accepted, reason, pooled = await _join(tmp_path, body)
    assert not accepted and not pooled
    assert "the hardware profile is not valid" in reason


async def test_a_heartbeat_with_a_negative_queue_is_refused(tmp_path: Path) -> None:
    """A negative load would draw every request to the provider (least loaded first)."""
    s = await swarm(tmp_path)
    try:
        provider = await s.provider()
        assert provider.host is not None
        with pytest.raises(RemoteError, match="queued") as caught:
            await provider.host.request(
                s.broker.peer_id, HEARTBEAT, Heartbeat(seq=1, queued=-(10**9)), timeout=5
            )
        assert caught.value.code == "bad_request"
        assert s.broker.registry.load.get(provider.host.peer_id, (0, 0))[0] >= 0
    finally:
        await s.close()


OTHER = Identity.ephemeral().peer_id
ADDRESSES = {
    "not a multiaddr": ("not-a-multiaddr", "is not a multiaddr"),
    "cloud metadata": ("/ip4/169.254.169.254/tcp/80", "metadata"),
    "AWS metadata over IPv6": ("/ip6/fd00:ec2::254/tcp/80", "metadata"),
    "link-local IPv4": ("/ip4/169.254.10.20/tcp/7000", "link-local"),
    "link-local IPv6": ("/ip6/fe80::1/tcp/7000", "link-local"),
    "another provider's id": (f"/ip4/127.0.0.1/tcp/7000/p2p/{OTHER}", "another peer"),
}


@pytest.mark.parametrize("case", sorted(ADDRESSES))
@pytest.mark.parametrize("field", ["addrs", "relayed"])
async def test_an_announced_address_that_must_not_be_dialled_is_refused(
    tmp_path: Path, case: str, field: str
) -> None:
    addr, why = ADDRESSES[case]
    accepted, reason, pooled = await _join(tmp_path, crafted_profile(**{field: [addr]}))
    assert not accepted and not pooled
    assert "an announced address is refused" in reason and why in reason, reason


@pytest.mark.parametrize(
    "case", ["cloud metadata", "AWS metadata over IPv6", "link-local IPv4", "link-local IPv6"]
)
async def test_link_local_and_metadata_addresses_pass_when_the_broker_allows_them(
    tmp_path: Path, case: str
) -> None:
    addr, _ = ADDRESSES[case]
    settings = {"allow_link_local": True}
    accepted, reason, pooled = await _join(tmp_path, crafted_profile(addrs=[addr]), settings)
    assert accepted and pooled, reason


async def test_good_addresses_are_stored_and_shown(tmp_path: Path) -> None:
    """Its own id, a public or private address, a relay's circuit: accepted as announced."""
    s = await swarm(tmp_path)
    try:
        identity = Identity.ephemeral()
        me = identity.peer_id
        addrs = [
            f"/ip4/127.0.0.1/tcp/7000/p2p/{me}",
            "/ip4/192.168.1.20/tcp/7000",
            f"/ip4/203.0.113.5/tcp/4001/p2p/{OTHER}/p2p-circuit/p2p/{me}",
            "/dns4/provider.example.org/tcp/7000",
        ]
        join = signed_join(identity, s.broker.peer_id, crafted_profile(addrs=addrs))
        reply = await s.broker.registry.on_join(me, join)
        assert reply.accepted, reply.reason
        (shown,) = [p for p in s.broker.registry.summary() if p.peer_id == me]
        assert shown.addrs == addrs
    finally:
        await s.close()
