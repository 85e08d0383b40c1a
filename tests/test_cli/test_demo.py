"""`fusionai demo` (a whole swarm on this machine) and the command line's help and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(400)
def test_demo_reports_the_failover_and_leaves_no_process(tmp_path: Path) -> None:
    """`fusionai demo --json`: embeddings equal the local model's, the generation equals an
    uninterrupted local run although one provider died mid-answer, and every process the
    demo started is gone once it exits."""
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=380,
        env={**os.environ, "FUSIONAI_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["embeddings"]["max_abs_diff_vs_local"] <= 1e-4
    assert summary["generation"]["matches_local"] is True
    assert summary["generation"]["tokens"] > 10
    failover = summary["failover"]
    assert failover["happened"] is True
    # (one event per decoder stage the dead provider served: one or two)
    assert {d["peer_id"] for d in failover["died"]} == {e["peer_id"] for e in failover["events"]}
    assert len(failover["died"]) == 1 and failover["died"][0]["exit_code"] == 137
    assert len(summary["providers"]) == 4
    assert sum(not p["running"] for p in summary["providers"]) == 1
    assert summary["dashboard"].startswith("http://127.0.0.1:")
    assert len(summary["processes"]) == 5  # the broker and four providers
    for pid in summary["processes"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "When a provider dies" in run.stderr  # the streamed text, for people watching


def test_help_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for command in ("demo", "p2p", "embed", "generate", "swarm", "broker", "provider", "job"):
        assert command in out


def test_ping_to_a_bad_address_fails_clearly(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "p2p",
            "ping",
            "nonsense",
            "--count",
            "1",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "not a peer multiaddr" in run.stderr
