"""`/fusionai/session/1`: generation sessions with a KV cache kept on the provider.

Open a session on a decoder stage, then send steps (new hidden states and their positions);
the provider feeds the session's cached keys and values with each step and keeps the new
ones. A client running many sessions sends their steps to one provider in one `SessionSteps`
(answered by one `SessionOutputs`, a result or a failure per step). Sessions belong to the
peer that opened them, expire after an idle timeout, and the provider bounds the total cache
memory (a step that would exceed it is refused as busy).

A step that names `past` (the tokens cached before it) may be sent again: a provider that ran
it already answers it again from what it kept. A provider keeps each session's outputs so far,
which `SessionHistory` asks for (what a replacement of the next stage is replayed with).

`/fusionai/session-chain/1` carries a step along a route the client signed: each provider runs
its hop on the client's session and sends the hidden states straight on to the next hop; the
last pushes the outputs to the client over `/fusionai/session-result/1`. A token then crosses
the network n + 1 times for n stages instead of 2n. Answers come back along the route as on
`/fusionai/forward/1` (`ForwardResult.hops`, or `ChainBroken` naming the hop that broke).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import msgspec

from p2p.codec import Message, ProtocolSpec
from p2p.tensor import Tensor
from proto.forward import MAX_ACTIVATION_BYTES, ChainAccepted, ChainBroken, ForwardResult

MAX_STEPS = 256  # steps in one SessionSteps
STEP_ROUTE_DOMAIN = "fusionai-session-route/1"  # signature domain of a chained step's route
ROUTE_KEY_BYTES = 32  # a client's key for a provider's chained-step tags (`route_tag`)
COMMITMENT_DOMAIN = "fusionai-commitment/1"  # signature domain of a provider's commitment


class Commitment(msgspec.Struct, frozen=True, array_like=True):
    """A provider's signed commitment to one chunk of a session on one stage: the top values
    of the hidden states it answered for `tokens` consecutive tokens (`ir.toploc`: 258 bytes
    for 32 tokens), the same of the hidden states it was given for them (equal to the
    previous stage's output commitment when it got what that one sent), their SHA-256 (as
    float32, batch row 0), and its signature over all of it (`commitment_bytes`)."""

    session: str
    stage: str
    chunk: int  # its place in the session: tokens chunk x CHUNK onwards
    tokens: int  # tokens it covers: ir.toploc.CHUNK, fewer for a session's last
    input_sha256: bytes
    input_data: bytes  # ir.toploc.commit of the inputs
    data: bytes  # ir.toploc.commit of the outputs
    signature: bytes  # the provider's, domain COMMITMENT_DOMAIN


def commitment_bytes(c: Commitment) -> bytes:
    """What a provider signs for a `Commitment` (its fields but the signature)."""
    fields = msgspec.structs.astuple(c)[:-1]
    return msgspec.msgpack.encode(["commitment", *fields])


class SessionOpen(Message, frozen=True, tag="SessionOpen/1"):
    session: str  # chosen by the client, unique per client and stage
    stage: str  # stage key
    batch: int = 1
    # a LoRA adapter (the stage's adapter inputs, A and B) applied to every step
    adapters: dict[str, Tensor] = msgspec.field(default_factory=dict)
    check: bool = False  # a shadow session checking another provider: a standby stage serves it
    # the client's key for this provider (ROUTE_KEY_BYTES, or none): a chained step along
    # the session carries a tag made with it (`route_tag`), which the provider checks
    # instead of the route's signature (an HMAC, not an Ed25519 verification a hop)
    route_key: bytes = b""

    def __post_init__(self) -> None:
        if len(self.route_key) not in (0, ROUTE_KEY_BYTES):
            raise ValueError(f"a route key has {ROUTE_KEY_BYTES} bytes")


class SessionStep(Message, frozen=True, tag="SessionStep/1"):
    session: str
    stage: str
    inputs: dict[str, Tensor]  # the stage's inputs other than its past_* cache inputs
    past: int = -1  # tokens cached before this step (-1: unsaid; the step cannot be repeated)


class SessionSteps(Message, frozen=True, tag="SessionSteps/1"):
    """Steps of several of the sender's sessions in one message (each its own session and
    stage): the provider runs them together where it can and answers each on its own."""

    steps: list[SessionStep]  # 1 to MAX_STEPS, no (stage, session) twice


class SessionHistory(Message, frozen=True, tag="SessionHistory/1"):
    """The session's outputs for every token so far, as one `SessionOutput`."""

    session: str
    stage: str


class StepHop(msgspec.Struct, frozen=True, array_like=True):
    peer: str  # the provider that runs this hop
    stage: str  # stage key
    session: str  # the client's session on it
    addrs: list[str] = msgspec.field(default_factory=list)  # where to dial it (`hop_addrs`)


def hop_addrs(peer: str, addrs: Sequence[str]) -> list[str]:
    """`peer`'s announced addresses as a chained step's route carries them, every token
    over home links: without the `/p2p/<peer>` each ends in (the hop names its peer), and
    without loopback ones when it has others (the dialler reaches itself there, unless both
    share a machine, where the others reach it too). `dial_addrs` undoes the first."""
    suffix = f"/p2p/{peer}"
    out = [a[: -len(suffix)] if a.endswith(suffix) else a for a in addrs]
    wide = [a for a in out if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    return wide or out


def dial_addrs(peer: str, addrs: Sequence[str]) -> list[str]:
    """A route's addresses of `peer` (`hop_addrs`) as multiaddrs to dial it by."""
    suffix = f"/p2p/{peer}"
    return [a if a.endswith(suffix) else a + suffix for a in addrs]


class ChainStep(Message, frozen=True, tag="ChainStep/1"):
    """A step of `origin`'s sessions along `route`; this request is for `route[hop]`."""

    chain: str  # the step's id, unique per request
    origin: str  # the client: the sessions' owner, who signed the route and gets the outputs
    route: list[StepHop]
    hop: int
    past: int  # tokens cached before this step, on every hop
    inputs: dict[str, Tensor]  # this hop's hidden states, and the inputs the hops share
    expires: float  # unix time after which the route is void
    signature: bytes  # origin's, over `step_route_bytes(...)`
    commitments: list[Commitment] = msgspec.field(default_factory=list)  # the hops' before
    # this one made at this step, passed on to the client
    tags: list[bytes] = msgspec.field(default_factory=list)  # one a hop, `route_tag` with
    # the key its sessions were opened with (or none: the hop checks the signature)


class ChainStepResult(Message, frozen=True, tag="ChainStepResult/1"):
    """The last hop's outputs, pushed to the client (answered `ChainAccepted`), with the
    commitments every hop made at this step."""

    chain: str
    outputs: dict[str, Tensor]
    past_len: int
    commitments: list[Commitment] = msgspec.field(default_factory=list)


class ChainRow(msgspec.Struct, frozen=True, array_like=True):
    """One session's part of a `ChainSteps`: its session on each hop of the route, the
    tokens cached before this step, and this hop's inputs for it."""

    sessions: list[str]
    past: int
    inputs: dict[str, Tensor]


class ChainSteps(Message, frozen=True, tag="ChainSteps/1"):
    """A step of several of `origin`'s sessions along one route of providers and stages, one
    message a hop (each hop runs the sessions' steps as one batch): `ChainStep` for many.
    The route's hops name no session (each row names its own); this request is for
    `route[hop]`."""

    chain: str
    origin: str
    route: list[StepHop]
    rows: list[ChainRow]
    hop: int
    expires: float
    signature: bytes  # origin's, over `steps_route_bytes(...)`
    commitments: list[Commitment] = msgspec.field(default_factory=list)
    tags: list[bytes] = msgspec.field(default_factory=list)  # as `ChainStep.tags`


class ChainRowResult(msgspec.Struct, frozen=True, array_like=True):
    """One session's outputs of a `ChainSteps` at its last hop."""

    outputs: dict[str, Tensor]
    past_len: int


class ChainStepsResult(Message, frozen=True, tag="ChainStepsResult/1"):
    """The last hop's outputs of a `ChainSteps`, a row each, pushed to the client."""

    chain: str
    rows: list[ChainRowResult]
    commitments: list[Commitment] = msgspec.field(default_factory=list)


def steps_route_bytes(
    chain: str, route: list[StepHop], rows: list[ChainRow], expires: float
) -> bytes:
    """What the client signs for a `ChainSteps`: as `step_route_bytes`, each row's sessions
    and tokens cached before the step instead of one session's."""
    hops = [[h.peer, h.stage] for h in route]
    sessions = [[r.sessions, r.past] for r in rows]
    return msgspec.msgpack.encode(["session-routes", chain, hops, sessions, expires])


def route_tag(key: bytes, signed: bytes) -> bytes:
    """A hop's tag of a chained step's route (`signed`, what the origin signs): an
    HMAC-SHA256 with the key the origin gave that hop's provider when it opened its sessions
    there (`SessionOpen.route_key`, sent over their authenticated, encrypted connection).
    Only the two of them hold the key, so the tag proves the origin asked for the step as
    its signature does (2 us to make or check here, where an Ed25519 verification takes
    about 100)."""
    return hmac.digest(key, STEP_ROUTE_DOMAIN.encode() + b"\0" + signed, "sha256")


def step_route_bytes(chain: str, route: list[StepHop], past: int, expires: float) -> bytes:
    """What the client signs: the step's id, each hop's provider, stage and session, the
    tokens cached before it, the expiry."""
    hops = [[h.peer, h.stage, h.session] for h in route]
    return msgspec.msgpack.encode(["session-route", chain, hops, past, expires])


class SessionClose(Message, frozen=True, tag="SessionClose/1"):
    session: str
    stage: str


class SessionOpened(Message, frozen=True, tag="SessionOpened/1"):
    session: str
    idle_timeout_s: float


class SessionOutput(Message, frozen=True, tag="SessionOutput/1"):
    session: str
    outputs: dict[str, Tensor]  # the stage's outputs other than its present_* cache outputs
    past_len: int  # tokens now cached
    commitments: list[Commitment] = msgspec.field(default_factory=list)  # chunks committed
    # since the session's last answer (a session of batch 1; worked out off the step's path)


class SessionClosed(Message, frozen=True, tag="SessionClosed/1"):
    session: str
    commitments: list[Commitment] = msgspec.field(default_factory=list)  # those not yet sent,
    # the last chunk's included


class SessionFailed(Message, frozen=True, tag="SessionFailed/1"):
    """One step of a `SessionSteps` that failed: what a single step would have raised."""

    session: str
    code: str  # an `ErrorCode` value: busy, refused, not_found, ...
    message: str


class SessionOutputs(Message, frozen=True, tag="SessionOutputs/1"):
    outputs: list[SessionOutput | SessionFailed]  # one per step, in the steps' order


SESSION = ProtocolSpec(
    "/fusionai/session/1",
    request=(SessionOpen, SessionStep, SessionSteps, SessionClose, SessionHistory),
    response=(SessionOpened, SessionOutput, SessionOutputs, SessionClosed),
    max_message_bytes=MAX_ACTIVATION_BYTES,
)

SESSION_CHAIN = ProtocolSpec(
    "/fusionai/session-chain/1",
    request=(ChainStep, ChainSteps),
    response=(ForwardResult, ChainBroken),
    max_message_bytes=MAX_ACTIVATION_BYTES,
)

SESSION_RESULT = ProtocolSpec(
    "/fusionai/session-result/1",
    request=(ChainStepResult, ChainStepsResult),
    response=ChainAccepted,
    max_message_bytes=MAX_ACTIVATION_BYTES,
)
