"""Identity: made once, stored 0600, reloaded to the same peer id, one process at a time."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from p2p import Host, HostConfig, Identity, IdentityError, IdentityInUse, verify
from p2p.identity import KEY_FILE, peer_id_from_public_key, public_key_from_peer_id

pytestmark = pytest.mark.timeout(60)


def test_reload_gives_the_same_peer_id_and_the_key_file_is_0600(tmp_path: Path) -> None:
    with Identity.load_or_create(tmp_path) as first:
        peer_id = first.peer_id
    assert peer_id.startswith("12D3KooW")
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    with Identity.load_or_create(tmp_path) as second:
        assert second.peer_id == peer_id
        assert second.key_path == tmp_path / KEY_FILE


def test_data_dir_env_var_chooses_the_directory(tmp_path: Path) -> None:
    env = {**os.environ, "FUSIONAI_DATA_DIR": str(tmp_path / "from-env")}
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "p2p", "id", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert str(tmp_path / "from-env" / KEY_FILE) in out
    assert (tmp_path / "from-env" / KEY_FILE).exists()


def test_a_second_process_on_the_same_data_dir_gets_a_clear_error(tmp_path: Path) -> None:
    with Identity.load_or_create(tmp_path):
        other = subprocess.run(
            [sys.executable, "-m", "cli.main", "p2p", "id", "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert other.returncode == 1
    assert "another FusionAI process is using the identity" in other.stderr
    assert "--data-dir" in other.stderr
    # Once released, the next process gets in.
    again = subprocess.run(
        [sys.executable, "-m", "cli.main", "p2p", "id", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr


def test_lock_is_exclusive_within_a_process_too(tmp_path: Path) -> None:
    with Identity.load_or_create(tmp_path), pytest.raises(IdentityInUse):
        Identity.load_or_create(tmp_path)


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path).close()
    os.chmod(tmp_path / KEY_FILE, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)


def test_a_corrupt_key_is_refused_with_advice(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path).close()
    (tmp_path / KEY_FILE).write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="cannot read the identity key"):
        Identity.load_or_create(tmp_path)
    # The lock was released despite the failure.
    (tmp_path / KEY_FILE).unlink()
    Identity.load_or_create(tmp_path).close()


def test_signatures_verify_against_the_peer_id_and_domain() -> None:
    ident = Identity.ephemeral()
    sig = ident.sign(b"hello", domain="fusionai/test/1")
    assert verify(ident.peer_id, b"hello", sig, domain="fusionai/test/1")
    assert not verify(ident.peer_id, b"hellO", sig, domain="fusionai/test/1")
    assert not verify(ident.peer_id, b"hello", sig, domain="fusionai/other/1")
    assert not verify(Identity.ephemeral().peer_id, b"hello", sig, domain="fusionai/test/1")
    assert not verify("not-a-peer-id", b"hello", sig, domain="fusionai/test/1")
    assert not verify(ident.peer_id, b"hello", b"short", domain="fusionai/test/1")


def test_peer_id_round_trips_through_the_public_key() -> None:
    ident = Identity.ephemeral()
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key
    assert peer_id_from_public_key(ident.public_key) == ident.peer_id
    with pytest.raises(ValueError):
        public_key_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")


async def test_the_host_announces_the_stored_identity(tmp_path: Path) -> None:
    config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), data_dir=tmp_path)
    async with Host(config) as host:
        first = host.peer_id
        assert host.addrs[0].endswith(f"/p2p/{first}")
        with pytest.raises(IdentityInUse):
            Identity.load_or_create(tmp_path)
    async with Host(config) as host:
        assert host.peer_id == first
