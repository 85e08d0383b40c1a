"""The broker's event log: every transition, with an id, kept (bounded) in SQLite.

A job's story is the events that name it; the swarm's is all of them. Each event is also
logged and handed to the sinks (the `--json` stdout printer, the metrics); streams wait
for the next one. Text fields never carry an artifact link's token (a provider's failure
reason may quote its link): it is redacted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from broker.schema import EventRow
from broker.store import Store
from files.private import redact

log = logging.getLogger("fusionai.broker")

Sink = Callable[[EventRow], None]


class EventLog:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.sinks: list[Sink] = []
        self._next = asyncio.Event()  # set by the next event (streams wait on it)

    def emit(
        self, kind: str, *, job: str | None = None, peer: str | None = None, **data: Any
    ) -> EventRow:
        data = {k: redact(v) if isinstance(v, str) else v for k, v in data.items()}  # (links)
        row = self.store.add_event(kind, data, job=job, peer=peer)
        log.info("%s %s", kind, json.dumps(row.to_json(), default=str, sort_keys=True))
        for sink in self.sinks:
            sink(row)
        self.wake()
        return row

    def wake(self) -> None:
        """Wake the streams waiting (an event, or something else they send, is new)."""
        self._next.set()
        self._next = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Until the next event is emitted, or `timeout` seconds."""
        try:
            await asyncio.wait_for(self._next.wait(), timeout)
        except TimeoutError:
            pass
