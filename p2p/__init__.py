"""Peer-to-peer layer: identity, the libp2p host behind an asyncio API, RPC and streams.

Owns peer identity (Ed25519 keys and peer ids), the py-libp2p host (Noise only, yamux only)
running in one dedicated trio thread per process, request/response RPC multiplexed over
long-lived streams, message streams with credit-based flow control, and the wire codec
(framing, typed messages, tensors). It knows nothing of what the messages mean.

Importing this package is cheap: libp2p and trio are loaded only when a `Host` starts.
"""

from p2p.codec import ErrorCode, Message, ProtocolSpec, Relay
from p2p.config import HostConfig
from p2p.errors import (
    ConnectionLost,
    FrameError,
    HostClosed,
    IdentityError,
    IdentityInUse,
    P2PError,
    Refused,
    RemoteError,
    RequestTimeout,
)
from p2p.host import EndOfStream, Host, Stream
from p2p.identity import Identity, check_multiaddr, default_data_dir, verify
from p2p.tensor import Tensor

__all__ = [
    "ConnectionLost",
    "EndOfStream",
    "ErrorCode",
    "FrameError",
    "Host",
    "HostClosed",
    "HostConfig",
    "Identity",
    "IdentityError",
    "IdentityInUse",
    "Message",
    "P2PError",
    "ProtocolSpec",
    "Refused",
    "Relay",
    "RemoteError",
    "RequestTimeout",
    "Stream",
    "Tensor",
    "check_multiaddr",
    "default_data_dir",
    "verify",
]
