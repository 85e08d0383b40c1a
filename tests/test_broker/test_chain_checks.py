"""Chained batch work checked against the hops' signed commitments (`broker/chaincheck.py`):
the chain runs unbroken, the broker recomputes the route from its start, and a provider whose
commitments it does not reproduce is quarantined and its microbatches redone. In-process: a
real broker and provider daemons with real ONNX stages on an in-memory network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from provider.faults import Fault
from tests.test_broker.conftest import local_embeddings
from tests.test_broker.inproc import Swarm, swarm

pytestmark = pytest.mark.timeout(120)
TEXTS = [f"a text about checking strangers' work, number {i}" for i in range(16)]


async def _finished(s: Swarm, job: str) -> str:
    row = await s.until(
        "the job's end",
        lambda: (r := s.broker.store.job(job, full=False)) and r.state in ("succeeded", "failed")
        and r,
        90,
    )  # fmt: skip
    return str(row.state)


@pytest.mark.parametrize("wire", ["native", "int8"])
async def test_every_hop_of_a_chain_is_checked_by_its_commitments_without_breaking_it(
    tmp_path: Path, wire: str, request: pytest.FixtureRequest
) -> None:
    """Also over the int8 wire: each hop commits to what the next one receives, and the
    broker's run goes through the same wire."""
    name = "minilm_package" if wire == "native" else "minilm_int8_wire_package"
    minilm_package: Path = request.getfixturevalue(name)
    s = await swarm(tmp_path, microbatch=4, verify_fraction=1.0)
    try:
        for _ in range(2):
            await s.provider()
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        stages = len(s.broker.serving.route(model) or [])
        job = await s.broker.jobs.submit({"model": model, "texts": TEXTS, "microbatch": 4})
        assert await _finished(s, job.id) == "succeeded"
        rows = np.array(s.broker.jobs.results(job.id, 0, 100).embeddings)
        assert np.abs(rows - local_embeddings(minilm_package, TEXTS)).max() <= 1e-4
        checked = s.events("result_checked")
        # every hop of each of the 4 microbatches, each compared with the broker's own run;
        # no stage ran alone for a second opinion
        assert len(checked) == 4 * stages and all(e["by"] == "commitments" for e in checked)
        assert not s.events("provider_quarantined") and not s.events("check_skipped")
        assert all(e["mantissa"] <= 0.025 for e in checked), checked
        reps = {p: s.broker.verifier.summary(p) for p in s.providers}
        assert sum(r.checks for r in reps.values()) == 4 * stages
        assert all(r.disagreed == 0 for r in reps.values())
    finally:
        await s.close()


async def test_a_provider_whose_hop_commitments_differ_is_quarantined_and_its_work_redone(
    tmp_path: Path, minilm_package: Path
) -> None:
    s = await swarm(tmp_path, microbatch=4, verify_fraction=1.0)
    try:
        liar = await s.provider(fault=Fault(wrong_output=True))  # alone: every stage is its
        assert liar.host is not None
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        job = await s.broker.jobs.submit({"model": model, "texts": TEXTS, "microbatch": 4})
        (caught,) = await s.until("the liar caught", lambda: s.events("provider_quarantined"))
        assert caught["peer"] == liar.host.peer_id
        assert "commitments" in caught["reason"], caught
        assert "differ from the broker's run" in caught["reason"], caught
        await s.provider()  # an honest provider takes the model over; the job goes on
        assert await _finished(s, job.id) == "succeeded"
        rows = np.array(s.broker.jobs.results(job.id, 0, 100).embeddings)
        assert np.abs(rows - local_embeddings(minilm_package, TEXTS)).max() <= 1e-4
        assert s.broker.verifier.summary(liar.host.peer_id).quarantined
    finally:
        await s.close()


async def test_a_hop_that_commits_to_nothing_is_checked_alone_next(
    tmp_path: Path, minilm_package: Path
) -> None:
    """Committing nothing escapes no check: the hop's check is owed, and its provider's next
    due task of the stage runs alone, for a second opinion."""
    s = await swarm(tmp_path, microbatch=4, verify_fraction=1.0)
    try:
        for _ in range(2):
            provider = await s.provider()
            provider.server.sign = None  # (as a provider that signs no account)
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        for _ in range(2):  # (the first job's microbatches may all be on their way at once)
            body = {"model": model, "texts": TEXTS, "microbatch": 4}
            job = await s.broker.jobs.submit(body)
            assert await _finished(s, job.id) == "succeeded"
        skipped = s.events("check_skipped")
        assert skipped and all("committed to nothing" in e["reason"] for e in skipped)
        second = [e for e in s.events("result_checked") if "by" not in e]
        assert second, s.events("result_checked")  # checked alone, by a second opinion
        assert not [e for e in s.events("result_checked") if "by" in e]
    finally:
        await s.close()
