"""Trace files: a run's core inputs and decisions, as JSON lines, to replay elsewhere.

A broker run starts with a header line, `{"config": CoreConfig, "note": ...}`; each further
line is one `Core.handle` call: `{"in": event, "out": [actions]}`. A broker restarted with the
same file appends a new run (a new header: its core starts afresh). The broker writes one
with `--trace FILE`; the simulator's driver (`sim.driver.replay`) feeds the inputs to its own
`Core` and compares its decisions with the recorded ones, element by element. Encoding and
decoding only: the files are written and read by the callers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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


@dataclass
class Segment:
    """One broker run: its configuration and every `handle` call, in order."""

    config: CoreConfig
    note: str
    steps: list[Step] = field(default_factory=list)


_encoder = msgspec.json.Encoder()
_header = msgspec.json.Decoder(_Header)
_step = msgspec.json.Decoder(_Step)


def header(config: CoreConfig, note: str = "") -> bytes:
    return _encoder.encode(_Header(config, note)) + b"\n"


def step(event: Input, actions: list[Action]) -> bytes:
    return _encoder.encode(_Step(event, actions)) + b"\n"


def encode_actions(actions: Iterable[Action]) -> list[bytes]:
    """Actions as compared between a recording and a replay: their JSON encodings."""
    return [_encoder.encode(a) for a in actions]


def read(lines: Iterable[bytes]) -> list[Segment]:
    """A trace's segments (a broker restarted mid-run starts a new one with its own header);
    raises `ValueError` naming the first line that is neither."""
    segments: list[Segment] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.startswith(b'{"config"'):
            try:
                first = _header.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise ValueError(f"line {n} of the trace: a bad header: {exc}") from None
            segments.append(Segment(first.config, first.note))
            continue
        if not segments:
            raise ValueError(f"line {n} of the trace comes before any header")
        try:
            s = _step.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ValueError(f"line {n} of the trace: {exc}") from None
        segments[-1].steps.append(Step(s.event, s.actions))
    if not segments:
        raise ValueError("the trace is empty")
    return segments
