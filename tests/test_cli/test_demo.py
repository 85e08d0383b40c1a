"""`fusionai demo` starts two peers as separate processes and reports a measured round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_demo_prints_two_peer_ids_and_a_round_trip() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "demo", "--json", "--count", "50"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["peer_a"].startswith("12D3KooW") and summary["peer_b"].startswith("12D3KooW")
    assert summary["peer_a"] != summary["peer_b"]
    assert summary["pings"] == 50
    assert 0 < summary["rtt_p50_ms"] <= summary["rtt_p99_ms"] < 1000


def test_help_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for command in ("demo", "p2p"):
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
