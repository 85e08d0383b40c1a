"""A small discrete-event engine on a virtual clock, deterministic for a given event order.

Events are (time, sequence number, callback): ties run in the order they were scheduled, so a
run depends only on its inputs and seed. A heap of our own is faster than simpy for this
workload (no generators per process) and is all the simulator needs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Engine:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at virtual `time` (not earlier than now)."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} s, before now ({self.now} s)")
        heapq.heappush(self._queue, (time, self._seq, fn, args))
        self._seq += 1

    def run(self, until: float, on_progress: Callable[[float], None] | None = None) -> None:
        """Run events up to `until` seconds; `on_progress(now)` after each event."""
        while self._queue and self._queue[0][0] <= until:
            time, _, fn, args = heapq.heappop(self._queue)
            self.now = time
            fn(*args)
            self.events_run += 1
            if on_progress is not None:
                on_progress(time)
        self.now = until
