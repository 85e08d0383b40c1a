"""A broker data folder written by an earlier release opens with this broker, nothing lost.

`tests/data/broker-v1/` was written by `tests/data/make_broker_data.py` on main at 3ef63ed
(before the rooms redesign): its identity, two models and their artifacts, placements, a
finished embedding job with results, a cancelled job, one the broker stopped before it
finished, a finished fine-tune with its snapshot records and adapter, and the event log.
`expected.json` says what was in it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from broker.schema import VERSION, SchemaError
from broker.store import Store
from tests.test_broker.inproc import swarm

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "broker-v1"


async def test_a_data_folder_from_the_previous_release_opens_with_everything_in_it(
    tmp_path: Path,
) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    shutil.copytree(FIXTURE, tmp_path / "broker")
    # git keeps no permissions but the executable bit: the key comes out of a clone 0644,
    # and a broker refuses a key others can read. A real data folder keeps its 0600.
    (tmp_path / "broker" / "identity.key").chmod(0o600)
    s = await swarm(tmp_path, microbatch=2)
    try:
        b = s.broker
        assert b.peer_id == expected["broker_peer"]  # the same identity: providers know it
        assert sorted(b.models.models) == expected["models"]
        for model in b.models.models.values():  # every artifact is found and intact
            for stage in model.manifest.stages:
                path = b.models.artifact_path(stage.sha256)
                assert path is not None, f"{model.name}: {stage.file} lost"
                assert hashlib.sha256(path.read_bytes()).hexdigest() == stage.sha256
            assert b.driver.core.plans[model.name].placement is not None  # restored
        unfinished = expected["queued_job"]
        for job, state in expected["jobs"].items():
            row = b.store.job(job)
            assert row is not None and (job == unfinished or row.state == state), (job, row)
        got = b.jobs.results(expected["embedding_job"], 0, 100).embeddings
        assert np.array_equal(np.array(got), np.array(expected["embeddings"]))
        steps = b.store.finetune_steps(expected["finetune_job"])
        assert [loss for _, losses in steps for loss in losses] == expected["finetune_losses"]
        adapter, row = b.finetunes.adapter_path(expected["finetune_job"])
        assert hashlib.sha256(adapter.read_bytes()).hexdigest() == row["sha256"]
        assert adapter == b.models.cache.path(row["sha256"])  # moved into the shared cache
        assert not list((tmp_path / "broker" / "adapters").glob("*.safetensors"))
        assert b.store.story(expected["embedding_job"])  # the event log is kept

        # The job the broker stopped runs once providers come back: its stored graph still runs.
        model = b.store.job(unfinished).model
        for _ in range(3):
            await s.provider()
        await s.elapse(b.config.grace_s + 2)  # the old providers' grace period ends: re-placed
        row = await s.until(
            "the queued job",
            lambda: (r := b.store.job(unfinished)) and r.state == "succeeded" and r,
            timeout=60,
        )
        rows = b.jobs.results(row.id, 0, 100).embeddings
        first = np.array(expected["embeddings"][:2])
        assert model == "tiny-bert" and np.allclose(np.array(rows), first, atol=1e-4)
    finally:
        await s.close()


def test_the_database_is_versioned_and_one_from_a_newer_broker_is_refused(tmp_path: Path) -> None:
    shutil.copy(FIXTURE / "broker.db", tmp_path / "broker.db")
    store = Store(tmp_path / "broker.db")  # written before versioning: taken as version 1
    assert store.db.execute("PRAGMA user_version").fetchone() == (VERSION,)
    assert len(store.jobs()) == 4
    store.db.execute(f"PRAGMA user_version = {VERSION + 1}")  # as a newer broker leaves it
    store.close()
    with pytest.raises(SchemaError, match=r"newer broker.*upgrade fusionai"):
        Store(tmp_path / "broker.db")
    fresh = Store(tmp_path / "new.db")
    assert fresh.db.execute("PRAGMA user_version").fetchone() == (VERSION,)
    fresh.close()
