"""Batch jobs: a submission per kind (`kind` picks one; "embed" when it is absent), a job's
state, and its results."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proto.api.common import Event, ModelName

MAX_SEQUENCES = 1_000_000  # the broker's own limit (`max_job_texts`) is usually lower
Text = Annotated[str, msgspec.Meta(max_length=1_000_000)]
TokenId = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=1_000_000)]
JobState = Literal["queued", "placed", "running", "succeeded", "failed", "cancelled"]


class EmbedJobRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Embed texts (or token ids) with an encoder, microbatch by microbatch."""

    model: ModelName
    kind: Literal["embed"] = "embed"
    texts: Annotated[list[Text], msgspec.Meta(max_length=MAX_SEQUENCES)] | None = None
    token_ids: Annotated[list[TokenIds], msgspec.Meta(max_length=MAX_SEQUENCES)] | None = None
    microbatch: (
        Annotated[
            int,
            msgspec.Meta(
                ge=1,
                le=1024,
                description="sequences per microbatch (the broker's default when absent)",
            ),
        ]
        | None
    ) = None


class FinetuneJobRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Fine-tune a decoder with LoRA-FA (or LoRA) through the swarm; each provider trains its
    stage's adapters, snapshotted erasure-coded into other providers' RAM."""

    kind: Literal["finetune"]
    model: Annotated[
        str,
        msgspec.Meta(
            min_length=1, max_length=128, description="a decoder exported with adapter slots"
        ),
    ]
    texts: Annotated[
        list[Text],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_SEQUENCES,
            description="training texts (each ends in end-of-sequence; packed into rows of "
            "seq_len + 1 tokens)",
        ),
    ]
    steps: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 20
    batch: Annotated[int, msgspec.Meta(ge=1, le=4096, description="sequences per step")] = 8
    microbatches: Annotated[int, msgspec.Meta(ge=1, le=4096, description="must divide batch")] = 2
    seq_len: Annotated[int, msgspec.Meta(ge=2, le=4096)] = 32
    method: Literal["lora-fa", "lora"] = "lora-fa"
    rank: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    lr: Annotated[float, msgspec.Meta(gt=0, lt=10)] = 1e-2
    weight_decay: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    snapshot_every: Annotated[
        int, msgspec.Meta(ge=0, le=100_000, description="steps between snapshots (0: none)")
    ] = 5
    shards: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, le=64)], Annotated[int, msgspec.Meta(ge=1, le=64)]],
        msgspec.Meta(
            description="[k, n]: n shards in other providers' RAM, any k rebuild a "
            "stage's state (k <= n)"
        ),
    ] = (2, 3)


class TrainJobRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Pre-train every weight of a decoder package with data-parallel replicas on providers,
    their gradients all-reduced peer to peer (compressed, or DiLoCo's outer steps)."""

    kind: Literal["train"]
    model: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=128,
            description="a decoder package exported trainable (`fusionai ir init`)",
        ),
    ]
    texts: Annotated[
        list[Text],
        msgspec.Meta(
            min_length=1,
            max_length=MAX_SEQUENCES,
            description="the corpus (tokenized with the package's tokenizer, each text ending "
            "in end-of-sequence, packed into rows of seq_len + 1 tokens; the last 5 % held "
            "out for validation)",
        ),
    ]
    steps: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 100
    replicas: Annotated[
        int, msgspec.Meta(ge=1, le=64, description="providers, each a whole replica")
    ] = 2
    batch: Annotated[
        int, msgspec.Meta(ge=1, le=4096, description="rows per global batch (whatever replicas)")
    ] = 12
    seq_len: Annotated[int, msgspec.Meta(ge=2, le=4096)] = 128
    lr: Annotated[float, msgspec.Meta(gt=0, lt=10)] = 3e-3
    warmup: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 10
    weight_decay: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.1
    compress: Literal["none", "fp16", "powersgd", "acp"] = "none"
    rank: Annotated[int, msgspec.Meta(ge=1, le=256, description="powersgd and acp")] = 4
    outer_every: Annotated[
        int, msgspec.Meta(ge=0, le=100_000, description="DiLoCo's H local steps (0: off)")
    ] = 0
    start_after: Annotated[
        int, msgspec.Meta(ge=0, le=1_000_000, description="uncompressed steps first")
    ] = 0
    eval_every: Annotated[
        int,
        msgspec.Meta(
            ge=0, le=1_000_000, description="steps between validations (0: 10 in the run)"
        ),
    ] = 0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    name: (
        Annotated[
            str,
            msgspec.Meta(
                pattern=r"^[A-Za-z0-9._-]{1,64}$",
                description="the trained model's name (default: <model>-<job>)",
            ),
        ]
        | None
    ) = None


JobRequest = EmbedJobRequest | FinetuneJobRequest | TrainJobRequest  # by `kind`


class Job(msgspec.Struct, frozen=True):
    """A batch job's state and progress."""

    id: str
    kind: str
    model: str
    state: JobState
    microbatches: int  # or optimizer steps
    done: int
    progress: float  # 0..1
    created: float  # Unix time
    updated: float
    error: str | None

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")


class JobList(msgspec.Struct, frozen=True):
    jobs: list[Job]


class Story(msgspec.Struct, frozen=True):
    """The events that tell what happened to a job."""

    job: Job
    events: list[Event]


class Deleted(msgspec.Struct, frozen=True):
    job: str
    deleted: int  # microbatches of results forgotten


class Step(msgspec.Struct, frozen=True):
    step: int
    loss: float | None  # mean next-token loss of the step's batch (null: not a finite number)
    tokens: int
    seconds: float


class Adapter(msgspec.Struct, frozen=True):
    job: str
    model: str
    sha256: str
    size: int
    created: float
    url: str  # where to download it


class EmbedResults(msgspec.Struct, frozen=True):
    """A succeeded embed job's rows, `offset` onwards."""

    job: str
    offset: int
    total: int
    embeddings: list[list[float]]


class FinetuneResults(msgspec.Struct, frozen=True):
    """A fine-tune job's steps so far, in any state, and its adapter once it has succeeded."""

    job: str
    offset: int
    total: int
    steps: list[Step]
    adapter: Adapter | None


class TrainStep(msgspec.Struct, frozen=True):
    step: int
    loss: float | None  # the global batch's mean next-token loss (null: not finite)
    tokens: int
    seconds: float
    replicas: int  # that took part in the step
    bytes_sent: int  # by one replica to the next in the step's all-reduces
    val_loss: float | None = None  # on held-out rows, when validated at this step


class TrainResults(msgspec.Struct, frozen=True):
    """A train job's steps so far, in any state, and its trained model once saved."""

    job: str
    offset: int
    total: int
    steps: list[TrainStep]
    model: str | None  # the trained weights, a model of this broker (`model` to serve it)


Results = EmbedResults | FinetuneResults | TrainResults  # by the job's kind


class JobsQuery(msgspec.Struct, frozen=True):
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000, description="the most recent this many")] = (
        100
    )


MAX_JOB_WAIT_S = 30.0


class JobQuery(msgspec.Struct, frozen=True):
    wait: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            le=MAX_JOB_WAIT_S,
            description="seconds to hold the request while the job is still going: it is "
            "answered as soon as its state or progress changes, or after this long (a long "
            "poll); 0 answers at once",
        ),
    ] = 0.0


class ResultsQuery(msgspec.Struct, frozen=True):
    offset: Annotated[int, msgspec.Meta(ge=0, le=10**9, description="first row (or step)")] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000, description="rows (or steps)")] = 10_000
