"""Building a py-libp2p host the way we need it: Noise only, yamux only, our Ed25519 key.

A default py-libp2p host also accepts `/plaintext/2.0.0`, secio and TLS, and mplex; ours offers
exactly one security protocol and one muxer, so a dial that asks for anything else is refused
during negotiation. Imported only by the trio thread, when a host starts.

Its yamux streams return receive credit as go-yamux does: a WINDOW_UPDATE once half the window
has been read, not one for each read (`batched_release`).
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
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from p2p.identity import Identity

# py-libp2p logs every peer that fails negotiation at WARNING (that is our refusal working)
# and every failed dial at ERROR (the p2p layer raises ConnectionLost saying so instead).
logging.getLogger("libp2p").setLevel(logging.ERROR)
logging.getLogger("libp2p.transport.tcp.tcp").setLevel(logging.CRITICAL)


async def batched_release(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """After a read of `bytes_read` bytes: send a WINDOW_UPDATE only once what the peer may
    send has fallen half a window short of the target (go-yamux's `sendWindowUpdate`; the
    target grows, as before, when updates come within 4 round trips of each other).

    py-libp2p 0.8.1 also sends one for every read below that mark ("partial slack", "release
    on read"): on a request and its answer of a kilobyte or two, as the chained steps of a
    generation are, a 30-byte frame each way for each message, as many sends, encryptions and
    wake-ups as the messages themselves. A peer whose reader stops reading cannot be
    sent more than the window either way; ours never stops (`p2p._channel`)."""
    increment = 0
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        owed = self.target_recv_window - (self.recv_window + buffered)
        if owed > 0 and owed >= self._grow_threshold():
            increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
            self._pending_recv_release = 0
    if increment > 0:
        await self.send_window_update(increment, skip_lock=True)


# (libp2p is pinned to the version this was written for: pyproject.toml)
YamuxStream._auto_tune_and_send_window_update = batched_release


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
