"""Trace files: a run's core inputs and decisions, as JSON lines, to replay elsewhere.

The first line is `{"config": CoreConfig}`; each further line is one `Core.handle` call:
`{"in": event, "out": [actions]}`. The broker writes one with `--trace FILE`; the simulator's
driver (`sim.driver.replay`) feeds the inputs to its own `Core` and compares its decisions with
the recorded ones, element by element. Encoding and decoding only: the files are written and
read by the callers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec

from broker.core.actions import Action
from broker.core.events import Input
from broker.core.state import CoreConfig


class _Header(msgspec.Struct, frozen=True):
    config: CoreConfig
    note: str = ""  # what run this trace records


class _Step(msgspec.Struct, frozen=True, rename={"event": "in", "actions": "out"}):
    event: Input
    actions: list[Action]


@dataclass(frozen=True)
class Step:
    event: Input
    actions: list[Action]


_encoder = msgspec.json.Encoder()


def header(config: CoreConfig, note: str = "") -> bytes:
    return _encoder.encode(_Header(config, note)) + b"\n"


def step(event: Input, actions: list[Action]) -> bytes:
    return _encoder.encode(_Step(event, actions)) + b"\n"


def encode_actions(actions: Iterable[Action]) -> list[bytes]:
    """Actions as compared between a recording and a replay: their JSON encodings."""
    return [_encoder.encode(a) for a in actions]


def read(lines: Iterable[bytes]) -> tuple[CoreConfig, str, Iterator[Step]]:
    """The configuration, note and steps of a trace; raises `ValueError` naming the line."""
    it = iter(lines)
    try:
        first = _Header_decoder.decode(next(it))
    except StopIteration:
        raise ValueError("the trace is empty") from None
    except msgspec.ValidationError as exc:
        raise ValueError(f"line 1 is not a trace header: {exc}") from None

    def steps() -> Iterator[Step]:
        for n, line in enumerate(it, start=2):
            if not line.strip():
                continue
            try:
                s = _Step_decoder.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise ValueError(f"line {n} of the trace: {exc}") from None
            yield Step(s.event, s.actions)

    return first.config, first.note, steps()


_Header_decoder = msgspec.json.Decoder(_Header)
_Step_decoder = msgspec.json.Decoder(_Step)
