"""`/fusionai/heartbeat/1`: a provider's periodic "still here", with its load.

A broker that answers `known=False` has forgotten the provider (it restarted): the provider
joins again and re-announces what it has loaded.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from p2p.codec import Message, ProtocolSpec

Count = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**50)]
Keys = Annotated[list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=4096)]


Total = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class StageWork(msgspec.Struct, frozen=True):  # (unknown fields: a later provider's, ignored)
    """What a provider has done with one stage since it started (counters: they only grow, and
    start again from 0 when the provider restarts)."""

    key: Annotated[str, msgspec.Meta(max_length=512)]
    requests: Total = 0  # forward requests and generation sessions opened
    tokens: Total = 0  # tokens generated through it: session steps, one per row
    positions: Total = 0  # token positions it computed (rows x sequence), every kind of run
    runs: Total = 0  # executor runs
    busy_s: Annotated[float, msgspec.Meta(ge=0, le=1e12)] = 0.0  # seconds those runs took


class Heartbeat(Message, frozen=True, tag="Heartbeat/1"):
    """Every figure is bounded and not negative (a negative queue would draw all requests)."""

    seq: Annotated[int, msgspec.Meta(ge=0, le=2**62)]
    loaded: Keys = msgspec.field(default_factory=list)  # stages loaded (serving or standby)
    queued: Count = 0  # requests waiting or running
    kv_bytes: Bytes = 0  # KV-cache memory held by generation sessions
    draining: bool = False  # leaving: finishing what it has, taking nothing new
    # its work per stage (the dashboard's charts: tokens/s, utilisation, stage latency)
    work: Annotated[list[StageWork], msgspec.Meta(max_length=4096)] = msgspec.field(
        default_factory=list
    )


class HeartbeatAck(Message, frozen=True, tag="HeartbeatAck/1"):
    known: bool = True
    # what the broker makes of the provider ("" from brokers that do not say): its pool
    # ("active", "backup", "draining") and how clients reach it ("direct", "mapped",
    # "relayed", "unreachable", "checking"), for `fusionai provider status`
    pool: Annotated[str, msgspec.Meta(max_length=32)] = ""
    reach: Annotated[str, msgspec.Meta(max_length=32)] = ""


HEARTBEAT = ProtocolSpec("/fusionai/heartbeat/1", request=Heartbeat, response=HeartbeatAck)
