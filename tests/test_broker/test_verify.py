"""Spot checks: a provider that answers wrongly is caught, quarantined, refused when it joins
again, and its recent work is redone; the comparison and the sampling, unit by unit."""

from __future__ import annotations

import itertools
import math
import random
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config import BrokerConfig
from broker.events import EventLog
from broker.store import Store
from ir.checks import agree
from tests.procs import sample_texts as texts
from tests.test_broker.conftest import (
    BrokerProc,
    add_model,
    api,
    free_port,
    local_embeddings,
    pools,
    wait_job,
    wait_ready,
    wait_until,
)
from tests.test_broker.test_service import gone, peer_of, results

Spawner = Callable[..., Any]
FRACTION = 0.25  # one stage task in four is checked: a wrong provider is caught within 4


def test_agree_uses_a_tolerance_relative_to_the_reference() -> None:
    ref = np.array([[10.0, -0.001], [3.0, 0.0]], dtype=np.float32)
    assert agree(ref + 0.05, ref, rtol=1e-2, atol=1e-3) == (True, pytest.approx(0.05, rel=1e-4))
    assert not agree(ref + 1, ref, rtol=1e-2, atol=1e-3)[0]  # the wrong-output fault
    assert agree(ref, ref.reshape(4, 1), 1e-2, 1e-3) == (False, math.inf)
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert agree(nan, ref, 1e-2, 1e-3) == (False, math.inf)
    assert agree(nan, nan, 1e-2, 1e-3)[0]  # the same non-finite values in the same places
    assert agree(np.zeros((0, 3)), np.zeros((0, 3)), 0.0, 0.0) == (True, 0.0)


def test_one_task_in_every_1_over_fraction_is_checked(tmp_path: Path) -> None:
    from broker.verify import Verifier

    v = Verifier.__new__(Verifier)  # only the sampling: no store or registry needed
    v.config = BrokerConfig(data_dir=tmp_path, verify_fraction=FRACTION)
    v.phase = {}
    v.rng = random.Random(3)  # the broker's is unpredictable; a test's is seeded
    # each provider's tasks of a stage on their own schedule, however the tasks interleave
    draw = random.Random(5)
    peers = [draw.choice("ab") for _ in range(400)]
    due = {p: [i for i, q in enumerate(peers) if q == p and v.due("m/1", q)] for p in "ab"}
    for p, checked in due.items():
        mine = [i for i, q in enumerate(peers) if q == p]
        assert len(checked) in (len(mine) // 4, len(mine) // 4 + 1)
        gaps = [mine.index(b) - mine.index(a) for a, b in itertools.pairwise(checked)]
        assert mine.index(checked[0]) < 4 and max(gaps) == 4
    # a due task that got no answer (its call or one before it in a chain failed): the
    # provider's next task of the stage is due instead, and the schedule goes on from there
    v.events = EventLog(Store(tmp_path / "broker.db"))
    while not v.due("m/1", "a"):
        pass
    v.owe("m/1", "a")
    assert [v.due("m/1", "a") for _ in range(5)] == [True, False, False, False, True]
    assert [e.kind for e in v.events.store.events()] == ["check_owed"]
    v.config = BrokerConfig(data_dir=tmp_path, verify_fraction=0.0)
    assert not any(v.due("m/2", "a") for _ in range(100))


@pytest.mark.timeout(300)
def test_wrong_output_provider_is_caught_quarantined_and_its_work_redone(
    broker: Spawner, provider: Spawner, minilm_package: Path, tmp_path: Path
) -> None:
    port, data = free_port(), tmp_path / "broker-data"
    b: BrokerProc = broker("--verify-fraction", "0", data_dir=data, port=port)
    bad = provider(b.addr, "--fault", "wrong-output")
    good = provider(b.addr)
    bad_id, good_id = peer_of(bad), peer_of(good)
    wait_until("two providers", lambda: set(pools(b.http)) == {bad_id, good_id})
    add_model(b.http, minilm_package)
    route = wait_ready(b.http, "minilm")
    assert bad_id in {p["peer_id"] for s in route["stages"] for p in s["providers"]}

    # Unchecked, the wrong answers go through: a job finishes with wrong embeddings.
    first = texts(8)
    want_first = local_embeddings(minilm_package, first)
    _, early = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": first})
    assert wait_job(b.http, early["id"])["state"] == "succeeded"
    assert np.abs(results(b.http, early["id"]) - want_first).max() > 0.01

    # The same broker with spot checks on. No other provider holds the wrong one's stage:
    # the broker itself gives the second opinion (of a stage run alone), or recomputes a
    # chained route against its hops' commitments.
    b.proc.signal(signal.SIGTERM)
    assert gone(b.proc)
    b = broker("--verify-fraction", str(FRACTION), data_dir=data, port=port)
    route = wait_ready(b.http, "minilm")
    assert bad_id in {p["peer_id"] for s in route["stages"] for p in s["providers"]}
    batch = texts(32)
    _, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": batch, "microbatch": 2})

    caught = b.proc.wait_for("provider_quarantined", lambda e: e["peer"] == bad_id, timeout=120)
    # within 4 of its answers for the stage (each provider's tasks of a stage: one schedule)
    checks = [
        {k: e.get(k) for k in ("event", "peer", "stage", "against", "reason", "caught_at")}
        for e in b.proc.events
        if e["event"] in ("result_checked", "check_skipped", "check_owed", "microbatch_retry")
    ]
    # (unless a due task got no answer, e.g. the provider was busy: its next one is due
    # instead, after those already drawn while the call was out)
    owed = sum(1 for c in checks if c["event"] == "check_owed" and c["peer"] == bad_id)
    assert caught["caught_at"] <= math.ceil(1 / FRACTION) * (1 + owed), (caught, checks)
    assert re.search("differs? from the broker.s", caught["reason"]), caught
    assert early["id"] in caught["redo"]  # its finished work is redone too
    done = wait_job(b.http, job["id"])
    assert done["state"] == "succeeded", done
    want = local_embeddings(minilm_package, batch)
    assert np.abs(results(b.http, job["id"]) - want).max() <= 1e-4
    b.proc.wait_for("job_redo", lambda e: e["job"] == early["id"], timeout=10)
    assert wait_job(b.http, early["id"])["state"] == "succeeded"
    assert np.abs(results(b.http, early["id"]) - want_first).max() <= 1e-4

    # Reputation in the API: the wrong one quarantined with its reason, the others trusted.
    _, out = api(b.http, "GET", "/v1/providers")
    assert [q["peer_id"] for q in out["quarantined"]] == [bad_id]
    rep = {p["peer_id"]: p["reputation"] for p in out["providers"]}
    assert rep[bad_id]["quarantined"] and rep[bad_id]["disagreed"] >= 1
    assert not rep[good_id]["quarantined"] and rep[good_id]["disagreed"] == 0
    assert rep[good_id]["agreed"] >= 1  # its stage was checked too, and agreed
    # It is out of the pool (the good one serves both stages now) and refused when it tries
    # to join again.
    assert pools(b.http).get(bad_id) in (None, "dead")
    refused = bad.wait_for("join_refused", lambda e: "quarantined" in e["reason"], timeout=30)
    assert re.search("differs? from the broker.s", refused["reason"]), refused
