"""Trace equivalence: the simulator's driver, given a real broker's recorded inputs, decides
what that broker decided, element by element (placements, promotions, unassignments, queue
order). The traces are recorded runs of real processes (`python -m tests.traces record`):
`make chaos`'s, and a scripted two-model run under SJF-BSBF."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from broker.core.actions import StartJob
from sim.driver import replay, trace_lines
from tests.traces import SITUATIONS, TRACES, situations

RECORDED = sorted(TRACES.glob("*.jsonl.gz"))


def test_the_recorded_traces_are_there() -> None:
    assert {p.name for p in RECORDED} >= {"chaos.jsonl.gz", "two-models.jsonl.gz"}


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_the_simulators_driver_decides_what_the_broker_decided(path: Path) -> None:
    result, _ = situations(path)
    assert result.steps > 100
    assert not result.mismatches, "\n".join(result.mismatches)
    # what was compared: every kind of decision the broker makes
    assert result.kinds["AssignStage"] and result.kinds["PlacementChanged"]
    assert result.kinds["ProviderLost"] and result.kinds["StartJob"]


def test_together_the_traces_hold_every_situation_the_core_decides() -> None:
    found: set[str] = set()
    for path in RECORDED:
        found |= situations(path)[1]
    assert [s for s in SITUATIONS if s not in found] == []


def test_a_changed_decision_is_caught(tmp_path: Path) -> None:
    """The comparison can fail: a trace whose recorded queue order was altered is refused."""
    lines = trace_lines(TRACES / "two-models.jsonl.gz")
    starts = [i for i, line in enumerate(lines) if b'"type":"StartJob"' in line]
    assert starts
    i = starts[0]
    lines[i] = lines[i].replace(b'"type":"StartJob","job":"', b'"type":"StartJob","job":"x', 1)
    result = replay(lines)
    assert result.mismatches and "StartJob" in result.mismatches[0]
    assert StartJob.__name__ in result.mismatches[0]


def test_a_bad_trace_is_refused_with_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b'{"in": {"type": "ClockTicked", "at": 1.0}, "out": []}\n')
    with pytest.raises(ValueError, match="line 1"):
        replay(trace_lines(bad))
