"""A child process that prints JSON event lines, for tests that start real processes."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Event = dict[str, Any]


class Proc:
    """A child process printing JSON lines on stdout; its events are collected in order."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "FUSIONAI_THREADS": "1", **(env or {})},
        )
        self.events: list[Event] = []
        self._new: queue.Queue[Event] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            self._new.put(event)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(
        self,
        name: str,
        pred: Callable[[Event], bool] = lambda e: True,
        timeout: float = 30.0,
        *,
        since: int = 0,
    ) -> Event:
        """The first event `name` for which `pred` holds, from the `since`-th event on (see
        `mark`), among those seen so far and those arriving."""
        for event in self.events[since:]:
            if event["event"] == name and pred(event):
                return event
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                event = self._new.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self._new.empty():
                    break
                continue
            self.events.append(event)
            if event["event"] == name and pred(event):
                return event
        raise AssertionError(
            f"no {name!r} event within {timeout} s from {self.args[-3:]}; events: "
            f"{[e['event'] for e in self.events][-20:]}; stderr: {''.join(self.stderr)[-2000:]}"
        )

    def mark(self) -> int:
        """A position in the event log: pass it as `since` to wait only for later events."""
        self.drain_events()
        return len(self.events)

    def drain_events(self) -> None:
        while not self._new.empty():
            self.events.append(self._new.get())

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """The first truthy value of `check()`, polled every 0.1 s for up to `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def fusionai(*args: str) -> list[str]:
    """The command line of `fusionai ARGS`, run by this interpreter from the repository."""
    return [sys.executable, "-m", "cli.main", *args]


def broker_command(
    data_dir: Path,
    *extra: str,
    port: int = 0,
    http_port: int = 0,
    heartbeat_s: float = 0.5,
    check_hardware: bool = False,
) -> list[str]:
    """A broker on 127.0.0.1 printing its events as JSON lines (microbatches of 8). It
    believes providers' hardware profiles unless `check_hardware` (`--trust-claims`: the check
    at join costs each provider a second of matmuls on this 2-core machine; its own tests,
    `tests/test_broker/test_challenge.py`, and the demo's run with it)."""
    return fusionai(
        "broker",
        "start",
        "--listen",
        f"/ip4/127.0.0.1/tcp/{port}",
        "--http",
        f"127.0.0.1:{http_port}",
        "--data-dir",
        str(data_dir),
        "--heartbeat-s",
        str(heartbeat_s),
        "--microbatch",
        "8",
        "--json",
        *(() if check_hardware else ("--trust-claims",)),
        *extra,
    )


_PROFILE: dict[str, bytes] = {}
_PROFILE_LOCK = threading.Lock()


def machine_profile() -> bytes:
    """This machine's hardware profile (`profile.json`) as a provider started by
    `provider_command` measures it (onnxruntime, one compute thread), measured once per test
    run by `fusionai provider profile`."""
    with _PROFILE_LOCK:
        if "json" not in _PROFILE:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(
                    fusionai("provider", "profile", "--executor", "ort", "--data-dir", tmp),
                    cwd=ROOT,
                    env={**os.environ, "FUSIONAI_THREADS": "1"},
                    capture_output=True,
                    check=True,
                    timeout=120,
                )
                _PROFILE["json"] = (Path(tmp) / "profile.json").read_bytes()
        return _PROFILE["json"]


def provider_command(
    broker_addr: str, data_dir: Path, *extra: str, measure: bool = False
) -> list[str]:
    """A provider daemon on 127.0.0.1 joining `broker_addr`, printing JSON event lines.

    A new `data_dir` is given this machine's profile, measured once per test run, as a
    restarted provider finds its own (providers that each measured the machine spent seconds
    of both cores on it, under the load of the others); `measure` leaves it to the provider.
    One started with another executor or device measures its own (the cached key differs)."""
    if not measure and not (data_dir / "profile.json").exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "profile.json").write_bytes(machine_profile())
    return fusionai(
        "provider",
        "start",
        "--broker",
        broker_addr,
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--json",
        *extra,
    )


def sample_texts(n: int) -> list[str]:
    return [f"text {i}: gaming PCs serving {i % 7} stages to strangers" for i in range(n)]


# runs a command as its child (inside a cgroup, if one is named) and reports the child's peak RSS
_MEASURED = """
import json, os, resource, subprocess, sys
group = sys.argv[1]
def enter():
    if group:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
done = subprocess.run(sys.argv[2:], preexec_fn=enter, capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": done.returncode, "peak": peak, "err": done.stderr[-2000:]}))
"""


def run_measured(
    command: list[str], *, group: Path | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run `command` from the project root; `{"rc", "peak" (bytes of RSS), "err"}`."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, str(group or ""), *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
