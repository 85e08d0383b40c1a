"""An embedding job's request as the broker keeps it (`broker/embedjobs.py` runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.config import BrokerConfig
from broker.jobkinds import JobError
from proto.api.jobs import EmbedJobRequest


@dataclass(frozen=True)
class JobRequest:
    kind: str
    model: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    microbatch: int | None  # None: sized from the job and its route

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or [])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "model": self.model,
            "microbatch": self.microbatch,
        }
        if self.texts is not None:
            out["texts"] = self.texts
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
        return out


def parse_request(body: EmbedJobRequest, config: BrokerConfig) -> JobRequest:
    """What the body's struct cannot say; raises `JobError` naming the field."""
    texts, ids = body.texts, body.token_ids
    if (texts is None) == (ids is None):
        raise JobError("texts", "give either texts (strings) or token_ids (lists of ints)")
    field, items = ("texts", texts) if texts is not None else ("token_ids", ids or [])
    if not items:
        raise JobError(field, "is empty")
    if len(items) > config.max_job_texts:
        most = config.max_job_texts
        raise JobError(field, f"{len(items)} sequences; one job takes at most {most}")
    return JobRequest("embed", body.model, texts, ids, body.microbatch)


LARGEST = 32  # sequences per microbatch when the broker sizes them
