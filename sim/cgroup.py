"""A CPU quota for a group of processes (Linux cgroups, as root): what the home-internet lab
caps its providers with (`lab.scenario`), and what `fusionai sim calibrate` measures a
provider under, so that the simulator knows what a quota costs; and a process's CPU seconds.

    quota = Quota("name", 0.3)                     # 0.3 of a core, in slices of QUOTA_SLICE_S
    subprocess.Popen(["sh", "-c", f"echo $$ > {quota.procs} && exec ..."])
    quota.close()                                  # once its processes have exited
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sim.labscenario import QUOTA_SLICE_S

CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
# The shortest slices the kernel allows: a quota of 1 ms (its least) each 1 ms / cores. A
# burst of work runs its first slice at full speed, then at the share (`sim.fidelity`).
QUOTA_US = round(QUOTA_SLICE_S * 1e6)


class Quota:
    """A cgroup capping its processes at `cores` CPUs; removed by `close()`."""

    def __init__(self, name: str, cores: float) -> None:
        period = max(QUOTA_US, min(1_000_000, round(QUOTA_US / cores)))
        quota = max(QUOTA_US, round(cores * period))
        if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
            self.path = CGROUP_V1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif (CGROUP_V2 / "cgroup.controllers").exists():
            self.path = CGROUP_V2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        else:
            raise OSError("no cgroup cpu controller (v1 or v2) to cap processes with")

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) under this quota."""
        self.procs.write_text(str(pid))

    def release(self, pid: int) -> None:
        """Move process `pid` back out, to the root group (no quota)."""
        (self.path.parent / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> tuple[int, float]:
        """(periods in which it was throttled, seconds throttled) so far (`cpu.stat`)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        if "throttled_time" in stat:  # v1: nanoseconds
            return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9
        return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_usec", 0)) / 1e6

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # its processes are still exiting


def available() -> str | None:
    """Why a quota cannot be made here, or None."""

    if os.geteuid() != 0:
        return "not root"
    v1, v2 = CGROUP_V1 / "cpu.cfs_quota_us", CGROUP_V2 / "cgroup.controllers"
    if not (v1.exists() or v2.exists()):
        return "no cgroup cpu controller"
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds process `pid` has used (all its threads), or None once it is gone: its
    threads' run time to the nanosecond (`schedstat`); or the process's total in clock ticks
    (`stat`) where that is more (its exited threads' time, which only the total keeps) or the
    kernel keeps no `schedstat`. The total is cut down to whole ticks, 10 ms: in a reading of
    a provider's CPU per token over some 60 tokens, a few percent."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    threads = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ticks
    for tid in tids:
        try:
            threads += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue  # (that thread has just exited)
        except (OSError, ValueError, IndexError):
            return ticks  # (no schedstat here)
    return max(ticks, threads / 1e9)
