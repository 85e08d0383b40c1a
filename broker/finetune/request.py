"""A fine-tune submission: its fields and limits, the trainable stages, the step graph
(`dag.builders.finetune`), and the training texts tokenized and packed into rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import networkx as nx
import numpy as np

from broker.jobkinds import JobError
from client.stages import ClientStages
from dag.builders import finetune
from dag.tasks import task
from ir.manifest import ModelManifest, StageInfo
from ir.training import (
    TrainingError,
    pack,
    step_rows,
)
from proto.api.jobs import FinetuneJobRequest

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class FinetuneRequest:
    model: str
    texts: list[str]
    steps: int = 20
    batch: int = 8  # sequences per optimizer step
    microbatches: int = 2  # the batch is cut into this many microbatches
    seq_len: int = 32  # tokens per sequence
    method: str = "lora-fa"
    rank: int = 4
    lr: float = 1e-2
    weight_decay: float = 0.0
    seed: int = 0
    snapshot_every: int = 5  # steps between snapshots (0: none)
    shards: tuple[int, int] = (2, 3)  # k of n
    kind: str = "finetune"

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["shards"] = list(self.shards)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FinetuneRequest:
        values = dict(data)
        values["shards"] = tuple(values.get("shards", (2, 3)))
        return cls(**values)


def parse_finetune(body: FinetuneJobRequest, max_texts: int) -> FinetuneRequest:
    """What the body's struct cannot say; raises `JobError` naming the field."""
    if len(body.texts) > max_texts:
        raise JobError("texts", f"{len(body.texts)} texts; one job takes at most {max_texts}")
    if body.microbatches > body.batch or body.batch % body.microbatches:
        raise JobError("microbatches", f"must divide the batch ({body.batch})")
    k, n = body.shards
    if k > n:
        raise JobError("shards", "[k, n]: n shards, any k of which rebuild; 1 <= k <= n <= 64")
    fields = msgspec.structs.asdict(body)
    fields["shards"] = (k, n)
    return FinetuneRequest(**fields)


def trainable_stages(manifest: ModelManifest) -> list[StageInfo]:
    """The provider stages of a decoder with adapter slots in each; raises `JobError`."""
    stages = manifest.provider_stages()
    if not any(i.name.startswith("past_") for s in stages for i in s.inputs):
        raise JobError("model", f"{manifest.name} is not a decoder; fine-tuning trains LMs")
    bare = [s.name for s in stages if not s.adapters]
    if bare:
        raise JobError(
            "model",
            f"stages {bare} of {manifest.name} have no adapter slots; export the model with "
            f"adapters (fusionai ir split MODEL --adapters q,v)",
        )
    return stages


MAX_MICROBATCH_TOKENS = 65_536  # sequences x tokens of one microbatch
MAX_LOGIT_BYTES = 1 << 30  # the head's float32 logits of one microbatch, on the broker


def check_size(manifest: ModelManifest, request: FinetuneRequest) -> None:
    """A microbatch must fit a wire message and the broker's head; `JobError` if not."""
    from proto.forward import MAX_ACTIVATION_BYTES

    tokens = request.microbatch * request.seq_len
    hidden = int(manifest.config.get("hidden_size", 0) or 0)
    vocab = int(manifest.config.get("vocab_size", 0) or 0)
    if tokens > MAX_MICROBATCH_TOKENS:
        raise JobError(
            "microbatches",
            f"a microbatch of {request.microbatch} x {request.seq_len} = {tokens} tokens; at most "
            f"{MAX_MICROBATCH_TOKENS}: use more microbatches or a shorter seq_len",
        )
    if tokens * hidden * 4 > MAX_ACTIVATION_BYTES or tokens * vocab * 4 > MAX_LOGIT_BYTES:
        raise JobError(
            "microbatches",
            f"a microbatch of {tokens} tokens is too large for this model's activations or "
            f"logits: use more microbatches or a shorter seq_len",
        )


def finetune_graph(spec: Any, stages: list[StageInfo], request: FinetuneRequest) -> nx.DiGraph:
    """One optimizer step as a `dag` graph (the same graph every step)."""
    adapter_bytes = [
        4.0 * request.rank * sum(a.in_features + a.out_features for a in s.adapters) for s in stages
    ]
    return finetune(
        spec,
        [(i, i + 1) for i in range(len(stages))],
        microbatches=request.microbatches,
        batch=request.microbatch,
        seq=request.seq_len,
        adapter_bytes=adapter_bytes,
    )


class Data:
    """The training texts, tokenized (each ends in end-of-sequence) and packed into rows."""

    def __init__(self, client: ClientStages, request: FinetuneRequest) -> None:
        if client.tokenizer is None:
            raise JobError("texts", f"model {request.model} ships no tokenizer")
        eos = [client.eos] if client.eos is not None else []
        encodings = client.tokenizer.encode_batch(list(request.texts))
        vocab = int(client.manifest.config.get("vocab_size", 0) or 0)
        sequences = [[*e.ids, *eos] for e in encodings]
        try:
            self.blocks = pack(sequences, request.seq_len)
        except TrainingError as exc:
            raise JobError("texts", str(exc)) from None
        if vocab and int(self.blocks.max()) >= vocab:
            raise JobError("texts", "the tokenizer gives ids outside the model's vocabulary")
        self.request = request
        self.tokens = int(sum(len(s) for s in sequences))

    def microbatch(self, step: int, m: int) -> tuple[Array, Array]:
        """(input ids, target ids), each (microbatch, seq_len), of microbatch m of `step`."""
        r = self.request
        rows = step_rows(len(self.blocks), step, r.batch, r.seed)[
            m * r.microbatch : (m + 1) * r.microbatch
        ]
        block = self.blocks[rows]
        return block[:, :-1].copy(), block[:, 1:].copy()


def finetune_estimate(graph: nx.DiGraph, steps: int) -> float:
    """FLOPs of the whole job (the queue ranks jobs by size)."""
    return sum(task(graph, n).flops for n in graph.nodes) * steps
