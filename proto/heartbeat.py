"""`/fusionai/heartbeat/1`: a provider's periodic "still here", with its load.

A broker that answers `known=False` has forgotten the provider (it restarted): the provider
joins again and re-announces what it has loaded.
"""

from __future__ import annotations

import msgspec

from p2p.codec import Message, ProtocolSpec


class Heartbeat(Message, frozen=True, tag="Heartbeat/1"):
    seq: int
    loaded: list[str] = msgspec.field(default_factory=list)  # stages loaded (serving or standby)
    queued: int = 0  # requests waiting or running
    kv_bytes: int = 0  # KV-cache memory held by generation sessions
    draining: bool = False  # leaving: finishing what it has, taking nothing new


class HeartbeatAck(Message, frozen=True, tag="HeartbeatAck/1"):
    known: bool = True


HEARTBEAT = ProtocolSpec("/fusionai/heartbeat/1", request=Heartbeat, response=HeartbeatAck)
