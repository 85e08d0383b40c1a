"""`fusionai job submit --wait` through a real broker's restart (SIGKILL, then the same data
directory and ports): the command goes on waiting and ends with the job's results, and with a
broker that never comes back it gives up within its --timeout in one line. Real broker and
provider processes; slow (`test_retry.py` checks the same logic in the default suite)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import ROOT, fusionai, sample_texts
from tests.test_broker.conftest import (
    BrokerProc,
    add_model,
    free_port,
    local_embeddings,
    wait_joined,
    wait_ready,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
Spawner = Callable[..., Any]


def _submit(http: str, texts: Path, timeout: float, *extra: str) -> subprocess.Popen[str]:
    command = fusionai(
        "job", "submit", "--model", "minilm", "--texts", str(texts), "--microbatch", "8",
        "--wait", "--broker", http, "--timeout", str(timeout), *extra,
    )  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_job_submit_wait_rides_through_a_broker_restart_with_every_result_once(
    broker: Spawner, provider: Spawner, minilm_package: Path, tmp_path: Path
) -> None:
    data, port, http_port = tmp_path / "broker-data", free_port(), free_port()
    b: BrokerProc = broker(data_dir=data, port=port, http_port=http_port)
    peer = provider(b.addr).wait_for("listening", timeout=60)["peer_id"]
    wait_joined(b.http, [peer])
    add_model(b.http, minilm_package)
    wait_ready(b.http, "minilm")
    batch = sample_texts(240)
    (tmp_path / "texts.txt").write_text("\n".join(batch))
    cli = _submit(b.http, tmp_path / "texts.txt", 180, "--json")
    try:
        b.proc.wait_for("job_progress", timeout=120)
        b.proc.signal(signal.SIGKILL)
        b.proc.wait(timeout=10)
        time.sleep(1.0)  # the command meets a closed port for a while
        again: BrokerProc = broker(data_dir=data, port=port, http_port=http_port)
        out, err = cli.communicate(timeout=180)
    finally:
        cli.kill()
    assert cli.returncode == 0, err
    assert "Traceback" not in err
    job = json.loads(out)
    assert job["state"] == "succeeded" and job["done"] == job["microbatches"] == 30
    again.proc.wait_for("job_resumed", lambda e: e["job"] == job["id"], timeout=5)
    done = subprocess.run(
        fusionai("job", "results", job["id"], "--broker", again.http),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows["total"] == len(rows["embeddings"]) == 240
    got = np.array(rows["embeddings"], dtype=np.float32)
    assert np.abs(got - local_embeddings(minilm_package, batch)).max() <= 1e-4


def test_job_submit_wait_gives_up_in_one_line_when_the_broker_does_not_come_back(
    broker: Spawner, minilm_package: Path, tmp_path: Path
) -> None:
    b: BrokerProc = broker()
    add_model(b.http, minilm_package)  # no provider: the job stays queued
    (tmp_path / "texts.txt").write_text("one\ntwo\n")
    start = time.monotonic()
    cli = _submit(b.http, tmp_path / "texts.txt", 6)
    try:
        assert cli.stderr is not None
        progress = ""
        while "queued" not in progress:  # its first progress line: the job is being waited for
            progress += cli.stderr.read(1) or pytest.fail(f"the command ended: {progress}")
        b.proc.signal(signal.SIGKILL)
        out, err = cli.communicate(timeout=30)
    finally:
        cli.kill()
    assert cli.returncode == 1 and out == "" and "Traceback" not in err
    *_, last = err.strip().splitlines()  # after the progress line
    assert err.count("error:") == 1 and last.startswith("error: cannot reach the broker"), err
    assert "--timeout" in last
    assert time.monotonic() - start < 6 + 10
