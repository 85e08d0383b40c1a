"""Pre-training through the swarm, in process: real broker and provider daemons (real SQLite,
real stage downloads over HTTP, real torch replicas) on an in-memory network. K replicas
all-reducing peer to peer give one process's losses; a replica killed mid-run and a provider
joining, and the broker restarting, leave every step counted once and the losses of a run
without them; bad submissions are refused before anything runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.jobkinds import JobError
from ir.scratch import SHIPPED_DATA, Corpus, read_texts, tokenize
from provider.localtrain import LocalRun, TrainSettings
from tests.test_broker.inproc import Swarm, swarm
from tests.tiny_models import tokenizer_of

pytestmark = pytest.mark.timeout(240)
SEQ, BATCH = 32, 12
TEXTS = read_texts(SHIPPED_DATA)[:20]


def reference(package: Path, steps: int, replicas: int = 1, **change: Any) -> list[float]:
    """One process's per-step losses on the same global batches."""
    corpus = Corpus(tokenize(TEXTS, tokenizer_of(package)), SEQ, holdout=0.05)
    settings = TrainSettings(steps=steps, batch=BATCH, seq_len=SEQ, **change)
    return [r.loss for r in LocalRun(package, corpus, replicas, settings).run()]


async def start(s: Swarm, package: Path, providers: int) -> str:
    for _ in range(providers):
        await s.provider()
    model = await s.add_model(package)
    await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]), 60)
    return model


def body(model: str, **fields: Any) -> dict[str, Any]:
    return {"kind": "train", "model": model, "texts": TEXTS, "batch": BATCH, "seq_len": SEQ,
            **fields}  # fmt: skip


async def finished(s: Swarm, job: str, timeout: float = 180) -> Any:
    return await s.until(
        "the job's end",
        lambda: (row := s.broker.store.job(job, full=False)) and row.state
        not in ("queued", "placed", "running") and row,
        timeout,
    )  # fmt: skip


def losses(s: Swarm, job: str) -> list[float]:
    steps = s.broker.jobs.results(job, 0, 10_000).steps
    assert [st.step for st in steps] == list(range(1, len(steps) + 1))  # no gap, no repeat
    return [st.loss for st in steps]


@pytest.mark.parametrize("replicas", [2, 3])
async def test_replicas_on_providers_give_one_processes_losses(
    tmp_path: Path, pretrain_package: Path, replicas: int
) -> None:
    """Uncompressed, K replicas on K providers give one process's losses within 1e-5 for 20
    steps; the trained weights become a model of the broker."""
    s = await swarm(tmp_path)
    try:
        model = await start(s, pretrain_package, replicas)
        job = await s.broker.jobs.submit(body(model, steps=20, replicas=replicas))
        row = await finished(s, job.id)
        assert row.state == "succeeded", row.error
        expected = await asyncio.to_thread(reference, pretrain_package, 20)
        np.testing.assert_allclose(losses(s, job.id), expected, rtol=1e-5)
        results = s.broker.jobs.results(job.id, 0, 100)
        assert {st.replicas for st in results.steps} == {replicas}
        assert results.steps[-1].val_loss is not None
        assert all(st.bytes_sent > 0 for st in results.steps)
        assert results.model == f"{model}-{job.id}" and results.model in s.broker.models.models
        assert s.events("train_saved")[0]["model"] == results.model
    finally:
        await s.close()


@pytest.mark.parametrize(
    "change", [{"compress": "acp", "rank": 4}, {"outer_every": 3}], ids=["acp", "diloco"]
)
async def test_compressed_and_diloco_runs_give_the_same_run_in_one_process(
    tmp_path: Path, pretrain_package: Path, change: dict[str, Any]
) -> None:
    """ACP-SGD's alternating factors and DiLoCo's outer steps (committed like any step)
    through two providers give two replicas' losses in one process."""
    s = await swarm(tmp_path)
    try:
        model = await start(s, pretrain_package, 2)
        job = await s.broker.jobs.submit(body(model, steps=8, replicas=2, **change))
        row = await finished(s, job.id)
        assert row.state == "succeeded", row.error
        expected = await asyncio.to_thread(reference, pretrain_package, 8, 2, **change)
        np.testing.assert_allclose(losses(s, job.id), expected, rtol=1e-5)
    finally:
        await s.close()


async def test_a_replica_killed_mid_run_and_a_provider_joining(
    tmp_path: Path, pretrain_package: Path
) -> None:
    """A replica dies at step 6: the step is redone without it; a provider that joins then
    reads the running state from the survivor and takes part from the next step. Steps have
    no gap or repeat and the losses are an uninterrupted run's within 1e-4."""
    s = await swarm(tmp_path)
    try:
        model = await start(s, pretrain_package, 2)
        job = await s.broker.jobs.submit(body(model, steps=14, replicas=2))
        first = next(iter(s.providers.values()))

        def mid_step() -> bool:
            run = first.pretraining.runs.get(job.id)
            return s.broker.store.count_done(job.id) >= 6 and run is not None and bool(run.task)

        await s.until("a step under way after step 6", mid_step, 120)
        victim = s.kill(first)
        await s.provider()  # a newcomer, mid-run
        row = await finished(s, job.id)
        assert row.state == "succeeded", row.error
        expected = await asyncio.to_thread(reference, pretrain_package, 14)
        np.testing.assert_allclose(losses(s, job.id), expected, rtol=1e-4)
        assert any(e["peer"] == victim for e in s.events("train_replica_dropped"))
        assert s.events("train_step_redone")  # the step it died in, redone without it
        joined = s.events("train_replica_joined")
        assert joined and joined[-1]["step"] > 0 and joined[-1]["donor"]
        steps = s.broker.jobs.results(job.id, 0, 100).steps
        assert steps[-1].replicas == 2 and min(st.replicas for st in steps) >= 1
    finally:
        await s.close()


async def test_a_broker_restart_mid_run_counts_every_step_once(
    tmp_path: Path, pretrain_package: Path
) -> None:
    s = await swarm(tmp_path)
    try:
        model = await start(s, pretrain_package, 2)
        job = await s.broker.jobs.submit(body(model, steps=12, replicas=2))
        await s.until("step 4", lambda: s.broker.store.count_done(job.id) >= 4, 120)
        assert s.broker.store.count_done(job.id) < 12  # mid-run
        await s.restart()
        for p in s.providers.values():
            await p.join()
        row = await finished(s, job.id)
        assert row.state == "succeeded", row.error
        expected = await asyncio.to_thread(reference, pretrain_package, 12)
        np.testing.assert_allclose(losses(s, job.id), expected, rtol=1e-4)
        assert s.events("job_resumed")
    finally:
        await s.close()


@pytest.mark.parametrize("when", ["mid-step", "before-commit"])
async def test_a_cancelled_run_keeps_its_weights_as_a_model(
    tmp_path: Path, pretrain_package: Path, when: str
) -> None:
    """Cancelled while a step computes, or between step 3's record and its commit on the
    replicas (the replica holds it prepared only), the run's weights at its last recorded step
    become a model."""
    s = await swarm(tmp_path)
    try:
        model = await start(s, pretrain_package, 1)
        store = s.broker.store
        record = store.put_train_step

        def cancel_after_record(job: str, step: int, *rest: Any) -> None:
            record(job, step, *rest)
            row = store.job(job, full=False)
            if step == 3 and when == "before-commit" and row.state == "running":
                s.broker.jobs.cancel(job)  # (the run's next wait is the commit's)

        store.put_train_step = cancel_after_record  # type: ignore[method-assign]
        job = await s.broker.jobs.submit(body(model, steps=500, replicas=1, name="kept"))
        if when == "mid-step":
            replica = next(iter(s.providers.values())).pretraining

            def mid_step() -> bool:
                run = replica.runs.get(job.id)
                return store.count_done(job.id) >= 3 and run is not None and bool(run.task)

            await s.until("step 4 under way", mid_step, 120)
            s.broker.jobs.cancel(job.id)
        await s.until(
            "the weights saved",
            lambda: "kept" in s.broker.models.models or s.events("train_not_saved"),
            60,
        )
        assert not s.events("train_not_saved")
        results = s.broker.jobs.results(job.id, 0, 1000)
        assert results.model == "kept" and 3 <= results.total < 500
        saved = s.events("train_saved")[0]
        assert saved["step"] == 3 if when == "before-commit" else saved["step"] >= 3
        assert s.broker.store.job(job.id).state == "cancelled"
    finally:
        await s.close()


async def test_bad_submissions_are_refused_before_anything_runs(
    tmp_path: Path, pretrain_package: Path
) -> None:
    s = await swarm(tmp_path)
    try:
        model = await start(s, pretrain_package, 1)
        cases = {
            "compress": {"compress": "zip"},
            "rank": {"compress": "acp", "rank": 0},
            "replicas": {"replicas": 2},
            "batch": {"replicas": 1, "batch": 0},
            "texts": {"replicas": 1, "texts": ["too short"]},
        }
        for field, change in cases.items():
            with pytest.raises(JobError) as err:
                await s.broker.jobs.submit({**body(model, replicas=1), **change})
            assert err.value.field == field, (field, str(err.value))
        with pytest.raises(Exception, match="no model named"):
            await s.broker.jobs.submit(body("nothing-here"))
        assert s.broker.store.jobs(("queued", "placed", "running")) == []
    finally:
        await s.close()
