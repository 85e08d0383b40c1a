"""The simulator's driver of the broker's decision core, and the replay of recorded traces.

`Driver` holds a `broker.core.Core` built from a `CoreConfig` (the simulator's scenario gives
one, a trace file another) and hands it events; the swarm simulation models what the actions
do. `replay` feeds a trace's recorded inputs to a fresh core through this same driver and
compares every decision with the recorded one: the broker and the simulator decide alike.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.core import Core, CoreConfig
from broker.core import trace as core_trace
from broker.core.actions import Action
from broker.core.events import Input


class Driver:
    def __init__(self, config: CoreConfig) -> None:
        self.core = Core(config)
        self.calls = 0  # events handed to the core

    def handle(self, event: Input) -> list[Action]:
        self.calls += 1
        return self.core.handle(event)


@dataclass
class Replay:
    steps: int = 0
    runs: int = 0  # broker runs (a restart starts a new one)
    note: str = ""
    kinds: Counter[str] = field(default_factory=Counter)  # action and notice kinds decided
    mismatches: list[str] = field(default_factory=list)  # where the replay decided otherwise

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "broker_runs": self.runs,
            "note": self.note,
            "same_decisions": not self.mismatches,
            "mismatches": self.mismatches,
            "decisions": dict(sorted(self.kinds.items())),
        }


def trace_lines(path: Path) -> list[bytes]:
    """A trace file's lines (gzip-compressed if its name ends in .gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return f.read().splitlines()


def replay_file(path: Path, limit: int = 20, observe: Observer | None = None) -> Replay:
    return replay(trace_lines(path), limit, observe)


Observer = Callable[[Core, core_trace.Step], None]


def replay(lines: Iterable[bytes], limit: int = 20, observe: Observer | None = None) -> Replay:
    """Replay a trace through `Driver`s (a fresh one per broker run it records); up to
    `limit` mismatches are described. `observe(core, step)` sees each step's recorded event
    and actions with the core as that step left it."""
    out = Replay()
    n = 0
    for segment in core_trace.read(lines):
        driver = Driver(segment.config)
        out.note = out.note or segment.note
        for step in segment.steps:
            n += 1
            decided = core_trace.encode_actions(driver.handle(step.event))
            recorded = core_trace.encode_actions(step.actions)
            out.steps = n
            for action in step.actions:
                out.kinds[_kind(action)] += 1
            if observe is not None:
                observe(driver.core, step)
            if decided != recorded and len(out.mismatches) < limit:
                first = next(
                    (i for i, (a, b) in enumerate(zip(decided, recorded, strict=False)) if a != b),
                    min(len(decided), len(recorded)),
                )
                out.mismatches.append(
                    f"step {n} ({type(step.event).__name__} at {step.event.at:.3f}), action "
                    f"{first}: replayed {_at(decided, first)} but recorded {_at(recorded, first)}"
                )
        out.runs += 1
    return out


def _kind(action: Action) -> str:
    name = type(action).__name__
    kind = getattr(action, "kind", None)
    return f"{name}:{kind}" if isinstance(kind, str) else name


def _at(actions: list[bytes], i: int) -> str:
    return actions[i].decode() if i < len(actions) else "nothing"
