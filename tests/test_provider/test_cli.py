"""`fusionai provider profile` and the start command's argument checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_profile_is_measured_once_then_cached(tmp_path: Path) -> None:
    first = _cli("provider", "profile", "--executor", "ort", "--data-dir", str(tmp_path), "--json")
    assert first.returncode == 0, first.stderr
    measured = json.loads(first.stdout)
    ort = measured["executors"][0]
    assert ort["executor"] == "ort" and ort["flops"]["float32"] > 1e8
    assert ort["mem_bandwidth"] > 1e8 and ort["memory_bytes"] >= ort["memory_free_bytes"] > 0
    again = _cli("provider", "profile", "--executor", "ort", "--data-dir", str(tmp_path), "--json")
    assert json.loads(again.stdout)["measured_at"] == measured["measured_at"]  # from the cache
    fresh = _cli(
        "provider", "profile", "--executor", "ort", "--data-dir", str(tmp_path), "--reprofile"
    )
    assert fresh.returncode == 0 and "TFLOP/s" in fresh.stdout
    assert (
        json.loads((tmp_path / "profile.json").read_bytes())["measured_at"]
        > measured["measured_at"]
    )


def test_start_refuses_bad_arguments_clearly(tmp_path: Path) -> None:
    bad_broker = _cli("provider", "start", "--broker", "/ip4/127.0.0.1/tcp/1")
    assert bad_broker.returncode == 2 and "/p2p/" in bad_broker.stderr
    addr = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    bad_fault = _cli("provider", "start", "--broker", addr, "--fault", "explode")
    assert bad_fault.returncode == 2 and "unknown fault" in bad_fault.stderr
    bad_peer = _cli("provider", "start", "--broker", "/ip4/127.0.0.1/tcp/1/p2p/notapeerid")
    assert bad_peer.returncode == 2 and "valid peer id" in bad_peer.stderr
    bad_memory = _cli("provider", "start", "--broker", addr, "--max-memory", "-1")
    assert bad_memory.returncode == 2 and "--max-memory must be positive" in bad_memory.stderr
    bad_slots = _cli("provider", "start", "--broker", addr, "--compute-slots", "0")
    assert bad_slots.returncode == 2 and "--compute-slots must be positive" in bad_slots.stderr
    bad_announce = _cli("provider", "start", "--broker", addr, "--announce", "1.2.3.4:5")
    assert bad_announce.returncode == 2 and "not a multiaddr" in bad_announce.stderr


def test_prefetch_puts_a_packages_provider_stages_in_the_cache(
    llama_package: Path, tmp_path: Path
) -> None:
    from files.cache import ArtifactCache
    from ir.manifest import ModelManifest

    manifest = ModelManifest.from_json((llama_package / "manifest.json").read_bytes())
    done = _cli("provider", "prefetch", str(llama_package), "--data-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    cache = ArtifactCache(tmp_path / "artifacts")
    assert not cache.check()  # every file verifies
    held = {p.name for p in (tmp_path / "artifacts" / "objects").iterdir()}
    assert held == {s.sha256 for s in manifest.stages if s.placement == "provider"}
    # a stage file that is not what the manifest says is refused, clearly
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in llama_package.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    stage = next(s for s in manifest.stages if s.placement == "provider")
    (bad / stage.file).write_bytes(b"not the stage")
    refused = _cli("provider", "prefetch", str(bad), "--data-dir", str(tmp_path / "other"))
    assert refused.returncode == 2 and "refused" in refused.stderr
    missing = _cli("provider", "prefetch", str(tmp_path / "none"), "--data-dir", str(tmp_path))
    assert missing.returncode == 2 and "not a model package" in missing.stderr
