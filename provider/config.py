"""The provider daemon's settings: one frozen dataclass, a unit on every field; the CLI's
`fusionai provider start` flags map onto it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from provider.faults import Fault
from provider.hosting import ExecutorChoice
from provider.stepaside import StepAside


@dataclass(frozen=True)
class ProviderConfig:
    broker: str  # the broker's multiaddr, ending in /p2p/<peer id>
    data_dir: Path
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce: tuple[str, ...] = ()  # addresses others dial instead of the listen ones (e.g.
    # a public address forwarded to this machine); /p2p/<peer id> is added when missing
    upnp: bool = True  # ask the home router for a port mapping (UPnP) when behind one
    relay_rate_bytes_s: float = 0.0  # offer a relay to providers nobody can dial, at this cap
    # (bytes/s; 0: offer none); the broker takes it only if it reaches the relay's port
    relay_port: int = 0  # that relay's control port (0: any free one)
    punch: bool = True  # punch direct connections to peers met through a relay (both ways)
    executor: ExecutorChoice = field(default_factory=ExecutorChoice)
    max_memory_bytes: int | None = None  # None: the device's free memory when profiled
    cache_bytes: int = 20 * 1024**3  # artifact cache size limit, bytes
    drain_s: float = 30.0  # how long a graceful stop waits for requests in flight, seconds
    join_token: str | None = None
    reprofile: bool = False  # measure the hardware again instead of using the cached profile
    max_queue: int = 32  # requests waiting for a compute slot before new ones are busy
    per_peer: int = 8  # of those, at most this many from one peer
    compute_slots: int = 1  # stage runs at once (each uses every core, or the GPU)
    max_batch: int = 16  # session steps of one stage run together, at most (1: each alone)
    batch_window_ms: float = 2.0  # a run waits this long at most for the sessions it expects
    kv_budget_bytes: int | None = None  # None: a quarter of the memory budget
    idle_timeout_s: float = 300.0  # a generation session idle this long is closed, seconds
    fault: Fault | None = None  # a fault to inject (tests and chaos runs only)
    backoff_max_s: float = 30.0  # longest wait between joins while the broker is away
    status_every_s: float = 5.0  # live status line on a terminal, seconds (0: off)
    status_file_every_s: float = 2.0  # rewrite DATA_DIR/status.json this often, seconds
    step_aside: StepAside = field(default_factory=StepAside)  # when the owner needs the machine
    settle_heap: bool = False  # freeze the heap once joined and after each load (`p2p.heap`),
    # so that no full collection stalls the sessions: the daemon's command does; a provider
    # run inside another program leaves that program's collector alone
