"""An embedding job across the home internet: providers behind the cone, the symmetric and
the UPnP routers join, are reported relayed, relayed and mapped, and all three serve a batch
job submitted from a fourth home, whose embeddings equal a local run's."""

from __future__ import annotations

import base64
import json
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from lab.topology import BROKER_IP, Lab
from tests.procs import Proc, sample_texts
from tests.test_broker.conftest import local_embeddings
from tests.test_lab.conftest import start_broker, start_provider

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def minilm3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 cut into 3 provider stages: one for each home's provider."""
    from cli.demo_models import build_minilm

    out = tmp_path_factory.mktemp("minilm3")
    build_minilm(out, 3)
    return out


CLIENT = """
import base64, json, sys, time
from client import Client
with Client(sys.argv[1], timeout=60) as fa:
    fa.add_model(sys.argv[2])
    end = time.monotonic() + 180
    while not fa.model("minilm").ready:
        assert time.monotonic() < end, "the model was never served"
        time.sleep(0.5)
    job = fa.submit({"model": "minilm", "texts": json.loads(sys.argv[3]), "microbatch": 4})
    assert fa.wait(job.id, timeout=120).state == "succeeded"
    got = fa.results(job.id).astype("<f4")
    print(json.dumps({"job": job.id, "shape": got.shape, "data": base64.b64encode(got).decode()}))
"""


def test_providers_behind_each_router_kind_serve_an_embedding_job(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path, minilm3: Path
) -> None:
    broker, addr = start_broker(lab, spawn, tmp_path / "broker")
    expect = {}
    for home, reach in zip(lab.homes[:3], ("relayed", "relayed", "mapped"), strict=True):
        # Room for one stage each: the placement counts 77 MB for one (14 MB of weights and a
        # 50 MB workspace for 32 x 128 tokens, times 1.2) and 95 MB for two, and 0.08 GiB is
        # 86 MB. With room for more, a loaded machine's join measurements can make the
        # placement put two stages on one provider and keep the third as a backup, which then
        # computes nothing.
        proc = start_provider(spawn, home.host, addr, tmp_path / home.kind, "--listen",
                              "/ip4/0.0.0.0/tcp/4900", "--max-memory", "0.08")  # fmt: skip
        expect[proc.wait_for("listening", timeout=120)["peer_id"]] = reach
    for peer, reach in expect.items():
        seen = broker.wait_for(
            "provider_reach", lambda e, p=peer: e["peer"] == p and e["reach"] != "unreachable",
            timeout=120, since=0,
        )  # fmt: skip
        assert seen["reach"] == reach, seen

    texts = sample_texts(24)
    out = lab.run(lab.homes[3].host, sys.executable, "-c", CLIENT, f"http://{BROKER_IP}:7371",
                  str(minilm3), json.dumps(texts), timeout=240)  # fmt: skip
    answer = json.loads(out.strip().splitlines()[-1])
    got = np.frombuffer(base64.b64decode(answer["data"]), "<f4").reshape(answer["shape"])
    assert np.abs(got - local_embeddings(minilm3, texts)).max() <= 1e-4
    with sqlite3.connect(tmp_path / "broker" / "broker.db") as db:  # who computed what
        rows = db.execute("SELECT DISTINCT peer FROM work WHERE job = ?", (answer["job"],))
        assert {peer for (peer,) in rows} == set(expect)
