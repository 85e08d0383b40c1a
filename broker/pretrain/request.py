"""A train job's submission as the broker keeps it: its corpus, its trained model's name and
the record kept of each step."""

from __future__ import annotations

from typing import Any

import numpy as np

from broker.jobkinds import JobError
from broker.models import StoredModel
from broker.schema import JobRow
from ir.errors import IRError
from ir.scratch import Corpus, tokenize
from proto.api.jobs import TrainJobRequest

Array = np.ndarray[Any, Any]
HOLDOUT = 0.05  # of the corpus's rows, for validation
VAL_ROWS = 32  # held-out rows scored at each validation
RECORD = 6  # a step's record: loss, tokens, seconds, replicas, bytes sent, val loss (nan: none)


def corpus_of(model: StoredModel, body: TrainJobRequest) -> Corpus:
    """The job's texts as token rows, by the package's tokenizer (`JobError` if too few)."""
    manifest = model.manifest
    if manifest.tokenizer is None:
        raise JobError("model", f"model {model.name} ships no tokenizer to read texts with")
    tokens = tokenize(list(body.texts), model.directory / manifest.tokenizer)
    try:
        return Corpus(tokens, body.seq_len, holdout=HOLDOUT, seed=body.seed)
    except IRError as exc:  # (too little text for one row, or for a few)
        raise JobError("texts", str(exc)) from None


def trained_name(job: JobRow, request: TrainJobRequest) -> str:
    return request.name or f"{job.model}-{job.id}"[:64]


def to_dict(body: TrainJobRequest) -> dict[str, Any]:
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(body)
    return out


def parse(job: JobRow) -> TrainJobRequest:
    import msgspec

    return msgspec.convert(job.request, TrainJobRequest)
