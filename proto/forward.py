"""`/fusionai/forward/1`: run a batch of activations through a stage a provider serves."""

from __future__ import annotations

from p2p.codec import Message, ProtocolSpec
from p2p.tensor import Tensor

MAX_ACTIVATION_BYTES = 256 * 1024 * 1024


class Forward(Message, frozen=True, tag="Forward/1"):
    stage: str  # stage key
    inputs: dict[str, Tensor]  # graph input name -> tensor
    training: bool = False  # training work yields to inference when the queue is full
    check: bool = False  # a spot check of another provider's answer: a standby stage answers it


class ForwardResult(Message, frozen=True, tag="ForwardResult/1"):
    outputs: dict[str, Tensor]
    compute_ms: float = 0.0  # time spent running the stage


FORWARD = ProtocolSpec(
    "/fusionai/forward/1",
    request=Forward,
    response=ForwardResult,
    max_message_bytes=MAX_ACTIVATION_BYTES,
)
