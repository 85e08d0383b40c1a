"""Assignments from the broker: load a stage (download, verify, build its executor) in the
background, promote a backup, unassign; the broker hears "ready" or "failed, why".

An assignment is acknowledged at once when the memory budget has room (it is reserved while
the stage loads); the same assignment sent again while loading is a no-op (its artifact link
may be a fresh one), a different one under the same key replaces it. The artifact is pinned
in the cache while the stage is loaded, so it is never evicted under a running stage. The
link's token is never logged, nor sent back in a failure's reason.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from files.cache import ArtifactCache, human_bytes
from files.private import redact
from p2p import ConnectionLost, Host, P2PError, RemoteError, RequestTimeout, heap
from proto.assign import STAGE_STATUS, Assign, AssignAck, Promote, StageStatus, Unassign
from provider.config import ProviderConfig
from provider.events import event, throttled_progress
from provider.hosting import StageRefused, host, memory_needed, stage_of
from provider.serving import Server
from provider.stage import LoadedStage


class Assignments:
    """The stages the broker assigned us. `host`, `http` (the artifact downloads' session)
    and `memory_budget` are set by the daemon once known."""

    def __init__(
        self, config: ProviderConfig, server: Server, cache: ArtifactCache, broker_id: str
    ) -> None:
        self.config = config
        self.server = server
        self.cache = cache
        self.broker_id = broker_id
        self.host: Host | None = None
        self.http: aiohttp.ClientSession | None = None
        self.memory_budget = 0
        self.loading: dict[str, asyncio.Task[None]] = {}
        self.status_tasks: set[asyncio.Task[None]] = set()
        self._reserved: dict[str, int] = {}  # memory reserved by stages being loaded
        self._pending: dict[str, Assign] = {}  # the assignment each load is for

    def used_memory(self) -> int:
        """Memory of loaded stages, stages being loaded, and the KV-cache budget."""
        kind = self.config.executor.kind
        stages = sum(memory_needed(s.info, kind) for s in self.server.stages.values())
        return stages + sum(self._reserved.values()) + self.server.kv_budget

    def tasks(self) -> list[asyncio.Task[None]]:
        """Loads and status reports under way (cancelled when the daemon stops)."""
        return [*self.loading.values(), *self.status_tasks]

    async def on_assign(self, peer: str, request: Assign | Unassign | Promote) -> AssignAck:
        if peer != self.broker_id:
            return AssignAck(accepted=False, reason="only the broker assigns stages")
        if isinstance(request, Unassign):
            self._cancel_load(request.key)
            stage = self.server.remove(request.key)
            if stage is not None:
                self.cache.pinned.discard(stage.info.sha256)
            event("unassigned", key=request.key)
            return AssignAck(accepted=True)
        if isinstance(request, Promote):
            ok = self.server.promote(request.key)
            event("promoted", key=request.key, ok=ok)
            return AssignAck(accepted=ok, reason="" if ok else f"{request.key} is not loaded")
        if self.server.draining:
            return AssignAck(accepted=False, reason="this provider is leaving")
        try:
            info = stage_of(request)
        except StageRefused as exc:
            return AssignAck(accepted=False, reason=str(exc))
        existing = self.server.stages.get(request.key)
        if existing is not None and existing.info.sha256 == info.sha256:
            existing.role = request.role  # already loaded: a role change or a re-send
            self._spawn_status(StageStatus(key=request.key, state="ready", role=request.role))
            return AssignAck(accepted=True)
        pending = self._pending.get(request.key)
        if pending is not None and msgspec.structs.replace(pending, url=request.url) == request:
            return AssignAck(accepted=True)  # the same assignment (a fresh link), still loading
        self._cancel_load(request.key)  # a different assignment under this key replaces it
        replaced = existing.info.sha256 if existing is not None else None
        need = memory_needed(info, self.config.executor.kind)
        free = self.memory_budget - self.used_memory()
        if replaced is None and need > free:
            return AssignAck(
                accepted=False,
                reason=f"stage {request.key} needs about {human_bytes(need)}; "
                f"{human_bytes(max(0, free))} of this provider's memory budget is left",
            )
        self._reserved[request.key] = need
        self._pending[request.key] = request
        self.loading[request.key] = asyncio.create_task(self._load(request))
        return AssignAck(accepted=True)

    def unload_all(self) -> list[str]:
        """Stop every load and drop every stage (stepping aside: the memory goes back to the
        machine's owner; the artifacts stay in the cache for the next assignment)."""
        for key in list(self.loading):
            self._cancel_load(key)
        dropped = sorted(self.server.stages)
        for key in dropped:
            stage = self.server.remove(key)
            if stage is not None:
                self.cache.pinned.discard(stage.info.sha256)
        return dropped

    def _cancel_load(self, key: str) -> None:
        task = self.loading.pop(key, None)
        if task is not None:
            task.cancel()
        self._reserved.pop(key, None)
        self._pending.pop(key, None)

    async def _load(self, request: Assign) -> None:
        event("assigned", key=request.key, role=request.role, url=redact(request.url))
        progress = throttled_progress(f"stage {request.key}")
        me = asyncio.current_task()
        try:
            stage: LoadedStage = await host(
                request,
                self.cache,
                self.config.executor,
                self.memory_budget,
                0,  # the assignment checked and reserved the memory
                session=self.http,
                progress=progress,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure: the broker hears it, with the reason
            reason = str(exc) if isinstance(exc, StageRefused) else f"{type(exc).__name__}: {exc}"
            reason = redact(reason)  # (an error may quote the link: its token stays here)
            event("stage_failed", key=request.key, reason=reason)
            await self._report(StageStatus(key=request.key, state="failed", reason=reason))
            return
        finally:
            if self.loading.get(request.key) is me:
                self.loading.pop(request.key, None)
                self._reserved.pop(request.key, None)
                self._pending.pop(request.key, None)
        old = self.server.remove(stage.key)  # a replaced stage: its sessions go with it
        if old is not None and old.info.sha256 != stage.info.sha256:
            self.cache.pinned.discard(old.info.sha256)
        self.server.add(stage)
        # (what the load made is there for good: later full collections skip it)
        settled = heap.settle() if self.config.settle_heap else 0.0
        event(
            "stage_ready",
            key=stage.key,
            role=stage.role,
            load_s=round(stage.load_s, 3),
            heap_settle_ms=round(settled * 1e3, 1),
        )
        await self._report(
            StageStatus(key=stage.key, state="ready", role=stage.role, load_s=stage.load_s)
        )

    def _spawn_status(self, status: StageStatus) -> None:
        task = asyncio.create_task(self._report(status))
        self.status_tasks.add(task)
        task.add_done_callback(self.status_tasks.discard)

    async def _report(self, status: StageStatus) -> None:
        if self.host is None:
            return
        try:
            await self.host.request(self.broker_id, STAGE_STATUS, status, timeout=10.0)
        except (RemoteError, ConnectionLost, RequestTimeout, P2PError) as exc:
            # The broker learns the state from the next heartbeat's `loaded` list instead.
            event("status_not_delivered", key=status.key, error=str(exc))
