"""Pre-training through real processes over libp2p: `fusionai train` against a broker and
three providers; a replica SIGKILLed mid-run is dropped, the spare joins with the running
state read from the survivor, the run finishes with every step once and the losses of one
process, and the trained model generates through the swarm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import ROOT, Proc, fusionai, wait_until
from tests.test_broker.conftest import BrokerProc, add_model, api, wait_joined, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
Spawner = Callable[..., Any]
STEPS, SEQ, BATCH = 16, 32, 12


def test_train_through_processes_survives_a_sigkilled_replica(
    broker: Spawner, provider: Spawner, pretrain_package: Path, tmp_path: Path
) -> None:
    from ir.scratch import SHIPPED_DATA, Corpus, read_texts, tokenize
    from provider.localtrain import LocalRun, TrainSettings
    from tests.tiny_models import tokenizer_of

    b: BrokerProc = broker("--heartbeat-s", "1")
    procs: dict[str, Proc] = {}
    for _ in range(3):
        p = provider(b.addr)
        procs[p.wait_for("listening", timeout=60)["peer_id"]] = p
    wait_joined(b.http, procs)
    add_model(b.http, pretrain_package)
    wait_ready(b.http, "tiny")
    data = tmp_path / "data.jsonl"
    texts = read_texts(SHIPPED_DATA)[:20]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cli = subprocess.Popen(
        fusionai(
            "train", "--model", "tiny", "--data", str(data), "--steps", str(STEPS),
            "--replicas", "2", "--batch", str(BATCH), "--seq-len", str(SEQ),
            "--broker", b.http, "--json", "--timeout", "240",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "FUSIONAI_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    try:
        job = wait_until("the job", lambda: api(b.http, "GET", "/v1/jobs")[1]["jobs"], 60)[0]
        path = f"/v1/jobs/{job['id']}"
        wait_until("step 4", lambda: api(b.http, "GET", path)[1]["done"] >= 4, 120)
        story = api(b.http, "GET", path + "/story")[1]["events"]
        replicas = next(e for e in story if e["kind"] == "train_started")["replicas"]
        victim = replicas[0]
        procs[victim].proc.send_signal(signal.SIGKILL)
        out, err = cli.communicate(timeout=240)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    summary = json.loads(out)
    assert summary["steps"] == STEPS and summary["trained"] == f"tiny-{job['id']}"

    _, results = api(b.http, "GET", path + "/results")
    steps = results["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # no gap, no repeat
    corpus = Corpus(tokenize(texts, tokenizer_of(pretrain_package)), SEQ, holdout=0.05)
    settings = TrainSettings(steps=STEPS, batch=BATCH, seq_len=SEQ)
    expected = [r.loss for r in LocalRun(pretrain_package, corpus, 1, settings).run()]
    np.testing.assert_allclose([s["loss"] for s in steps], expected, rtol=1e-4)
    kinds = [e["kind"] for e in api(b.http, "GET", path + "/story")[1]["events"]]
    assert "train_replica_dropped" in kinds and "train_replica_joined" in kinds
    assert steps[-1]["replicas"] == 2 and all(s["bytes_sent"] > 0 for s in steps)

    # The trained model is served like any other. The two providers left may both serve
    # `tiny` (when the replica killed was its backup): then it waits for one to join.
    if api(b.http, "GET", f"/v1/models/{summary['trained']}")[1]["placed"] is False:
        provider(b.addr)
    wait_ready(b.http, summary["trained"])
    from client import Client

    with Client(b.http, cache_dir=tmp_path / "cache", timeout=60) as fa:
        out_ = fa.generate("The assert statement", 6, stream=False, model=summary["trained"])
    assert len(out_.tokens) == 6
