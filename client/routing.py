"""Routes for the SDK's generation sessions: the broker names a provider per stage over HTTP
(`client.session.Router`); the client dials each one itself and reports those that fail."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol, TypeVar

import numpy as np

from client.errors import (
    FusionAIError,
    GenerationError,
    UnavailableError,
)
from proto.api import Picked, PickRequest, Report, ReportRequest

T = TypeVar("T")

Array = np.ndarray[Any, Any]
AVOID_PATIENCE_S = 5.0  # how long a failed peer is not taken back while others may come


class RouterClient(Protocol):
    """What the router uses of the SDK client."""

    timeout: float

    async def _call(
        self, method: str, path: str, answer: type[T], body: Any = None, **options: Any
    ) -> T: ...

    async def _p2p(self) -> Any: ...

    async def _direct(self, peer: str) -> None: ...


class HttpRouter:
    """Providers for a client's generation session, named by the broker over HTTP
    (`client.session.Router`). The client connects to each provider it is given. Its calls
    are never tried again by the SDK's HTTP layer: a pick has its own deadline and patience,
    and a 503 (no other provider) is an answer here."""

    def __init__(self, client: RouterClient, model: str) -> None:
        self.client = client
        self.model = model
        self.addrs: dict[str, list[str]] = {}  # where providers picked are (chained steps')

    async def pick(self, pos: int, avoid: set[str]) -> str:
        host = await self.client._p2p()
        tried = set(avoid)
        deadline = time.monotonic() + self.client.timeout
        # A peer that just failed is what the broker names until it has noticed (its ping
        # fails) and promoted a backup: ask again for a while before taking it back.
        patience = time.monotonic() + min(AVOID_PATIENCE_S, self.client.timeout / 2)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GenerationError(f"no reachable provider serves stage {pos} of {self.model}")
            body = PickRequest(pos, sorted(tried), round(left, 3))
            try:
                out = await self.client._call(
                    "POST", f"/v1/models/{quote_part(self.model)}/pick", Picked, body,
                    timeout=left + 5, retry="never",
                )  # fmt: skip
            except FusionAIError as exc:
                raise GenerationError(f"stage {pos} of {self.model}: {exc}") from None
            peer = out.peer_id
            self.addrs[peer] = list(out.addrs)
            if peer in tried and time.monotonic() < patience:
                await asyncio.sleep(0.2)
                continue
            fresh = not host.is_connected(peer)
            reason = await _dial(host, peer, out.addrs, deadline)
            if reason is None:
                # before the session's first call: a punch closes a relayed one (a provider
                # the broker reached back directly or through its router's mapping needs none)
                if fresh and out.reach in ("relayed", ""):
                    await self.client._direct(peer)
                return peer
            await self.failed(pos, peer, f"cannot connect: {reason}")
            if peer in tried:  # the broker had no other: give it a moment to notice
                await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
            tried.add(peer)

    async def failed(self, pos: int, peer: str, reason: str) -> None:
        try:
            await self.client._call(
                "POST", f"/v1/providers/{quote_part(peer)}/report", Report,
                ReportRequest(reason[:1000] or "failed"), retry="never",
            )  # fmt: skip
        except FusionAIError:
            pass  # best effort: the broker's heartbeats notice a dead provider anyway

    def lost(self, peer: str) -> asyncio.Event | None:
        return None  # the client learns of a dead provider from its own requests

    async def checker(self, pos: int, avoid: set[str]) -> str | None:
        host = await self.client._p2p()
        body = PickRequest(pos, sorted(avoid), check=True)
        try:
            out = await self.client._call(
                "POST", f"/v1/models/{quote_part(self.model)}/pick", Picked, body, retry="never"
            )
        except UnavailableError:
            return None  # no one else holds the stage
        except FusionAIError as exc:
            raise GenerationError(f"stage {pos} of {self.model}: {exc}") from None
        deadline = time.monotonic() + self.client.timeout
        return out.peer_id if await _dial(host, out.peer_id, out.addrs, deadline) is None else None

    async def distrust(self, pos: int, key: str, peer: str, reason: str) -> bool:
        try:
            out = await self.client._call(
                "POST",
                f"/v1/providers/{quote_part(peer)}/report",
                Report,
                ReportRequest(reason[:1000] or "disagreed", wrong_output=key),
                retry="never",
            )
        except FusionAIError:
            return False  # unresolved: the session raises VerificationError
        return out.quarantined


async def _dial(host: Any, peer: str, addrs: list[str], deadline: float) -> str | None:
    """Connect to `peer` by the first of `addrs` that answers before `deadline` (monotonic);
    None once connected, else why not."""
    if host.is_connected(peer):
        return None
    errors = []
    for n, addr in enumerate(addrs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # an unreachable address must not use up the time the others need
        cap = left if n == len(addrs) - 1 else min(left, 10.0)
        try:
            full = addr if "/p2p/" in addr else f"{addr}/p2p/{peer}"
            await asyncio.wait_for(host.connect(full), cap)
            return None
        except Exception as exc:  # any dial failure: try the next
            errors.append(f"{addr}: {exc or type(exc).__name__}")
    return "; ".join(errors) or "it has no addresses"


def quote_part(part: str) -> str:
    from urllib.parse import quote

    return quote(part, safe="")
