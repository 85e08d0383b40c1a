"""How the broker cuts a batch job it was not told how to cut (`broker.core.microbatch`)."""

from __future__ import annotations

import pytest

from broker.core.microbatch import MOST_IN_FLIGHT, SMALLEST, Cut, cut, stations


def test_a_large_job_on_a_long_route_is_cut_so_that_filling_the_pipeline_costs_little() -> None:
    assert stations(3) == 7 and stations(3, star=True) == 9
    got = cut(512, 3, largest=32)
    assert got == Cut(microbatch=9, in_flight=MOST_IN_FLIGHT)
    microbatches = -(-512 // got.microbatch)
    assert microbatches / (microbatches + stations(3) - 1) >= 0.9  # of the slowest station's pace
    # every station busy, plus one waiting: on one stage, 3 stations and 4 in flight
    assert cut(512, 1, largest=32) == Cut(microbatch=28, in_flight=4)


def test_the_cut_stays_within_its_bounds_and_what_the_operator_set() -> None:
    assert cut(100_000, 3, largest=32).microbatch == 32  # fill is nothing next to the job
    assert cut(10, 3, largest=32).microbatch == SMALLEST  # not below per-call costs
    assert cut(10, 3, largest=2).microbatch == 2
    assert cut(512, 3, largest=32, in_flight=3).in_flight == 3
    assert cut(512, 12, largest=32).in_flight == MOST_IN_FLIGHT  # providers' admission per peer
    with pytest.raises(ValueError):
        cut(0, 3, largest=32)
