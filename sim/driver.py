"""The simulator's driver of the broker's decision core, and the replay of recorded traces.

`Driver` holds a `broker.core.Core` built from a `CoreConfig` (the simulator's scenario gives
one, a trace file another) and hands it events; the swarm simulation models what the actions
do. `replay` feeds a trace's recorded inputs to a fresh core through this same driver and
compares every decision with the recorded one: the broker and the simulator decide alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

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
    note: str = ""
    kinds: Counter[str] = field(default_factory=Counter)  # action and notice kinds decided
    mismatches: list[str] = field(default_factory=list)  # where the replay decided otherwise


def replay(lines: Iterable[bytes], limit: int = 20) -> Replay:
    """Replay a trace through a `Driver`; up to `limit` mismatches are described."""
    config, note, steps = core_trace.read(lines)
    driver = Driver(config)
    out = Replay(note=note)
    for n, step in enumerate(steps, start=1):
        decided = core_trace.encode_actions(driver.handle(step.event))
        recorded = core_trace.encode_actions(step.actions)
        out.steps = n
        for action in step.actions:
            out.kinds[_kind(action)] += 1
        if decided != recorded and len(out.mismatches) < limit:
            first = next(
                (i for i, (a, b) in enumerate(zip(decided, recorded, strict=False)) if a != b),
                min(len(decided), len(recorded)),
            )
            out.mismatches.append(
                f"step {n} ({type(step.event).__name__} at {step.event.at:.3f}), action "
                f"{first}: replayed {_at(decided, first)} but recorded {_at(recorded, first)}"
            )
    return out


def _kind(action: Action) -> str:
    name = type(action).__name__
    kind = getattr(action, "kind", None)
    return f"{name}:{kind}" if isinstance(kind, str) else name


def _at(actions: list[bytes], i: int) -> str:
    return actions[i].decode() if i < len(actions) else "nothing"
