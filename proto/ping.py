"""`/fusionai/ping/1`: measure round trips and check that a peer answers.

The answer echoes the nonce and the payload, so a caller can measure round trips with a
payload of any size up to the limit.
"""

from __future__ import annotations

from p2p.codec import Message, ProtocolSpec


class Ping(Message, frozen=True, tag="Ping/1"):
    nonce: int
    payload: bytes = b""


class Pong(Message, frozen=True, tag="Pong/1"):
    nonce: int
    payload: bytes = b""


PING = ProtocolSpec("/fusionai/ping/1", request=Ping, response=Pong, max_message_bytes=1 << 20)
