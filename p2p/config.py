"""Configuration of a p2p host: one frozen dataclass, a unit on every field."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2p.codec import MAX_CHUNK

DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/0",)


@dataclass(frozen=True)
class HostConfig:
    """How a `p2p.Host` listens, buffers and runs handlers."""

    # Multiaddrs to listen on; port 0 lets the OS choose.
    listen: tuple[str, ...] = DEFAULT_LISTEN
    # Directory holding the identity key; None means an ephemeral key kept in memory only.
    data_dir: Path | None = None
    # Bytes a peer may send us on one stream before we grant more (credit window); bytes.
    recv_window: int = 16 * 1024 * 1024
    # Largest single wire frame (chunk of a message); bigger messages are split; bytes.
    chunk_size: int = 256 * 1024
    # Worker threads that run compute handlers; threads.
    compute_threads: int = 4
    # Requests one inbound stream may have executing at once; further ones wait (holding
    # their flow-control credit, which slows the sender down); requests.
    max_concurrent_requests: int = 256
    # Default deadline of a request when the caller gives none; seconds.
    request_timeout: float = 60.0
    # Deadline for dialling a peer and opening a stream; seconds.
    connect_timeout: float = 15.0
    # Per protocol id, an override of the spec's largest message size; bytes.
    max_message_bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1024 <= self.chunk_size <= MAX_CHUNK:
            raise ValueError(
                f"chunk_size must be between 1024 and {MAX_CHUNK} bytes, got {self.chunk_size}"
            )
        if self.recv_window < 2 * MAX_CHUNK:
            raise ValueError(
                f"recv_window must be at least {2 * MAX_CHUNK} bytes (two of the largest "
                f"frames a peer may send), got {self.recv_window}"
            )
        if self.compute_threads < 1:
            raise ValueError(f"compute_threads must be >= 1, got {self.compute_threads}")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if not self.listen:
            raise ValueError("listen needs at least one multiaddr")
