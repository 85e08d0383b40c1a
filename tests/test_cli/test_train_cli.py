"""`fusionai ir init` and `fusionai train --local`: a package from scratch, trained by three
replicas with ACP-SGD, saved, and bad requests refused with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(200)


def _fusionai(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=180
    )


@pytest.mark.slow  # (7 s: the suite runs near its budget)
def test_init_then_train_three_replicas_and_save(tmp_path: Path) -> None:
    pkg, out = tmp_path / "tiny", tmp_path / "trained"
    made = _fusionai("ir", "init", "--config", "llama-tiny", "--out", str(pkg), "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["tokenizer"]
    args = ["train", "--model", str(pkg), "--steps", "6", "--replicas", "3", "--batch", "6"]
    args += ["--seq-len", "32", "--compress", "acp", "--local", "--json", "--out", str(out)]
    done = _fusionai(*args)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["steps"] == 6 and summary["replicas"] == 3
    assert summary["loss"] < summary["first_loss"]
    assert summary["compression"] > 10  # ACP-SGD at rank 4 on this model
    shown = _fusionai("ir", "inspect", summary["package"])
    assert shown.returncode == 0 and "all files verified" in shown.stdout, shown.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compress", "acp", "--rank", "0"], "rank must be from 1"),
        (["--replicas", "13"], "cannot be shared by 13 replicas"),
        (["--data", "/nonexistent/corpus.jsonl"], "cannot read /nonexistent/corpus.jsonl"),
        (["--steps", "0"], "steps must be at least 1"),
    ],
)
def test_bad_requests_are_refused_before_anything_runs(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    done = _fusionai("train", "--model", str(tmp_path), "--local", *extra)
    assert done.returncode == 1 and message in done.stderr, done.stderr


def test_an_unknown_compressor_and_a_missing_data_file_are_refused(tmp_path: Path) -> None:
    unknown = _fusionai("train", "--model", str(tmp_path), "--compress", "zip", "--local")
    assert unknown.returncode == 2 and "invalid choice: 'zip'" in unknown.stderr
    missing = tmp_path / "nothing.jsonl"  # refused before the broker is asked anything
    swarm = _fusionai("train", "--model", "m", "--data", str(missing), "--broker", "http://x")
    assert swarm.returncode == 1 and f"cannot read {missing}" in swarm.stderr
