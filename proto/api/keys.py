"""Managed API keys (`/v1/keys`, admin) and what a gateway asks of the broker
(`/v1/gateway/...`, a gateway's or an admin key): a key's decision, a lease on one stream of
work for a user's key, the lease's release, and the gateway's periodic report (its leases
still held and its traffic)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proto.api.common import ModelName

Role = Literal["user", "admin", "gateway"]
KeyId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
LeaseId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
GatewayName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\w.:-]+$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 53)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e12)]


class KeyRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128, description="who holds it")]
    role: Role = "user"
    max_streams: (
        Annotated[int, msgspec.Meta(ge=1, le=1_000_000, description="requests at once")] | None
    ) = None  # none: no cap
    per_minute: (
        Annotated[int, msgspec.Meta(ge=1, le=1_000_000, description="requests started per minute")]
        | None
    ) = None  # none: no cap


class KeyInfo(msgspec.Struct, frozen=True):
    id: str
    name: str
    role: Role
    max_streams: int | None
    per_minute: int | None
    created: Annotated[float, msgspec.Meta(description="Unix time")]
    revoked: Annotated[float | None, msgspec.Meta(description="Unix time; none: in use")] = None


class KeyCreated(msgspec.Struct, frozen=True):
    """A new key: `key` is shown this once (the broker keeps its SHA-256 alone)."""

    key: str
    info: KeyInfo


class KeyList(msgspec.Struct, frozen=True):
    data: list[KeyInfo]


class Decision(msgspec.Struct, frozen=True):
    """What a key may do: `valid` false for an unknown or revoked key. A gateway keeps a
    decision at most `ttl_s` seconds."""

    valid: bool
    ttl_s: float
    role: Role | None = None
    id: str | None = None


class KeyQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: Annotated[str, msgspec.Meta(max_length=512)] | None  # none: may one go without?


class AdmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A lease on one request of work (a completion, a chat, embeddings) for a user's key
    (none: an open API), held by `gateway` until released or until its reports stop."""

    gateway: GatewayName
    model: ModelName
    key: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    session: bool = True  # a generation session (takes a batch slot), or embeddings


class Admitted(msgspec.Struct, frozen=True):
    lease: str
    ttl_s: Annotated[float, msgspec.Meta(description="the lease lapses unless reported by then")]


class Release(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gateway: GatewayName
    lease: LeaseId


class Released(msgspec.Struct, frozen=True):
    released: bool


class ModelTraffic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A gateway's totals for one model since it started (counters: they only grow)."""

    tokens: Count = 0  # tokens generated
    requests: Count = 0  # requests answered (any status)
    seconds: Seconds = 0.0  # their summed latency
    failovers: Count = 0  # providers replaced mid-session


class GatewayReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gateway: GatewayName
    leases: Annotated[list[LeaseId], msgspec.Meta(max_length=100_000)] = []
    models: Annotated[dict[ModelName, ModelTraffic], msgspec.Meta(max_length=10_000)] = {}
    refused: Count = 0  # requests it answered 429 (or 401) on its own


class ReportAck(msgspec.Struct, frozen=True):
    lost: list[str]  # of the leases reported, those the broker no longer holds
    report_every_s: float
