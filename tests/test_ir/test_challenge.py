"""The hardware check's workload: any executor gets the checker's answer bit for bit, a
wrong row is found, and sizes stay within their bounds whatever the claim."""

from __future__ import annotations

import numpy as np
import pytest

from ir.challenge import (
    CHECK_ROWS,
    MAX_ROUNDS,
    MAX_ROWS,
    MIN_ROWS,
    RUN_ROUNDS,
    WIDTH,
    Work,
    reference,
    round_graph,
    run,
    sized,
    wrong_rows,
)
from ir.executors.base import Executor
from ir.executors.ort import OrtExecutor

SEED = bytes(range(16))


def _run(work: Work, kind: str, window_s: float = 60.0) -> tuple[int, bytes]:
    cache: dict[tuple[int, bool], Executor] = {}

    def executor(rounds: int, start: bool) -> Executor:
        if (rounds, start) not in cache:
            graph = round_graph(rounds, start)
            if kind == "torch":
                from ir.executors.torch_exec import TorchExecutor

                cache[(rounds, start)] = TorchExecutor(graph)
            else:
                cache[(rounds, start)] = OrtExecutor(graph)
        return cache[(rounds, start)]

    return run(work, executor, window_s)


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_an_executor_gets_the_checkers_answer_for_every_row(kind: str) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    work = Work(SEED, rows=96, rounds=1 + RUN_ROUNDS)
    rounds, answer = _run(work, kind)
    assert rounds == work.rounds
    assert np.array_equal(
        np.frombuffer(answer, "<i2"), reference(work, range(work.rows), work.rounds)
    )
    assert wrong_rows(work, rounds, answer, list(range(work.rows))) == []


def test_a_wrong_row_or_a_wrong_round_count_is_found() -> None:
    work = Work(SEED, rows=64, rounds=3)
    rounds, answer = _run(work, "ort")
    bad = bytearray(answer)
    bad[2 * 5] ^= 1  # row 5
    assert wrong_rows(work, rounds, bytes(bad), [1, 5, 9]) == [5]
    assert wrong_rows(work, rounds - 1, answer, [1, 5, 9]) == [1, 5, 9]  # (all differ here)
    assert wrong_rows(work, rounds + 1, answer, [1]) == [1]  # more rounds than asked
    assert wrong_rows(work, rounds, answer[:-2], [1]) == [1]  # a short answer


def test_rows_are_independent_of_each_other() -> None:
    """Row i's answer is computed from row i alone: the checker recomputes a few rows."""
    work = Work(SEED, rows=200, rounds=2)
    whole = reference(work, range(work.rows), 2)
    assert np.array_equal(reference(work, [150, 3], 2), whole[[150, 3]])
    assert len(set(whole.tolist())) > 20  # answers vary from row to row


def test_the_window_stops_a_slow_run_after_its_first_round() -> None:
    work = Work(SEED, rows=64, rounds=MAX_ROUNDS)
    rounds, answer = _run(work, "ort", window_s=0.0)
    assert rounds == 1 and wrong_rows(work, 1, answer, list(range(CHECK_ROWS))) == []


@pytest.mark.parametrize("flops", [0.0, 1e6, 5e10, 6.7e13, 1e18])
def test_a_check_is_sized_from_the_claim_within_bounds(flops: float) -> None:
    work = sized(flops, 0.25, SEED)
    assert MIN_ROWS <= work.rows <= MAX_ROWS and 1 <= work.rounds <= MAX_ROUNDS
    assert work.width == WIDTH
    want = flops * 0.25
    if 2 * MIN_ROWS * WIDTH**2 < want < 2 * MAX_ROWS * WIDTH**2 * MAX_ROUNDS:
        assert work.flops() == pytest.approx(want, rel=0.1)  # as long as the claim says
    # the checker's share stays small: CHECK_ROWS rows through every round (multiply-adds)
    assert CHECK_ROWS * work.rounds * WIDTH**2 <= 2.2e9
