"""Providers, models and their routes, and what a client's generation session asks of the
broker (a provider for a stage; a report on one that failed or disagreed)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proto.api.common import BrokerInfo, PeerId
from proto.session import Commitment

Pool = Literal["active", "backup", "draining", "dead"]


class Reputation(msgspec.Struct, frozen=True):
    """Spot checks of a provider's answers: how many were checked, agreed and disagreed, and
    whether it is quarantined (and why)."""

    checks: int = 0
    agreed: int = 0
    disagreed: int = 0
    quarantined: bool = False
    quarantined_at: Annotated[float | None, msgspec.Meta(description="Unix time")] = None
    reason: str = ""


class Quarantined(msgspec.Struct, frozen=True):
    peer_id: str
    checks: int
    agreed: int
    disagreed: int
    quarantined: bool
    quarantined_at: float | None
    reason: str


class Provider(msgspec.Struct, frozen=True):
    peer_id: str
    pool: Pool
    stage: str | None  # the stage key it serves or stands by for
    hardware: str
    executor: str | None
    flops: dict[str, float]  # dense matmul FLOP/s per dtype
    memory_bytes: int
    net_up_bytes_s: float
    rtt_s: float
    correction: float  # measured / predicted speed
    last_seen_s: float
    queued: int
    kv_bytes: int
    loaded: list[str]
    addrs: list[str]
    flapping: bool
    reputation: Reputation
    # can it be dialled: "direct", "mapped" (through its router), "unreachable", "checking"
    reach: str = "unknown"
    observed: str | None = None  # the address the broker sees it connect from
    # float32 FLOP/s its hardware check at join showed (`flops` are capped at a factor of it);
    # None: not checked (the broker believes claims)
    checked_flops: float | None = None


class ProviderList(msgspec.Struct, frozen=True):
    providers: list[Provider]
    quarantined: list[Quarantined]


class Peer(msgspec.Struct, frozen=True):
    peer_id: str
    addrs: list[str]


class StageRoute(msgspec.Struct, frozen=True):
    key: str  # MODEL/INDEX: what sessions and providers call the stage
    index: int  # in the manifest
    name: str
    providers: list[Peer]  # serving it now
    backups: list[str]  # peer ids standing by
    layers: list[int] = []  # [first, last + 1] of the model's blocks it holds ([]: none)
    size_bytes: int = 0  # its weights' file


class Model(msgspec.Struct, frozen=True):
    """A model, its stages and who serves each."""

    model: str
    placed: bool
    ready: bool  # every stage has a provider
    waiting: str | None  # why it is not placed yet
    throughput_tokens_s: float
    stages: list[StageRoute]


class ModelCard(msgspec.Struct, frozen=True):
    """A model as OpenAI lists them, with whether the swarm serves it."""

    id: str
    created: int  # Unix time it was added
    ready: bool
    placed: bool
    stages: int  # provider stages
    throughput_tokens_s: float
    object: Literal["model"] = "model"
    owned_by: str = "fusionai"


class ModelList(msgspec.Struct, frozen=True):
    """`GET /v1/models`: OpenAI's list shape; the detail is on `/v1/models/{name}`."""

    data: list[ModelCard]
    models: Annotated[
        list[Model],
        msgspec.Meta(
            description="deprecated: the previous answer's detail, kept for SDKs of "
            "the previous release for one release; read `data`, or `/v1/models/{name}`"
        ),
    ] = []
    object: Literal["list"] = "list"


class Swarm(msgspec.Struct, frozen=True):
    broker: BrokerInfo
    heartbeat_timeout_s: float
    providers: list[Provider]
    models: list[Model]


class PickRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    stage: Annotated[
        int, msgspec.Meta(ge=0, le=10_000, description="provider stage position, in order")
    ]
    avoid: Annotated[
        list[PeerId],
        msgspec.Meta(max_length=1024, description="peer ids this session found failing"),
    ] = []
    timeout: (
        Annotated[
            float,
            msgspec.Meta(
                ge=0,
                lt=1e9,
                description="seconds to wait for a provider (cut to the broker's request timeout)",
            ),
        ]
        | None
    ) = None
    check: Annotated[
        bool,
        msgspec.Meta(
            description="a provider to check another's answers: any live holder of the stage "
            "not in avoid; 503 at once when there is none"
        ),
    ] = False


class Picked(msgspec.Struct, frozen=True):
    key: str  # the stage key sessions name
    peer_id: str
    addrs: list[str]
    reach: str = ""  # how the broker reached it back: "direct", "mapped", "relayed"; "" unknown


class ReportRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]
    wrong_output: (
        Annotated[
            str,
            msgspec.Meta(max_length=300, description="the stage key (MODEL/INDEX) that disagreed"),
        ]
        | None
    ) = None


class Report(msgspec.Struct, frozen=True):
    peer_id: str
    alive: bool
    probe_agreed: Annotated[
        bool | None,
        msgspec.Meta(
            description="with wrong_output: whether its answer to the broker's probe "
            "agreed (null: it could not be asked)"
        ),
    ] = None
    quarantined: bool = False


class CommittedSession(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One provider session of a generation: who served it, and the commitments it signed."""

    peer: PeerId
    commitments: Annotated[list[Commitment], msgspec.Meta(min_length=1, max_length=1024)]


class VerifyRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A generation to check: the tokens it fed (the prompt, then every generated token but
    the last) and its providers' signed commitments, per provider session."""

    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]
    sessions: Annotated[list[CommittedSession], msgspec.Meta(min_length=1, max_length=64)]


class SessionVerdict(msgspec.Struct, frozen=True):
    peer_id: str
    stage: str
    session: str
    chunks: int  # commitments compared
    ok: Annotated[
        bool | None,
        msgspec.Meta(description="null: not judged, an earlier stage of the route failed"),
    ]
    mismatches: int  # values of the worst chunk whose sign or exponent differ
    mantissa_mean: float | None  # mean 7-bit mantissa difference of the rest
    reason: str = ""


class Verdict(msgspec.Struct, frozen=True):
    """Whether the broker's own run of the model over the tokens reproduces every session's
    commitments; a provider whose commitments it does not reproduce is quarantined."""

    model: str
    ok: bool
    sessions: list[SessionVerdict]
    quarantined: list[str]  # providers quarantined for this generation


class ModelSample(msgspec.Struct, frozen=True):
    """A model in one sample of the charts."""

    tokens_s: float  # tokens generated per second (providers' reports: SDK sessions too)
    requests_s: float  # generation sessions and forward requests per second at its first stage
    queued: int  # jobs waiting for it


class ProviderSample(msgspec.Struct, frozen=True):
    pool: str
    util: float  # seconds its executor ran per second (over 1 with several compute slots)
    stage_ms: float | None  # mean time of a stage run (None: no runs lately)
    tokens_s: float  # token positions it computed per second, every stage
    queued: int  # requests waiting or running


class GatewaySample(msgspec.Struct, frozen=True):
    tokens_s: float
    requests_s: float


class Sample(msgspec.Struct, frozen=True):
    """The swarm at one moment (rates over the last `History.window_s` seconds; counts of
    events since the sample before)."""

    seq: int  # samples taken by this broker before this one (the stream's cursor)
    at: Annotated[float, msgspec.Meta(description="Unix time")]
    tokens_s: float  # the whole network: the models' tokens/s added up
    models: dict[str, ModelSample]
    providers: dict[str, ProviderSample]
    gateways: dict[str, GatewaySample]
    failovers: dict[str, int]  # provider_lost, microbatch_retry, session_failover
    # verification: answers a second run agreed with, generations whose commitments a rerun
    # did not reproduce (disagreed), providers quarantined
    checks: dict[str, int]


class History(msgspec.Struct, frozen=True):
    every_s: float  # a sample this often
    window_s: float  # rates are over about this long
    samples: list[Sample]  # oldest first, an hour at most


class HistoryQuery(msgspec.Struct, frozen=True):
    since: Annotated[
        float, msgspec.Meta(ge=0, le=1e11, description="samples taken after this Unix time")
    ] = 0.0
    after: Annotated[
        int, msgspec.Meta(ge=-1, le=2**62, description="samples after this one (its seq)")
    ] = -1
