"""Serving models: the I/O shell around the core's placement decisions, and the route table.

The decision core (`broker.core`) places each model's stages, names backups, repairs and
rebalances; this shell tells it what happens (`ModelAdded`, providers' `StageReported` and
answers to assignments, stage times) and carries out what it decides: assign, promote and
unassign messages sent in order, one sender per provider (`AssignStage`, `PromoteStage`,
`UnassignStage`), placements persisted (`PlacementChanged`), so a restarted broker restores
them and providers re-announce what they have loaded.

The route of a stage is the providers that serve it and have confirmed so (`Core.route`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from broker.config import BrokerConfig
from broker.core import Core, least_loaded
from broker.core.actions import (
    AssignStage,
    PlacementChanged,
    PromoteStage,
    ProviderLost,
    UnassignStage,
)
from broker.core.events import AssignAnswered, ModelAdded, StageReported, StageTimed
from broker.driver import CoreDriver
from broker.events import EventLog
from broker.models import StoredModel, model_spec
from broker.registry import Registry
from broker.store import Store
from dag.cost import Workload
from dag.model import ModelSpec
from p2p import Host, P2PError
from proto.api import swarm as api
from proto.assign import ASSIGN, Assign, AssignAck, Promote, StageStatus, StatusAck, Unassign
from proto.ping import PING, Ping

log = logging.getLogger("fusionai.broker")

Message = Assign | Unassign | Promote


@dataclass(frozen=True)
class Served:
    """A model the broker serves, as the shell needs it."""

    model: StoredModel
    spec: ModelSpec
    keys: list[str]  # unit keys of its provider stages, in pipeline order


class ArtifactLinks(Protocol):
    """Where providers download artifacts: the broker's HTTP server (`broker/service.py`)."""

    def url(self, sha: str, peer: str, size: int) -> str:
        """The URL `peer` downloads the artifact (`size` bytes) from (with a download token
        for it when the API needs keys)."""
        ...

    def tls_sha256(self) -> str:
        """The server certificate's fingerprint to pin ("" when none is pinned)."""
        ...


class Serving:
    def __init__(
        self,
        config: BrokerConfig,
        registry: Registry,
        store: Store,
        events: EventLog,
        host: Host,
        artifacts: ArtifactLinks,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.driver: CoreDriver = registry.driver
        self.store = store
        self.events = events
        self.host = host
        self.artifacts = artifacts  # where providers download a stage's file
        self.clock = clock
        self.plans: dict[str, Served] = {}
        self._outbox: dict[str, asyncio.Queue[Message]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self._suspecting: dict[str, asyncio.Future[None]] = {}  # peer -> its ping check
        self.driver.carry(AssignStage, self._assign)
        self.driver.carry(PromoteStage, lambda a: self._send(a.peer_id, Promote(key=a.key)))
        self.driver.carry(UnassignStage, lambda a: self._send(a.peer_id, Unassign(key=a.key)))
        self.driver.carry(PlacementChanged, self._persist)
        self.driver.carry(ProviderLost, lambda a: self._forget(a.peer_id))
        self.driver.after(self.notify)

    @property
    def core(self) -> Core:
        return self.driver.core

    # ---- models ----------------------------------------------------------------------------

    def add_model(self, model: StoredModel, restored: dict[str, Any] | None = None) -> None:
        spec = model_spec(model.manifest)
        keys = [model.unit_key(i) for i in model.units]
        self.plans[model.name] = Served(model, spec, keys)
        self.driver.handle(ModelAdded(model.name, spec, tuple(keys), self.clock(), restored))

    def unit_keys(self, served: Served) -> list[str]:
        return served.keys

    def spec(self, model: str) -> ModelSpec:
        return self.plans[model].spec

    # ---- carrying out the core's decisions -------------------------------------------------

    def _assign(self, action: AssignStage) -> None:
        model = self.plans[action.model].model
        index = model.units[action.pos]
        stage = model.manifest.stages[index]
        msg = Assign(
            key=action.key,
            manifest=model.manifest_bytes,
            stage=index,
            url=self.artifacts.url(stage.sha256, action.peer_id, stage.size_bytes),
            role=action.role,
            tls_sha256=self.artifacts.tls_sha256(),
        )
        self._send(action.peer_id, msg)

    def _persist(self, action: PlacementChanged) -> None:
        if action.placement is None:
            self.store.delete_placement(action.model)
        else:
            self.store.put_placement(action.model, action.placement)

    def _send(self, peer: str, msg: Message) -> None:
        """Queue `msg` for `peer`; one sender per provider keeps the order."""
        box = self._outbox.get(peer)
        if box is None:
            box = self._outbox[peer] = asyncio.Queue()
            self._senders[peer] = asyncio.create_task(self._sender(peer, box))
        box.put_nowait(msg)

    async def _sender(self, peer: str, box: asyncio.Queue[Message]) -> None:
        while True:
            msg = await box.get()
            try:
                await self._deliver(peer, msg)
            except Exception:  # a bug: logged, and the messages after it still go out
                log.exception("delivering %s to %s failed", type(msg).__name__, peer)

    async def _deliver(self, peer: str, msg: Message) -> None:
        kind = {Assign: "assign", Promote: "promote", Unassign: "unassign"}[type(msg)]
        try:
            ack: AssignAck = await self.host.request(peer, ASSIGN, msg, timeout=10.0)
        except P2PError as exc:
            if isinstance(msg, Unassign):
                return
            self.events.emit("assign_undelivered", peer=peer, key=msg.key, error=str(exc))
            self.registry.mark_dead(peer, f"could not deliver an assignment: {exc}")
            return
        self.driver.handle(
            AssignAnswered(peer, msg.key, kind, ack.accepted, self.clock(), ack.reason)
        )

    def _forget(self, peer: str) -> None:
        task = self._senders.pop(peer, None)
        if task is not None:
            task.cancel()
        self._outbox.pop(peer, None)

    # ---- what providers tell us ------------------------------------------------------------

    async def on_status(self, peer: str, msg: StageStatus) -> StatusAck:
        ready = msg.state == "ready"
        self.driver.handle(
            StageReported(
                peer,
                (msg.key,),
                msg.role,
                ready,
                self.clock(),
                reason="" if ready else msg.reason or "failed",
                load_s=round(msg.load_s, 3),
            )
        )
        return StatusAck()

    def observe(self, peer: str, model: str, work: Workload, seconds: float) -> None:
        """A stage took `seconds` on `peer`: the core corrects its profile towards it."""
        if model in self.plans and seconds > 0:
            self.driver.handle(StageTimed(peer, model, work, seconds, self.clock()))

    # ---- suspicion -------------------------------------------------------------------------

    async def suspect(self, peer: str, why: str) -> None:
        """A request to `peer` failed: if it does not answer a ping at once, it is lost.
        Reports about a peer already being checked join that check (one ping at a time)."""
        if not self.registry.alive(peer):
            return
        check = self._suspecting.get(peer)
        if check is None:
            check = asyncio.ensure_future(self._ping_or_lose(peer, why))
            self._suspecting[peer] = check
            check.add_done_callback(lambda _: self._suspecting.pop(peer, None))
        await asyncio.shield(check)

    async def _ping_or_lose(self, peer: str, why: str) -> None:
        try:
            await self.host.request(peer, PING, Ping(nonce=0), timeout=1.0)
        except P2PError as exc:
            self.registry.mark_dead(peer, f"{why}; ping failed: {exc}")

    # ---- routes ----------------------------------------------------------------------------

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    async def pick(
        self, model: str, pos: int, avoid: set[str], load: Mapping[str, int], timeout: float
    ) -> str | None:
        """The provider for the next request to stage `pos` of `model` (`least_loaded`);
        waits up to `timeout` seconds for one (None if none comes)."""
        deadline = self.clock() + timeout
        while True:
            route = self.route(model)
            peers = route[pos] if route is not None and pos < len(route) else []
            chosen = least_loaded(peers, avoid, dict(load))
            if chosen is not None:
                return chosen
            left = deadline - self.clock()
            if left <= 0:
                return None
            await self.changed(min(left, 1.0))

    def route(self, model: str) -> list[list[str]] | None:
        """Per provider stage (pipeline order), the providers serving it now; None if the
        model is unknown or not placed."""
        return self.core.route(model)

    def describe(self, model: str) -> api.Model:
        served = self.plans[model]
        plan = self.core.plans[model]
        route = self.route(model) or [[] for _ in served.keys]
        backups = self.core.backups(model)
        stages = []
        for pos, key in enumerate(served.keys):
            info = served.model.manifest.stages[served.model.units[pos]]
            stages.append(
                api.StageRoute(
                    key=key,
                    index=info.index,
                    name=info.name,
                    providers=[self.peer_info(p) for p in route[pos]],
                    backups=list(backups.get(pos, [])),
                    layers=list(info.layers or []),
                    size_bytes=info.size_bytes,
                )
            )
        placement = plan.placement
        return api.Model(
            model=model,
            placed=placement is not None,
            ready=all(route) and bool(route),
            waiting=plan.waiting_reason,
            throughput_tokens_s=round(placement.throughput, 1) if placement else 0.0,
            stages=stages,
        )

    def card(self, detail: api.Model) -> api.ModelCard:
        """The model `describe` gave, as `GET /v1/models` lists it (OpenAI's shape)."""
        return api.ModelCard(
            id=detail.model,
            created=int(self.plans[detail.model].model.created),
            ready=detail.ready,
            placed=detail.placed,
            stages=len(detail.stages),
            throughput_tokens_s=detail.throughput_tokens_s,
        )

    def peer_info(self, peer: str) -> api.Peer:
        profile = self.registry.profiles.get(peer)
        return api.Peer(peer, list(profile.addrs) if profile else [])

    async def close(self) -> None:
        tasks = [*self._senders.values(), *self._suspecting.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._senders.clear()
