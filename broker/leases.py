"""Fair admission of interactive work across every gateway: a lease per request in progress.

Each completion, chat or embeddings request holds a lease from its start to its end, taken
by the gateway serving it (the broker's own, or a `fusionai gateway` process) before any work.
A lease is refused (`TooBusy`: 429 with `Retry-After`) when
- its key has `max_streams` leases already, or started `per_minute` in the last minute
  (`Retry-After`: until the oldest of those leaves the minute), or
- it opens a generation session, and its model has as many sessions as its providers have
  batch slots: the sum of `max_batch` over
  the providers serving its stages (a pipeline of n stages keeps n batches in flight, one per
  stage). A model whose providers announce no batch size is not limited here.
Requests already admitted are never cut: new ones wait outside, so streams keep their pace.

A remote gateway's leases lapse `ttl_s` after its last report (a gateway killed mid-stream
frees its keys' slots then); the broker's own are released by its handlers.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from broker.errors import TooBusy
from broker.keystore import Holder

LEASE_TTL_S = 15.0  # a remote gateway's lease lapses this long after its last report
REPORT_EVERY_S = 2.0  # how often gateways report (and so renew their leases)
MINUTE_S = 60.0
LOCAL = "broker"  # the broker's own gateway: its leases never lapse


@dataclass
class Lease:
    holder: str  # the key's id ("" for no key)
    model: str  # a session's model ("": embeddings, which take no batch slot)
    gateway: str
    expires: float
    using: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class Leases:
    def __init__(
        self,
        capacity: Callable[[str], int],
        using: Callable[[str], AbstractContextManager[None]] = lambda m: contextlib.nullcontext(),
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = LEASE_TTL_S,
    ) -> None:
        self.capacity = capacity  # a model's batch slots (0: unknown, not limited)
        self.using = using  # a model in interactive use is not rebalanced
        self.clock = clock
        self.ttl_s = ttl_s
        self.leases: dict[str, Lease] = {}
        self.streams: dict[str, int] = defaultdict(int)  # key id -> leases held
        self.per_model: dict[str, int] = defaultdict(int)
        self.started: dict[str, deque[float]] = defaultdict(deque)  # key id -> starts, last min
        self.refused: dict[str, int] = defaultdict(int)  # why -> leases refused

    def acquire(
        self, holder: Holder | None, model: str, gateway: str = LOCAL, session: bool = True
    ) -> str:
        """A lease's id, or `TooBusy` saying which limit and when to try again. `session`:
        a generation session, which takes a batch slot (embeddings do not)."""
        now = self.clock()
        self.expire(now)
        who = holder.id if holder is not None else ""
        starts = self.started[who]
        while starts and starts[0] <= now - MINUTE_S:
            starts.popleft()
        streams = holder.max_streams if holder is not None else None
        if streams is not None and self.streams[who] >= streams:
            self.refused["key_streams"] += 1
            raise TooBusy(
                f"this API key has {self.streams[who]} requests in progress, its limit; "
                "try again when one ends",
                1.0,
            )
        rate = holder.per_minute if holder is not None else None
        if rate is not None and len(starts) >= rate:
            self.refused["key_rate"] += 1
            wait = starts[len(starts) - rate] + MINUTE_S - now
            raise TooBusy(
                f"this API key started {len(starts)} requests in the last minute, its "
                f"limit; try again in {math.ceil(wait)} s",
                wait,
            )
        slots = self.capacity(model) if session else 0
        if slots and self.per_model[model] >= slots:
            self.refused["capacity"] += 1
            raise TooBusy(
                f"{model} has {self.per_model[model]} requests in progress, as many as its "
                f"providers' batch slots ({slots}); try again shortly",
                1.0,
            )
        expires = math.inf if gateway == LOCAL else now + self.ttl_s
        lease = Lease(who, model if session else "", gateway, expires)
        if session:
            lease.using.enter_context(self.using(model))
        lid = "lease_" + secrets.token_hex(8)
        self.leases[lid] = lease
        self.streams[who] += 1
        self.per_model[lease.model] += 1
        if rate is not None:
            starts.append(now)
        return lid

    def release(self, lid: str, gateway: str = LOCAL) -> bool:
        """End a lease (only its gateway may); False if it was not held (lapsed)."""
        lease = self.leases.get(lid)
        if lease is None or lease.gateway != gateway:
            return False
        self._drop(lid)
        return True

    def renew(self, gateway: str, held: list[str]) -> list[str]:
        """A gateway's report: its leases in `held` live on; returns those it no longer has."""
        now = self.clock()
        self.expire(now)
        lost = []
        for lid in held:
            lease = self.leases.get(lid)
            if lease is None or lease.gateway != gateway:
                lost.append(lid)
            else:
                lease.expires = now + self.ttl_s
        return lost

    def expire(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        gone = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in gone:
            self._drop(lid)
        return gone

    def _drop(self, lid: str) -> None:
        lease = self.leases.pop(lid)
        self.streams[lease.holder] -= 1
        self.per_model[lease.model] -= 1
        lease.using.close()

    def held(self) -> dict[str, int]:
        """Leases held per gateway (lapsed ones dropped first)."""
        self.expire()
        out: dict[str, int] = defaultdict(int)
        for lease in self.leases.values():
            out[lease.gateway] += 1
        return dict(out)
