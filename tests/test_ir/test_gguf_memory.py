"""`fusionai ir split` of a GGUF model (its Q8_0 blocks kept as int8 stages) stays within twice
its largest stage's float32 size plus 1 GB, on a model over four times that bound, under a
memory limit where this machine allows one (a cgroup), and by its peak resident size in any
case."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.gguf_files import write_large
from tests.procs import run_measured

pytest.importorskip("gguf")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
GB = 10**9


def memory_cgroup(limit: int) -> Path | None:
    """A cgroup (v1 memory controller) limited to `limit` bytes, if this machine lets us."""
    group = Path("/sys/fs/cgroup/memory") / f"fusionai-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError:
        if group.exists():
            group.rmdir()
        return None
    return group


def test_a_gguf_split_holds_one_stage_s_weights_at_a_time(tmp_path: Path) -> None:
    layers, stages = 80, 40
    path = tmp_path / "large.gguf"
    model_bytes = write_large(path, layers=layers, hidden=1024, intermediate=4096)
    per_stage = 4 * (layers // stages) * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024)
    bound = 2 * per_stage + GB
    assert model_bytes >= 4 * bound, "the model must be over four times the bound"
    group = memory_cgroup(bound)
    out = tmp_path / "pkg"
    split = [sys.executable, "-m", "cli.main", "ir", "split", str(path)]
    split += ["--stages", str(stages), "--out", str(out), "--json"]
    try:
        result = run_measured(split, group=group, timeout=540)
    finally:
        if group is not None:
            group.rmdir()
    assert result["rc"] == 0, result["err"]
    manifest = json.loads((out / "manifest.json").read_bytes())
    provider = [s for s in manifest["stages"] if s["placement"] == "provider"]
    assert len(provider) == stages and {s["weight_dtype"] for s in provider} == {"int8"}
    # the file's Q8_0 blocks stay 8-bit: each stage is about 0.28 of its float32 size
    assert all(s["size_bytes"] < 0.3 * per_stage for s in provider)
    assert result["peak"] <= bound, (
        f"peak RSS {result['peak'] / 1e6:.0f} MB over {bound / 1e6:.0f} MB"
    )
