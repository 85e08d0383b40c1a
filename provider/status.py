"""What a running provider tells `fusionai provider status`: a small JSON file in its data
directory (`status.json`), rewritten every few seconds and at every change of state.

It says what the provider serves, its pool and reachability as the broker last said, and the
work it did: tokens it ran through its stages, requests, hours in the pool and hours holding
an active stage, for this run and for every run on this data directory (the totals carry
over from the file the previous run left).
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import msgspec

from files.atomic import write_atomic

STATUS_FILE = "status.json"
STALE_S = 30.0  # a file not rewritten for this long belongs to a provider that is gone


class Totals(msgspec.Struct):
    tokens: int = 0  # token positions run through this provider's stages (batch x sequence)
    requests: int = 0  # stage runs (forward passes and generation steps)
    online_s: float = 0.0  # seconds in the broker's pool (joined, not paused)
    serving_s: float = 0.0  # seconds holding an active (not standby) stage

    def plus(self, other: Totals) -> Totals:
        return Totals(
            self.tokens + other.tokens,
            self.requests + other.requests,
            self.online_s + other.online_s,
            self.serving_s + other.serving_s,
        )


class StageRole(msgspec.Struct):
    key: str
    role: str  # "active" or "backup"


class Status(msgspec.Struct):
    pid: int
    broker: str
    started_at: float  # unix time
    updated_at: float  # unix time
    state: str  # "starting", "joining", "serving", "draining", "paused", "stopped"
    reason: str = ""  # why it is paused (or stopped)
    peer_id: str = ""
    pool: str = ""  # "active", "backup", "draining", as the broker last said; "" unknown
    reach: str = ""  # "direct", "mapped", "relayed", "unreachable", as the broker checked
    stages: list[StageRole] = msgspec.field(default_factory=list)
    run: Totals = msgspec.field(default_factory=Totals)  # this process
    total: Totals = msgspec.field(default_factory=Totals)  # every run on this data directory


class Ledger:
    """Hours in the pool and serving, counted between `tick`s by the caller's clock."""

    def __init__(self) -> None:
        self.online_s = 0.0
        self.serving_s = 0.0
        self._last: float | None = None

    def tick(self, now: float, online: bool, serving: bool) -> None:
        if self._last is not None:
            step = max(0.0, now - self._last)
            self.online_s += step if online else 0.0
            self.serving_s += step if online and serving else 0.0
        self._last = now


def read(data_dir: Path) -> Status | None:
    """The status file in `data_dir`, or None if there is none (or it cannot be read)."""
    try:
        return msgspec.json.decode((data_dir / STATUS_FILE).read_bytes(), type=Status)
    except (OSError, msgspec.DecodeError):
        return None


def write(data_dir: Path, status: Status) -> None:
    write_atomic(data_dir / STATUS_FILE, msgspec.json.encode(status), sync=False)


def running(status: Status, now: float | None = None) -> bool:
    """Whether the process that wrote `status` still runs and still writes it."""
    import psutil

    now = time.time() if now is None else now
    if status.state == "stopped" or now - status.updated_at > STALE_S:
        return False
    return bool(psutil.pid_exists(status.pid))


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def describe(status: Status, alive: bool, service: str | None = None) -> str:
    """The status as lines for a person."""
    seen = datetime.datetime.fromtimestamp(status.updated_at).isoformat(sep=" ")[:19]
    state = status.state if alive else f"not running (last seen {seen}: {status.state})"
    if status.reason:
        state += f", {status.reason}"
    stages = ", ".join(f"{s.key} ({s.role})" for s in status.stages) or "none"
    run, total = status.run, status.total
    lines = [
        f"provider   {state}",
        f"peer id    {status.peer_id or '-'}",
        f"broker     {status.broker}",
        f"pool       {status.pool or 'unknown'}",
        f"reach      {status.reach or 'unknown'}",
        f"stages     {stages}",
        f"this run   {run.tokens} tokens, {run.requests} requests, "
        f"{_hours(run.online_s)} in the pool, {_hours(run.serving_s)} serving",
        f"all runs   {total.tokens} tokens, {total.requests} requests, "
        f"{_hours(total.online_s)} in the pool, {_hours(total.serving_s)} serving",
    ]
    if service:
        lines.append(f"service    {service}")
    return "\n".join(lines)
