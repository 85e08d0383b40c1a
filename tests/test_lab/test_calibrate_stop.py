"""`fusionai sim calibrate --package`, stopped with SIGTERM while it times providers under CPU
quotas (root): it stops its broker and providers and removes its quota groups, as Ctrl-C
does. (It left both behind.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.cgroup import CGROUP_V1, CGROUP_V2
from tests.procs import ROOT
from tests.test_lab.conftest import need_lab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(240)]


def _groups(pid: int) -> list[Path]:
    base = CGROUP_V1 if CGROUP_V1.exists() else CGROUP_V2
    return sorted(base.glob(f"fusionai-calibrate-{pid}-*"))


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # (its parent)
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_terminated_calibration_leaves_no_provider_or_quota_behind(
    llama_package: Path, tmp_path: Path
) -> None:
    need_lab()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "sim", "calibrate", "--package", str(llama_package),
         "--count", "40", "--out", str(tmp_path / "c.json")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        end = time.monotonic() + 180
        while not _groups(proc.pid):  # the providers under quotas
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < end, "the calibration never put a provider under a quota"
            time.sleep(0.2)
        time.sleep(2)  # (its providers started)
        children = _children(proc.pid)
        assert len(children) >= 3, children  # a broker and two providers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        assert _groups(proc.pid) == []
        left = [c for c in children if _alive(c)]
        assert left == [], left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
