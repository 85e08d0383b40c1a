"""The lab's fixtures: one lab (homes behind a cone, a symmetric and a UPnP router, and a
client's home behind another cone) for the module, and a way
to run the probes in its namespaces. Without root or the network tools the lab tests are
skipped with the reason, except under CI=true, where that is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from lab.net import missing
from lab.topology import Lab
from tests.procs import ROOT


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
