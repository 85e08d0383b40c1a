"""The simulator's model of work: jobs, and the pipeline replicas that serve them at a rate."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Job:
    id: int
    tokens: float
    done: float = 0.0  # tokens of progress since it (re)started
    started: float = 0.0
    first_started: float | None = None

    @property
    def key(self) -> str:
        """Its id for the broker's queue."""
        return f"job-{self.id}"


@dataclass
class ReplicaRun:
    id: int
    ready_at: float  # serving from this time (inf: not yet, or broken)
    rate: float  # tokens/s while serving (inference: prefill and decode averaged)
    latency: float  # seconds per decode step through the pipeline
    ttft: float  # seconds from a job's start to its first token (prefill; 0 for training)
    job: Job | None = None
    last: float = 0.0  # time its progress was last advanced
    version: int = 0  # invalidates scheduled completions when the rate or job changes
    layout: tuple[tuple[str, int, int], ...] = ()  # (provider, first, end) of each stage
