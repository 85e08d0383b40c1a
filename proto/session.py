"""`/fusionai/session/1`: generation sessions with a KV cache kept on the provider.

Open a session on a decoder stage, then send steps (new hidden states and their positions);
the provider feeds the session's cached keys and values with each step and keeps the new
ones. A client running many sessions sends their steps to one provider in one `SessionSteps`
(answered by one `SessionOutputs`, a result or a failure per step). Sessions belong to the
peer that opened them, expire after an idle timeout, and the provider bounds the total cache
memory (a step that would exceed it is refused as busy).
"""

from __future__ import annotations

import msgspec

from p2p.codec import Message, ProtocolSpec
from p2p.tensor import Tensor
from proto.forward import MAX_ACTIVATION_BYTES

MAX_STEPS = 256  # steps in one SessionSteps


class SessionOpen(Message, frozen=True, tag="SessionOpen/1"):
    session: str  # chosen by the client, unique per client and stage
    stage: str  # stage key
    batch: int = 1
    # a LoRA adapter (the stage's adapter inputs, A and B) applied to every step
    adapters: dict[str, Tensor] = msgspec.field(default_factory=dict)
    check: bool = False  # a shadow session checking another provider: a standby stage serves it


class SessionStep(Message, frozen=True, tag="SessionStep/1"):
    session: str
    stage: str
    inputs: dict[str, Tensor]  # the stage's inputs other than its past_* cache inputs


class SessionSteps(Message, frozen=True, tag="SessionSteps/1"):
    """Steps of several of the sender's sessions in one message (each its own session and
    stage): the provider runs them together where it can and answers each on its own."""

    steps: list[SessionStep]  # 1 to MAX_STEPS, no (stage, session) twice


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


class SessionClosed(Message, frozen=True, tag="SessionClosed/1"):
    session: str


class SessionFailed(Message, frozen=True, tag="SessionFailed/1"):
    """One step of a `SessionSteps` that failed: what a single step would have raised."""

    session: str
    code: str  # an `ErrorCode` value: busy, refused, not_found, ...
    message: str


class SessionOutputs(Message, frozen=True, tag="SessionOutputs/1"):
    outputs: list[SessionOutput | SessionFailed]  # one per step, in the steps' order


SESSION = ProtocolSpec(
    "/fusionai/session/1",
    request=(SessionOpen, SessionStep, SessionSteps, SessionClose),
    response=(SessionOpened, SessionOutput, SessionOutputs, SessionClosed),
    max_message_bytes=MAX_ACTIVATION_BYTES,
)
