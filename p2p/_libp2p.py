"""Building a py-libp2p host the way we need it: Noise only, yamux only, our Ed25519 key.

A default py-libp2p host also accepts `/plaintext/2.0.0`, secio and TLS, and mplex; ours offers
exactly one security protocol and one muxer, so a dial that asks for anything else is refused
during negotiation. Imported only by the trio thread, when a host starts.
"""

from __future__ import annotations

import logging
from typing import Any

from libp2p import new_host
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from p2p.identity import Identity

# py-libp2p logs every peer that fails negotiation at WARNING (that is our refusal working)
# and every failed dial at ERROR (the p2p layer raises ConnectionLost saying so instead).
logging.getLogger("libp2p").setLevel(logging.ERROR)
logging.getLogger("libp2p.transport.tcp.tcp").setLevel(logging.CRITICAL)


def key_pair(identity: Identity) -> KeyPair:
    private = Ed25519PrivateKey.from_bytes(identity.private_key_bytes())
    return KeyPair(private, private.get_public_key())


def make_host(identity: Identity) -> Any:
    """A libp2p host with our identity that speaks Noise and yamux and nothing else."""
    kp = key_pair(identity)
    host = new_host(
        key_pair=kp,
        sec_opt={
            TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
                kp, noise_privkey=create_x25519_key_pair().private_key
            )
        },
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )
    if str(host.get_id()) != identity.peer_id:  # pragma: no cover - a libp2p change
        raise RuntimeError(
            f"libp2p derived peer id {host.get_id()} from our key, expected {identity.peer_id}"
        )
    return host
