"""What the SDK returns: a batch job's state (`Job`, the broker's own struct), fine-tune steps,
a generation and its stream. The swarm, models and results are the `proto.api` structs the
broker answers with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from proto.api import Job
from proto.api.jobs import MAX_JOB_WAIT_S

__all__ = ["Failover", "FineTune", "FinetuneStep", "Generation", "GenerationStream", "Job"]

Array = np.ndarray[Any, Any]
MAX_HOLD_S = MAX_JOB_WAIT_S  # the broker holds a status request at most this long (`?wait=`)


@dataclass(frozen=True)
class FinetuneStep:
    """One optimizer step of a fine-tune job."""

    step: int
    steps: int  # the job's total
    loss: float  # mean next-token loss of the step's batch
    tokens: int
    seconds: float

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class FineTune:
    """A finished fine-tune job: its losses, and the trained adapter (a safetensors file)."""

    job: str
    model: str
    steps: list[FinetuneStep]
    adapter: Path  # downloaded into the cache, named by its SHA-256
    sha256: str

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


@dataclass(frozen=True)
class Failover:
    """A provider stage that failed during a generation, and why."""

    stage: int  # provider stage position
    peer: str
    reason: str
    at: float  # time.monotonic() when it was noticed


@dataclass
class Generation:
    """A finished generation (`generate(..., stream=False)`), or one in progress (the stream's
    `result`)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (eos or a stop string) or "length"
    failovers: list[Failover] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # monotonic time of each token
    route: list[str] = field(default_factory=list)  # peer id per provider stage at the end
    checked: int = 0  # with verify: stage steps a second provider's answer confirmed
    unchecked: int = 0  # with verify: stage steps no second provider could check
    distrusted: list[str] = field(default_factory=list)  # providers found wrong (quarantined)
    chained: int = 0  # steps that went provider to provider (the others: to each and back)
    verified: bool | None = None  # whether the broker's rerun reproduced every provider's
    # commitments (None: not sent to be checked; see `AsyncClient(verify_share=...)`)
    verdict: Any = None  # the broker's `proto.api.swarm.Verdict`, when sent


class GenerationStream:
    """Text pieces of a generation as they come (`async for piece in stream`); `result` fills
    in as it goes and is complete once the iteration ends."""

    def __init__(self, pieces: AsyncIterator[str], result: Generation) -> None:
        self._pieces = pieces
        self.result = result

    def __aiter__(self) -> AsyncIterator[str]:
        return self._pieces

    async def aclose(self) -> None:
        close = getattr(self._pieces, "aclose", None)
        if close is not None:
            await close()


def long_poll_s(poll: float, left: float | None) -> float:
    """How long the next status request may wait at the broker for a change (a long poll)."""
    return min(max(poll, 0.0), MAX_HOLD_S, MAX_HOLD_S if left is None else left)
