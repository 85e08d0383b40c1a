"""Stage assignment. Broker -> provider `/fusionai/assign/1`: load (or drop) a stage;
provider -> broker `/fusionai/stage-status/1`: the stage is ready, or failed and why.

An assignment names the stage by key and carries the model's manifest (IR JSON) so the
provider can validate the artifact it fetches by SHA-256 from `url` (HTTP, resumable).
A backup loads the stage and stands by without serving until it is promoted.
"""

from __future__ import annotations

from p2p.codec import Message, ProtocolSpec


class Assign(Message, frozen=True, tag="Assign/1"):
    key: str  # the stage's key on this broker, e.g. "minilm/1"
    manifest: bytes  # the model's manifest.json (IR format)
    stage: int  # index of the stage in the manifest
    url: str  # where to GET the artifact (range requests supported)
    role: str = "active"  # "active" (serve) or "backup" (load, stand by)
    tls_sha256: str = ""  # SHA-256 of the broker's certificate when `url` is https: pin it


class Unassign(Message, frozen=True, tag="Unassign/1"):
    key: str


class Promote(Message, frozen=True, tag="Promote/1"):
    """A backup starts serving the stage it stands by for."""

    key: str


class AssignAck(Message, frozen=True, tag="AssignAck/1"):
    accepted: bool
    reason: str = ""


class StageStatus(Message, frozen=True, tag="StageStatus/1"):
    key: str
    state: str  # "ready" or "failed"
    role: str = "active"
    load_s: float = 0.0  # seconds from assignment to ready (fetch, verify, load)
    reason: str = ""  # why it failed


class StatusAck(Message, frozen=True, tag="StatusAck/1"):
    pass


ASSIGN = ProtocolSpec(
    "/fusionai/assign/1",
    request=(Assign, Unassign, Promote),
    response=AssignAck,
    max_message_bytes=16 * 1024 * 1024,
)
STAGE_STATUS = ProtocolSpec("/fusionai/stage-status/1", request=StageStatus, response=StatusAck)
