"""The broker service's configuration: one frozen dataclass, a unit on every field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from broker.core import CoreConfig
from broker.core.placement import PlacementConfig
from broker.core.pool import PoolConfig
from dag.cost import Workload

LOAD_OVERHEAD = 1.2  # providers need this times a stage's weights (executor arenas)
PLACEMENT_WORK = Workload(tokens=32 * 128, sequences=32, context=128, dtype="float32")


@dataclass(frozen=True)
class BrokerConfig:
    data_dir: Path  # identity, SQLite database, model store
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/7370",)  # p2p multiaddrs for providers
    relay_port: int | None = 0  # the relay for providers nobody can dial (p2p.relay), on
    # the --listen IP (0: any free port, told to providers at join; None: no relay)
    relay_rate_bytes_s: float = 0.0  # the relay's forwarding cap, all connections (0: none)
    http_host: str = "127.0.0.1"  # HTTP API address
    http_port: int = 7371  # HTTP API port (0: any free port)
    public_url: str | None = None  # base URL providers fetch artifacts from (None: the HTTP
    # address, with 127.0.0.1 when listening on all interfaces)
    db: Path | None = None  # SQLite file (None: data_dir / "broker.db")
    join_token: str | None = None  # providers must present it to join (None: open)
    allow: frozenset[str] = frozenset()  # peer ids allowed to join (empty: anyone)
    deny: frozenset[str] = frozenset()  # peer ids refused
    trust_claims: bool = False  # believe joining providers' hardware profiles: no hardware
    # check at join, and a newcomer may take served blocks before its stage times are seen
    # (tests of placement; a swarm of machines the operator knows)
    check_s: float = 0.25  # a joining provider's hardware check lasts this long at the speed
    # it claims; seconds
    claim_factor: float = 4.0  # claimed FLOP/s above this times what the check showed are
    # capped there (every speed figure of the profile scaled down alike)
    allow_link_local: bool = False  # accept announced link-local and cloud-metadata addresses
    # (169.254.0.0/16, fe80::/10, 169.254.169.254, ...): a lab on one link
    heartbeat_s: float = 5.0  # providers send a heartbeat this often; seconds
    missed_heartbeats: int = 3  # heartbeats missed in a row before a provider is dead
    queue_policy: str = "fifo"  # "fifo" or "sjf-bsbf"
    replicas: int | None = 1  # pipeline replicas per model (None: as many as pay)
    placement: str = "ours"  # "ours" (the decision core's) or "even": one pipeline split evenly
    # over every provider, the baseline ours is measured against (`broker.core.placement`)
    microbatch: int | None = None  # sequences per microbatch of a batch job that names none
    # (None: sized from the job and its route, `broker.core.microbatch`, at most 32)
    max_attempts: int = 5  # tries of one microbatch before its job fails
    request_timeout_s: float = 60.0  # one stage request may take this long; seconds
    in_flight: int | None = None  # microbatches of one job in the pipeline at once (None: one
    # per station of its route and one more, at most 8: `broker.core.microbatch`)
    relay: str = "chain"  # batch activations go provider to provider ("chain"), or each
    # stage's there and back through the broker ("star")
    restart_grace_s: float | None = None  # after a restart, how long placed providers have to
    # re-join before they count as lost (None: one heartbeat timeout plus a heartbeat)
    event_log_size: int = 100_000  # events kept in the bounded log
    max_job_texts: int = 100_000  # sequences one job may carry
    max_body_bytes: int = 64 * 1024**2  # JSON request bodies; bytes
    max_artifact_bytes: int = 16 * 1024**3  # one uploaded artifact; bytes
    api_keys: tuple[str, ...] = ()  # HTTP clients must present one (empty: the API is open)
    admin_keys: tuple[str, ...] = ()  # keys that may also add or replace models and upload
    # artifacts (with api_keys or admin_keys set, other keys get 403 there)
    artifact_token_s: float = 900.0  # an artifact link given to a provider lives this long,
    # plus a second per MB of the artifact (a download at 1 MB/s); seconds
    http_idle_s: float = 20.0  # an HTTP connection that has not sent a whole request head
    # this long after it opened or after its last answer is closed (slow or idle); seconds
    # (more than the 15 s an aiohttp client keeps an idle one: none reuses a closing one)
    tls_cert: Path | None = None  # PEM certificate for HTTPS (with tls_key)
    tls_key: Path | None = None  # its PEM private key
    verify_fraction: float = 0.05  # stage tasks of batch jobs and embedding requests run
    # again for a second opinion (another provider holding the stage, else the broker)
    verify_rtol: float = 1e-2  # answers agree when they differ by at most
    verify_atol: float = 1e-3  # atol + rtol * (largest magnitude of the reference)
    verify_share: float = 0.21  # of the OpenAI endpoints' answers whose providers' signed
    # commitments the broker checks by a rerun (0.21: a provider wrong on every answer is
    # caught within 20 of them with probability 0.99)
    client_batching: bool = True  # the OpenAI endpoints run their answers' embeddings, heads
    # and steps to a provider in batches (`client.stepmux`); off: each answer's on its own
    verify_redo_s: float = 3600.0  # a quarantined provider's results this recent are redone
    max_interactive: int = 64  # embedding and completion requests served at once (then 429)
    # generation sessions admitted per batch slot of a model's providers, across all gateways
    # (then 429: `broker.leases`); above 1, sessions queue on providers and slow each other
    sessions_per_slot: float = 1.0
    max_work_tokens: int = 2_000_000  # tokens of interactive work at once (then 429)
    max_reading_bytes: int = 256 * 1024**2  # bytes of JSON bodies read at once (then 429)
    rebalance_every_s: float = 600.0  # how often idle models are checked for a better placement
    metrics_every_s: float = 5.0  # the dashboard's charts: a sample this often, an hour kept
    trace: Path | None = None  # record the decision core's inputs and actions here (JSON lines)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_s * self.missed_heartbeats

    @property
    def db_path(self) -> Path:
        return self.db if self.db is not None else self.data_dir / "broker.db"

    @property
    def grace_s(self) -> float:
        if self.restart_grace_s is not None:
            return self.restart_grace_s
        return self.heartbeat_timeout_s + self.heartbeat_s

    @property
    def core(self) -> CoreConfig:
        """The decision core's settings, from this configuration."""
        return CoreConfig(
            pool=PoolConfig(
                heartbeat_interval=self.heartbeat_s, missed_heartbeats=self.missed_heartbeats
            ),
            placement=PlacementConfig(
                work=PLACEMENT_WORK,
                memory_fraction=1 / LOAD_OVERHEAD,
                max_replicas=self.replicas,
                strategy=self.placement,
            ),
            queue_policy=self.queue_policy,
            restart_grace_s=self.grace_s,
            rebalance_every_s=self.rebalance_every_s,
            observe_before_moving=0 if self.trust_claims else 1,
        )
