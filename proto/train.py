"""`/fusionai/train/1`: fine-tuning a stage a provider serves (broker -> provider).

The broker opens a training run on a stage (the adapters to start from and the optimizer's
settings), then for each step sends every microbatch forward and, once the loss is known,
its gradient backward; `TrainUpdate` makes the provider take one optimizer step on its own
adapters once every microbatch's gradient is in. `TrainExport` reads the adapters back;
`TrainClose` ends the run. Only the provider's broker may send these.
"""

from __future__ import annotations

from p2p.codec import Message, ProtocolSpec
from p2p.tensor import Tensor
from proto.forward import MAX_ACTIVATION_BYTES


class TrainOpen(Message, frozen=True, tag="TrainOpen/1"):
    job: str
    stage: str  # stage key
    method: str  # "lora-fa" (A frozen, B trained) or "lora" (both trained)
    lr: float
    microbatches: int  # microbatches per optimizer step (gradient accumulation)
    adapters: dict[str, Tensor]  # every adapter input of the stage (A and B), float32
    weight_decay: float = 0.0


class TrainForward(Message, frozen=True, tag="TrainForward/1"):
    job: str
    stage: str
    step: int  # the optimizer step this microbatch belongs to (1-based)
    microbatch: int
    inputs: dict[str, Tensor]  # hidden_states and, for decoders, position_ids


class TrainBackward(Message, frozen=True, tag="TrainBackward/1"):
    job: str
    stage: str
    step: int
    microbatch: int
    grad: Tensor  # d loss / d (this stage's output)
    input_grad: bool = True  # answer with d loss / d (this stage's input)


class TrainUpdate(Message, frozen=True, tag="TrainUpdate/1"):
    job: str
    stage: str
    step: int
    keep: bool = False  # keep a copy of the state after this step for a snapshot
    committed: int = 0  # the newest snapshot every stage completed: older copies may go


class TrainExport(Message, frozen=True, tag="TrainExport/1"):
    job: str
    stage: str


class TrainClose(Message, frozen=True, tag="TrainClose/1"):
    job: str


class TrainReady(Message, frozen=True, tag="TrainReady/1"):
    job: str
    step: int  # optimizer steps taken
    trainable_parameters: int


class TrainOutput(Message, frozen=True, tag="TrainOutput/1"):
    output: Tensor | None  # forward: hidden_states_out; backward: the input gradient, if asked
    compute_ms: float = 0.0


class TrainUpdated(Message, frozen=True, tag="TrainUpdated/1"):
    step: int
    grad_norm: float


class TrainState(Message, frozen=True, tag="TrainState/1"):
    step: int
    adapters: dict[str, Tensor]


class TrainClosed(Message, frozen=True, tag="TrainClosed/1"):
    job: str


TRAIN = ProtocolSpec(
    "/fusionai/train/1",
    request=(TrainOpen, TrainForward, TrainBackward, TrainUpdate, TrainExport, TrainClose),
    response=(TrainReady, TrainOutput, TrainUpdated, TrainState, TrainClosed),
    max_message_bytes=MAX_ACTIVATION_BYTES,
)
