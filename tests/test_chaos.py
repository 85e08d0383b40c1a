"""The chaos run (`tests/chaos.py`) as a slow test: every job succeeds with single-process
output while providers are killed and frozen and the broker restarts once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_chaos_run_loses_nothing(
    minilm_package: Path, finetune_package: Path, tmp_path: Path
) -> None:
    from tests.chaos import run_chaos

    summary = run_chaos(minilm_package, finetune_package, tmp_path, seed=1, jobs=100)
    print(json.dumps(summary))
    assert summary["jobs"] == 100
    assert summary["succeeded"] == 100, summary["problems"]
    assert summary["failed"] == summary["lost"] == summary["mismatches"] == 0
    assert summary["kills"] >= 1 and summary["stops"] >= 1 and summary["broker_restarts"] == 1
