"""Queue policies: SJF-BSBF beats FIFO on a scripted job mix, in a stated order."""

from __future__ import annotations

import pytest

from broker.core.queue import Fifo, Job, SjfBsbf, mean_completion, schedule

# A long job holds all 4 GPUs; short jobs arrive behind it.
JOBS = [
    Job("A", arrival=0, gpus=4, duration=100),
    Job("B", arrival=1, gpus=4, duration=10),
    Job("C", arrival=2, gpus=2, duration=5),
    Job("D", arrival=3, gpus=4, duration=50),
    Job("E", arrival=4, gpus=2, duration=8),
]


def test_fifo_runs_jobs_in_arrival_order() -> None:
    done = schedule(JOBS, gpus=4, policy=Fifo())
    assert sorted(done, key=done.__getitem__) == ["A", "B", "C", "D", "E"]
    assert done == {"A": 100, "B": 110, "C": 115, "D": 165, "E": 173}


def test_sjf_bsbf_shares_gpus_with_the_long_job_and_lowers_mean_completion() -> None:
    fifo = schedule(JOBS, gpus=4, policy=Fifo())
    sjf = schedule(JOBS, gpus=4, policy=SjfBsbf())
    # B shares A's GPUs at once (waiting ~99 s would cost far more than running 1.6x slower
    # beside A); then the short jobs finish first and the long A last.
    assert sorted(sjf, key=sjf.__getitem__) == ["B", "C", "E", "D", "A"]
    assert sjf["B"] == pytest.approx(1 + 10 * 1.6)
    assert mean_completion(JOBS, sjf) < 0.6 * mean_completion(JOBS, fifo)


def test_no_sharing_when_the_benefit_is_negative() -> None:
    # The running job ends in 2 s: waiting beats sharing, so B waits.
    jobs = [Job("A", 0, 4, 3), Job("B", 1, 4, 10)]
    done = schedule(jobs, gpus=4, policy=SjfBsbf())
    assert done == {"A": 3, "B": 13}


def test_a_job_larger_than_the_cluster_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 8 GPUs"):
        schedule([Job("big", 0, 8, 1)], gpus=4, policy=Fifo())


def test_gpus_come_back_when_a_job_and_its_sharer_end_together() -> None:
    # Found by review: both end in the same step; the GPUs must not leak.
    jobs = [Job("A", 0, 2, 10, 1.1), Job("B", 5, 2, 5, 1.1), Job("C", 100, 2, 1)]
    done = schedule(jobs, gpus=2, policy=SjfBsbf())
    assert done["C"] == pytest.approx(101)
