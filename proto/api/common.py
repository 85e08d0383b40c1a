"""Bodies every part of the API shares: the error shape, health, events and artifacts."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ErrorDetail(msgspec.Struct, frozen=True, omit_defaults=True):
    message: str
    field: Annotated[str | None, msgspec.Meta(description="the request field at fault")] = None


class Error(msgspec.Struct, frozen=True):
    """Every failure's body, whatever the status."""

    error: ErrorDetail


class BrokerInfo(msgspec.Struct, frozen=True):
    peer_id: str
    addrs: list[str]


class Health(msgspec.Struct, frozen=True):
    ok: bool
    peer_id: str
    addrs: list[str]
    providers: int  # not dead
    models: int


Event = Annotated[
    dict[str, Any],
    msgspec.Meta(
        title="Event",
        description="One entry of the event log: `id`, `at` (Unix time), `kind`, `job` and "
        "`peer` when it concerns one, and the fields of its kind",
        extra_json_schema={"required": ["id", "at", "kind"]},
    ),
]


class EventList(msgspec.Struct, frozen=True):
    events: list[Event]


class Stored(msgspec.Struct, frozen=True):
    """An uploaded artifact, kept under its SHA-256."""

    sha256: str
    size: int


class EventsQuery(msgspec.Struct, frozen=True):
    since: Annotated[int, msgspec.Meta(ge=0, le=2**62, description="events with a larger id")] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000, description="at most this many")] = 1000


class StreamQuery(msgspec.Struct, frozen=True):
    interval_ms: Annotated[
        int, msgspec.Meta(ge=100, le=60_000, description="least time between snapshots")
    ] = 500


class ArtifactQuery(msgspec.Struct, frozen=True):
    token: (
        Annotated[
            str,
            msgspec.Meta(
                max_length=256,
                description="the download token of an assignment's link (providers use it "
                "instead of an API key): good for one artifact, one provider, a limited time",
            ),
        ]
        | None
    ) = None
    peer: (
        Annotated[
            str,
            msgspec.Meta(max_length=128, description="the provider the link was made for"),
        ]
        | None
    ) = None
