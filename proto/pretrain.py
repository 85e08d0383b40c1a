"""Pre-training across providers: data-parallel replicas (`ir.pretrain`) and their ring.

`/fusionai/pretrain/1` (broker -> provider): `PretrainOpen` makes the provider fetch the
package's stage files (as stage assignments do: by SHA-256, from the broker's artifact links)
and build a replica with every weight trainable, or take the state of a replica already
running from its holder (`donor`, a provider, not the broker); opening a run that is open
already answers where it stands, so a broker that restarted finds its replicas again. Each
step is two-phase: `PretrainStep` gives a replica its rows of the step's global batch and the
ring of replicas; it computes its gradient, all-reduces it with the others peer to peer and
holds the update; `PretrainCommit` applies it, `PretrainAbort` drops it (a replica was lost:
the step is redone without it, and nothing is counted twice). `PretrainEval` scores held-out
rows; `PretrainFetch` reads the state in parts (the broker, for the trained weights; a joining
peer the broker admitted with `PretrainAdmit`, for everything); `PretrainClose` ends the run.

`/fusionai/ring/1` (provider -> provider): `RingChunk`, one chunk of a ring all-reduce
(`dag.collective`) from the previous replica in the ring; accepted only from the job's
replicas.
"""

from __future__ import annotations

from p2p.codec import Message, ProtocolSpec
from p2p.tensor import Tensor
from proto.forward import MAX_ACTIVATION_BYTES
from proto.snapshot import Holder

MAX_PART_BYTES = 32 * 1024 * 1024  # one part of a state being read
MAX_REPLICAS = 64


class StageFile(Message, frozen=True, tag="StageFile/1"):
    index: int
    sha256: str
    size: int
    url: str  # where to GET it (range requests supported)


class PretrainSettings(Message, frozen=True, tag="PretrainSettings/1"):
    lr: float
    warmup: int
    total_steps: int
    weight_decay: float
    compress: str  # "none", "fp16", "powersgd" or "acp"
    rank: int
    outer_every: int  # DiLoCo's H (0: synchronous)
    start_after: int  # steps all-reduced uncompressed first
    seed: int


class PretrainOpen(Message, frozen=True, tag="PretrainOpen/1"):
    job: str
    manifest: bytes  # the package's manifest.json
    files: list[StageFile]
    settings: PretrainSettings
    tls_sha256: str = ""  # the broker's certificate to pin, when the links are https
    donor: Holder | None = None  # take the running state from this replica


class PretrainStep(Message, frozen=True, tag="PretrainStep/1"):
    job: str
    step: int  # 1-based: the replica must be at step - 1
    attempt: int  # a redone step's attempts differ (they name the ring's rounds)
    rows: Tensor  # int64 (rows, sequence + 1): this replica's share of the global batch
    total_rows: int  # the global batch's rows
    ring: list[Holder]  # the replicas, in ring order
    rank: int  # this replica's place in `ring`


class PretrainCommit(Message, frozen=True, tag="PretrainCommit/1"):
    job: str
    step: int


class PretrainAbort(Message, frozen=True, tag="PretrainAbort/1"):
    job: str
    step: int


class PretrainEval(Message, frozen=True, tag="PretrainEval/1"):
    job: str
    rows: Tensor  # int64 (rows, sequence + 1)


class PretrainAdmit(Message, frozen=True, tag="PretrainAdmit/1"):
    job: str
    peer: str  # may read this run's state (`PretrainFetch`)


class PretrainFetch(Message, frozen=True, tag="PretrainFetch/1"):
    job: str
    part: int
    weights_only: bool = False


class PretrainClose(Message, frozen=True, tag="PretrainClose/1"):
    job: str


class PretrainReady(Message, frozen=True, tag="PretrainReady/1"):
    job: str
    step: int  # steps committed
    prepared: int = 0  # the step prepared and not yet committed (0: none)
    parameters: int = 0


class PretrainStepped(Message, frozen=True, tag="PretrainStepped/1"):
    step: int
    loss: float  # this replica's share of the global batch's mean token loss
    bytes_sent: int  # to the next replica in this step's all-reduces
    compute_ms: float  # the step but its all-reduces
    reduce_ms: float  # in the all-reduces (waiting for the others included)


class PretrainLoss(Message, frozen=True, tag="PretrainLoss/1"):
    loss: float  # mean token loss


class PretrainPart(Message, frozen=True, tag="PretrainPart/1"):
    step: int
    part: int
    parts: int
    tensors: dict[str, Tensor]


class PretrainClosed(Message, frozen=True, tag="PretrainClosed/1"):
    job: str


class RingChunk(Message, frozen=True, tag="RingChunk/1"):
    job: str
    round: int
    phase: int  # 0 reduce-scatter, 1 all-gather
    chunk: int
    data: Tensor


class RingAck(Message, frozen=True, tag="RingAck/1"):
    pass


PRETRAIN = ProtocolSpec(
    "/fusionai/pretrain/1",
    request=(
        PretrainOpen,
        PretrainStep,
        PretrainCommit,
        PretrainAbort,
        PretrainEval,
        PretrainAdmit,
        PretrainFetch,
        PretrainClose,
    ),
    response=(PretrainReady, PretrainStepped, PretrainLoss, PretrainPart, PretrainClosed),
    max_message_bytes=MAX_ACTIVATION_BYTES,
)
RING = ProtocolSpec(
    "/fusionai/ring/1", request=RingChunk, response=RingAck, max_message_bytes=MAX_ACTIVATION_BYTES
)
