"""The provider's structured events: one log line each (the name and its fields as JSON),
also handed to any sink added (`fusionai provider start --json` prints them)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

log = logging.getLogger("fusionai.provider")

EventSink = Callable[[dict[str, Any]], None]
_sinks: list[EventSink] = []


def add_event_sink(sink: EventSink) -> None:
    """Also hand every event (a dict with "event", "t" and its fields) to `sink`."""
    _sinks.append(sink)


def remove_event_sink(sink: EventSink) -> None:
    """Stop handing events to `sink` (added before)."""
    _sinks.remove(sink)


def event(name: str, **fields: Any) -> None:
    """A structured log line: the event name and its fields as JSON."""
    log.info("%s %s", name, json.dumps(fields, default=str, sort_keys=True))
    for sink in _sinks:
        sink({"event": name, "t": round(time.time(), 3), **fields})


def throttled_progress(label: str) -> Callable[[int, int], None]:
    """A download progress callback that reports at most once a second, and the end."""
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 1.0:
            return
        last[0] = now
        event("download", stage=label, done=done, total=total)

    return report


DISTRIBUTIONS = ("fusionai", "fusionai-cuda", "fusionai-directml")  # one per onnxruntime build


def version() -> str:
    for dist in DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "0+unknown"


def onnxruntime_distributions() -> list[str]:
    """The onnxruntime packages installed (CPU, CUDA and DirectML builds share one module)."""
    found = []
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def two_runtimes(runtimes: list[str]) -> str:
    """Why a provider refuses to start with several onnxruntime builds, and what to do."""
    return (
        f"several onnxruntime builds are installed ({', '.join(runtimes)}); they share one "
        "module and overwrite each other's files, so which one runs is an accident. Keep "
        f"one: pip uninstall -y {' '.join(runtimes)}, then install the distribution for "
        "your hardware again: fusionai (CPU), fusionai-cuda (NVIDIA) or fusionai-directml "
        "(Windows, any GPU)"
    )
