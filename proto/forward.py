"""`/fusionai/forward/1`: run a batch of activations through a stage a provider serves.

A plain `Forward` is answered with the stage's outputs. A chained one carries a route the
broker signed (`route`, `hop`, `chain`, `expires`, `signature`): each provider runs its hop
(and any next hops it also serves), passes the hidden states straight on to the next hop's
provider, and the last pushes the outputs to the broker over `/fusionai/chain/1`. The
answers that come back along the route say who computed what (`ForwardResult.hops`), or which
hop broke the chain (`ChainBroken`). Activations thus cross the network once per stage
instead of twice (there and back to the broker).
"""

from __future__ import annotations

import msgspec

from p2p.codec import Message, ProtocolSpec
from p2p.tensor import Tensor

MAX_ACTIVATION_BYTES = 256 * 1024 * 1024
MAX_HOPS = 64
BATCH_CHUNK = 128  # tokens of a sequence per commitment of a batch microbatch's hop
ROUTE_DOMAIN = "fusionai-route/1"  # signature domain of a chain's route
# `ChainBroken.code` besides the ErrorCode values: the next hop did not answer in time, could
# not be reached, or answered something else than the protocol's messages
TIMEOUT, UNREACHABLE, BAD_ANSWER = "timeout", "unreachable", "bad_answer"


class Hop(msgspec.Struct, frozen=True, array_like=True):
    peer: str  # the provider that runs this hop
    stage: str  # stage key
    addrs: list[str] = msgspec.field(default_factory=list)  # where to dial it


class HopCommitment(msgspec.Struct, frozen=True, array_like=True):
    """A chained hop's signed account of its work (batch microbatches): the SHA-256 of the
    hidden states it was given and of those it sent on (float32, as the receiver holds them),
    and TOPLOC commitments (`ir.toploc.commit`) of the latter, one per `BATCH_CHUNK` tokens of
    each sequence, row after row. The broker checks a sampled share by recomputing the route
    from its start (`broker/chaincheck.py`); the hashes link each hop to the one before."""

    input_sha256: bytes
    output_sha256: bytes
    chunks: list[bytes]
    signature: bytes  # the provider's, domain COMMITMENT_DOMAIN, over `hop_commitment_bytes`


class HopDone(msgspec.Struct, frozen=True, array_like=True):
    peer: str
    stage: str
    compute_ms: float
    committed: HopCommitment | None = None  # (None: a provider that commits to nothing)


class Forward(Message, frozen=True, tag="Forward/1"):
    stage: str  # stage key
    inputs: dict[str, Tensor]  # graph input name -> tensor
    training: bool = False  # training work yields to inference when the queue is full
    check: bool = False  # a spot check of another provider's answer: a standby stage answers it
    # A chained request (empty route: a plain one, answered with the outputs):
    chain: str = ""  # the chain's id, unique per request
    route: list[Hop] = msgspec.field(
        default_factory=list
    )  # every hop, in order; this request is for route[hop]
    hop: int = 0
    expires: float = 0.0  # unix time after which the route is void
    signature: bytes = b""  # the broker's, over `route_bytes(chain, route, expires)`


class ForwardResult(Message, frozen=True, tag="ForwardResult/1"):
    outputs: dict[str, Tensor]  # a chained request's: empty (they went to the broker)
    compute_ms: float = 0.0  # time spent running the stage
    hops: list[HopDone] = msgspec.field(
        default_factory=list
    )  # a chained request's: this hop and every one after it


class ChainBroken(Message, frozen=True, tag="ChainBroken/1"):
    """A chained request failed at `peer` (the hop that refused, failed or was unreachable)."""

    peer: str
    stage: str
    code: str  # an ErrorCode value, TIMEOUT, UNREACHABLE or BAD_ANSWER
    reason: str


class ChainResult(Message, frozen=True, tag="ChainResult/1"):
    """The last hop's outputs, pushed to the broker."""

    chain: str
    outputs: dict[str, Tensor]


class ChainAccepted(Message, frozen=True, tag="ChainAccepted/1"):
    chain: str


def hop_commitment_bytes(chain: str, hop: int, peer: str, stage: str, c: HopCommitment) -> bytes:
    """What a hop's provider signs: the chain, its place and stage on it, and its account."""
    fields = [c.input_sha256, c.output_sha256, c.chunks]
    return msgspec.msgpack.encode(["hop-commitment", chain, hop, peer, stage, *fields])


def route_bytes(chain: str, route: list[Hop], expires: float) -> bytes:
    """What the broker signs: the chain id, each hop's provider and stage, the expiry."""
    hops = [[h.peer, h.stage] for h in route]
    return msgspec.msgpack.encode(["route", chain, hops, expires])


FORWARD = ProtocolSpec(
    "/fusionai/forward/1",
    request=Forward,
    response=(ForwardResult, ChainBroken),
    max_message_bytes=MAX_ACTIVATION_BYTES,
)

CHAIN = ProtocolSpec(
    "/fusionai/chain/1",
    request=ChainResult,
    response=ChainAccepted,
    max_message_bytes=MAX_ACTIVATION_BYTES,
)
