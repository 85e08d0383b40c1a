"""The lab's fixtures: one lab (homes behind a cone, a symmetric and a UPnP router, and a
client's home behind another cone) for the module, a way to run the probes in its
namespaces, and a broker and providers started in them. Without root or the network tools
the lab tests are skipped with the reason, except under CI=true, where that is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.net import missing
from lab.topology import BROKER_IP, Lab
from tests.procs import ROOT, Proc, fusionai


def need_lab() -> None:
    why = missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the lab: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    need_lab()
    with Lab(["cone", "symmetric", "upnp", "cone"]) as built:  # the last: a client's home
        yield built


def probe(ns: str, *args: str, timeout: float = 60) -> Any:
    """`python -m lab.probe ARGS` in namespace `ns`; its JSON answer."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "lab.probe", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def serve(lab: Lab, ns: str, port: int) -> subprocess.Popen[str]:
    """The probe's UDP echo and TCP sink on `port` in `ns` (stopped with the lab)."""
    proc = lab.spawn(
        ns, sys.executable, "-m", "lab.probe", "serve", str(port),
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None and "ready" in proc.stdout.readline()
    return proc


def start_broker(lab: Lab, spawn: Callable[..., Proc], data: Path, *extra: str) -> tuple[Proc, str]:
    """A broker on the lab's broker host (p2p on port 7370, HTTP for the other hosts at
    http://BROKER_IP:7371); (its process, the multiaddr providers dial)."""
    proc = spawn(
        ["ip", "netns", "exec", lab.broker, *fusionai(
            "broker", "start", "--listen", "/ip4/0.0.0.0/tcp/7370", "--http", "0.0.0.0:7371",
            "--public-url", f"http://{BROKER_IP}:7371", "--data-dir", str(data),
            "--heartbeat-s", "1", "--json", *extra,
        )]
    )  # fmt: skip
    started = proc.wait_for("broker_started", timeout=60)
    return proc, f"/ip4/{BROKER_IP}/tcp/7370/p2p/{started['peer']}"


def start_provider(
    spawn: Callable[..., Proc], ns: str, broker: str, data: Path, *extra: str
) -> Proc:
    """A provider in namespace `ns` joining `broker` (2 GB of memory; `extra` flags)."""
    return spawn(
        ["ip", "netns", "exec", ns, *fusionai(
            "provider", "start", "--broker", broker, "--data-dir", str(data),
            "--max-memory", "2", "--json", *extra,
        )]
    )  # fmt: skip
