"""Real processes for the provider tests: a broker stand-in and provider daemons."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.procs import Proc, provider_command

STANDIN = Path(__file__).with_name("standin.py")


@pytest.fixture
def standin(spawn: Callable[..., Proc], tmp_path: Path) -> Callable[..., Proc]:
    def _standin(package: Path, *extra: str, data_dir: Path | None = None) -> Proc:
        data = data_dir or tmp_path / f"broker-{len(list(tmp_path.glob('broker-*')))}"
        proc = spawn(
            [
                sys.executable,
                str(STANDIN),
                "--package",
                str(package),
                "--data-dir",
                str(data),
                *extra,
            ]
        )
        proc.wait_for("ready", timeout=30)
        return proc

    return _standin


@pytest.fixture
def provider(spawn: Callable[..., Proc], tmp_path: Path) -> Callable[..., Proc]:
    def _provider(
        broker: Proc, *extra: str, data_dir: Path | None = None, env: dict[str, str] | None = None
    ) -> Proc:
        addr = broker.wait_for("ready")["addr"]
        data = data_dir or tmp_path / "provider"
        return spawn(provider_command(addr, data, "--drain", "10", *extra), env)

    return _provider
