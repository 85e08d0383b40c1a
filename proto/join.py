"""`/fusionai/join/1`: a provider joins a broker (signed hardware profile) or leaves it.

The profile travels as msgspec-encoded bytes with the provider's Ed25519 signature over
`signed_join_bytes(...)`: the profile, the broker's peer id and a timestamp, so a signed join
cannot be replayed to another broker or much later. A provider that joins again (after the
broker restarted, or after a network cut) lists the stages it still has loaded.

Every figure of a profile is finite and within bounds no real machine reaches (a profile
with NaN, infinity or a negative figure does not decode); the broker checks further what a
type cannot say (the join's timestamp, the addresses, the FLOP/s against a hardware check).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from p2p.codec import Message, ProtocolSpec
from p2p.identity import verify

JOIN_DOMAIN = "fusionai/join/1"
RELAY_TICKET_DOMAIN = "fusionai/relay-ticket/1"
RELAY_TICKET_S = 600.0  # a relay ticket is good for a reservation this long after it is signed
MAX_CLOCK_SKEW_S = 300.0  # a join signed further from the broker's clock is refused

# Bounds of a profile's figures, far above any machine's (a type refuses NaN and infinity too)
Flops = Annotated[float, msgspec.Meta(ge=0, le=1e18)]  # FLOP/s
Rate = Annotated[float, msgspec.Meta(ge=0, le=1e14)]  # bytes/s
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**50)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Addr = Annotated[str, msgspec.Meta(max_length=512)]
Addrs = Annotated[list[Addr], msgspec.Meta(max_length=32)]
Keys = Annotated[list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=4096)]


class ExecutorInfo(msgspec.Struct, frozen=True):
    """One executor on one device, as the provider measured it."""

    executor: Name  # "ort" or "torch"
    device: Name  # "CPUExecutionProvider", "CUDAExecutionProvider", "cuda:0", "cpu", ...
    flops: Annotated[dict[Name, Flops], msgspec.Meta(max_length=16)]  # matmul FLOP/s per dtype
    mem_bandwidth: Rate  # bytes/s
    memory_bytes: Bytes  # device memory total
    memory_free_bytes: Bytes  # device memory free when measured


class JoinProfile(msgspec.Struct, frozen=True):
    gpu: Name | None
    cpu: Name
    cpu_cores: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    executors: Annotated[list[ExecutorInfo], msgspec.Meta(max_length=16)]
    executor: Name  # the executor this provider runs stages with ("ort" or "torch")
    memory_limit_bytes: Bytes  # most memory its stages may use (the --max-memory budget)
    net_up_bytes_s: Rate  # measured upload bandwidth towards the broker
    rtt_s: Annotated[float, msgspec.Meta(ge=0, le=600)]  # measured round trip to the broker; s
    version: Name  # fusionai version
    addrs: Addrs = msgspec.field(default_factory=list)  # multiaddrs clients can dial
    # those of `addrs` a router forwards to it (a UPnP mapping, a forwarded port), not its own
    mapped: Addrs = msgspec.field(default_factory=list)
    relayed: Addrs = msgspec.field(default_factory=list)  # of `addrs`, a relay's port
    # a relay this provider runs for others (p2p.relay) on the IP the broker sees it on: its
    # control port (0: none) and its bandwidth cap, bytes/s
    relay_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    relay_rate: Rate = 0.0
    # session steps it runs together at most (`--max-batch`): its batch slots per stage, from
    # which the broker sizes admission (0: not said, by a provider of an earlier release)
    max_batch: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0


class Join(Message, frozen=True, tag="Join/1"):
    profile: bytes  # msgspec JSON of a JoinProfile
    signature: bytes  # Ed25519 over signed_join_bytes(profile, broker, timestamp)
    broker: str  # the broker's peer id this join is meant for
    timestamp: float  # unix time of signing (the broker refuses one that is not finite)
    token: str | None = None  # the broker's join token, if it requires one
    loaded: Keys = msgspec.field(default_factory=list)  # stages still loaded (re-join)
    boot: str = ""  # random per provider process: a join with the same boot as the broker
    # knows is that process joining again (a missed heartbeat), not a restart


class Leave(Message, frozen=True, tag="Leave/1"):
    reason: str = ""


class JoinReply(Message, frozen=True, tag="JoinReply/1"):
    accepted: bool
    pool: str = ""  # "active" or "backup" when accepted
    heartbeat_s: float = 5.0  # send a heartbeat this often
    relay_port: int = 0  # the broker's relay (p2p.relay) on its IP, for the unreachable
    relay: str = ""  # or first a provider's relay, /ip4/IP/tcp/PORT, for the unreachable
    relay_ticket: str = ""  # that relay asks for it: `relay_ticket(...)`, signed by the broker
    reason: str = ""  # why not, when refused


class LeaveAck(Message, frozen=True, tag="LeaveAck/1"):
    pass


def signed_join_bytes(profile: bytes, broker: str, timestamp: float) -> bytes:
    """What a join signature covers."""
    return b"\0".join([profile, broker.encode(), repr(float(timestamp)).encode()])


JOIN = ProtocolSpec("/fusionai/join/1", request=(Join, Leave), response=(JoinReply, LeaveAck))


def relay_ticket_bytes(relay: str, peer: str, expires: int) -> bytes:
    """What a relay ticket signs: the broker lets `peer` reserve a port at provider `relay`'s
    relay until `expires` (unix time). The ticket is "EXPIRES.SIGNATURE_HEX"."""
    return b"\0".join([relay.encode(), peer.encode(), str(expires).encode()])


def relay_ticket_ok(broker: str, relay: str, peer: str, ticket: str, now: float) -> bool:
    """Whether `ticket` ("EXPIRES.SIGNATURE_HEX") is `broker`'s, lets `peer` reserve at
    provider `relay`'s relay, and has not expired."""
    expires, _, signature = ticket.partition(".")
    try:
        until, sig = int(expires), bytes.fromhex(signature)
    except ValueError:
        return False
    signed = relay_ticket_bytes(relay, peer, until)
    return until >= now and verify(broker, signed, sig, domain=RELAY_TICKET_DOMAIN)
