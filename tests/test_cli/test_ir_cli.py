"""`fusionai ir split` and `fusionai ir inspect` on the packaged MiniLM model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def _fusionai(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=280
    )


@pytest.mark.timeout(300)
def test_split_then_inspect_minilm(tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    split = _fusionai("ir", "split", "minilm", "--stages", "2", "--out", str(out), "--json")
    assert split.returncode == 0, split.stderr
    manifest = json.loads(split.stdout)
    assert [s["placement"] for s in manifest["stages"]] == [
        "client",
        "provider",
        "provider",
        "client",
    ]
    assert manifest["tokenizer"] and (out / manifest["tokenizer"]).is_file()
    shown = _fusionai("ir", "inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "all files verified" in shown.stdout and "layers.3-5" in shown.stdout
    # A damaged file is reported, not run.
    stage = out / manifest["stages"][1]["file"]
    stage.write_bytes(stage.read_bytes()[:-10])
    bad = _fusionai("ir", "inspect", str(out))
    assert bad.returncode == 1 and "SHA-256" in bad.stderr


def test_split_of_an_onnx_file_needs_cuts(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"")
    run = _fusionai("ir", "split", str(tmp_path / "m.onnx"), "--out", str(tmp_path / "o"))
    assert run.returncode == 2 and "--cut" in run.stderr
