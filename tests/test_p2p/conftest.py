"""Fixtures for the p2p tests: real hosts on 127.0.0.1 with OS-chosen ports."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from p2p import Host
from p2p.testing import LOCAL, serve_test_protocols


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Host, Host, str]]:
    """A serving host and a client host connected to it: (server, client, server's peer id)."""
    async with Host(LOCAL) as server, Host(LOCAL) as client:
        serve_test_protocols(server)
        peer = await client.connect(server.addrs[0])
        yield server, client, peer


@pytest.fixture
def remote_peer() -> Iterator[dict[str, object]]:
    """A peer serving the test protocols in another process: {"peer_id", "addrs"}."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2p.testing"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the peer process exited with {proc.wait(timeout=10)}"
        yield json.loads(line)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
