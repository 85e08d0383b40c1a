"""The service's side of the decision core: feed it events, carry out its actions, in order.

Every part of the broker that hears something (the registry: joins, heartbeats; serving:
stage reports; the job runner: jobs) hands it to `CoreDriver.handle` as an event stamped by
the broker's clock; the actions that come back go to the carriers registered for their type
(`carry`), which only do what they are told (send a message, persist a placement, start a
job). With a trace file, every call is recorded for replay (`broker.core.trace`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from broker.core import Core
from broker.core import trace as core_trace
from broker.core.actions import Action
from broker.core.events import Input

log = logging.getLogger("fusionai.broker")
A = TypeVar("A", bound=Action)


class CoreDriver:
    def __init__(self, core: Core, trace: Path | None = None, note: str = "") -> None:
        self.core = core
        self._carriers: dict[type, list[Callable[[Any], object]]] = {}
        self._after: list[Callable[[], None]] = []
        self._handling = False
        self.stopped = False
        self._trace: IO[bytes] | None = None
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a broker killed mid-run leaves whole lines. A restarted broker appends
            # a run of its own.
            self._trace = trace.open("ab", buffering=0)
            self._trace.write(core_trace.header(core.config, note))

    def carry(self, kind: type[A], fn: Callable[[A], object]) -> None:
        """Carry out every action of type `kind` with `fn` (in registration order)."""
        self._carriers.setdefault(kind, []).append(fn)

    def after(self, fn: Callable[[], None]) -> None:
        """Call `fn` after each event's actions were carried out (e.g. wake route waiters)."""
        self._after.append(fn)

    def stop(self) -> None:
        """Decide nothing more: the broker is shutting down. Events handed in from now on
        (jobs cancelled, providers unreachable on the way out) are dropped, so what was
        persisted before is what a restart restores."""
        self.stopped = True

    def handle(self, event: Input) -> list[Action]:
        if self.stopped:
            return []
        if self._handling:  # a carrier must not decide again while actions are carried out
            raise RuntimeError(f"{type(event).__name__} handed to the core from inside a carrier")
        self._handling = True
        try:
            actions = self.core.handle(event)
            if self._trace is not None:
                self._trace.write(core_trace.step(event, actions))
            for action in actions:
                for carrier in self._carriers.get(type(action), ()):
                    # The core has decided: one carrier failing (a full disk, a closed
                    # socket) must not keep the others from carrying out its decisions.
                    try:
                        carrier(action)
                    except Exception:
                        log.exception("carrying out %s failed", type(action).__name__)
        finally:
            self._handling = False
            for after in self._after:
                after()
        return actions

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
