"""The OpenAI endpoints' backend in the broker itself (`broker.gateway.Backend`): the broker
serves them in a one-machine setup, with the same limits a gateway process gets from it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.admission import Limits
from broker.commitcheck import CommitmentChecks
from broker.config import BrokerConfig
from broker.embedjobs import EmbedJobs
from broker.errors import NotFound
from broker.events import EventLog
from broker.keystore import KeyStore
from broker.leases import Leases
from broker.metrics import Metrics
from broker.models import ModelStore
from broker.registry import Registry
from broker.serving import Serving
from broker.verify import Verifier
from client.errors import GenerationError
from client.session import Router
from client.stages import ClientStages
from p2p import Host
from proto.api.swarm import Verdict, VerifyRequest


@dataclass(frozen=True)
class Parts:
    """What the broker's own gateway uses of the broker, handed over by the composition root."""

    config: BrokerConfig
    serving: Serving
    registry: Registry
    models: ModelStore
    verifier: Verifier
    embeds: EmbedJobs
    metrics: Metrics
    events: EventLog
    host: Host
    inflight: dict[str, int]  # stage requests outstanding per provider (shared with jobs)
    keys: KeyStore
    leases: Leases
    stopping: Callable[[], bool]
    rng: random.Random  # who checks a generation step: unpredictable
    checks: CommitmentChecks  # finished answers' commitments, checked by a rerun


class BrokerRouter:
    """Routes for generation sessions the broker runs itself (`client.session.Router`)."""

    def __init__(self, parts: Parts, model: str, load: dict[str, int]) -> None:
        self.parts = parts
        self.model = model
        self.load = load
        self.addrs: dict[str, list[str]] = {}  # (`client.session.Router.addrs`)

    async def pick(self, pos: int, avoid: set[str]) -> str:
        timeout = self.parts.config.request_timeout_s
        peer = await self.parts.serving.pick(self.model, pos, avoid, self.load, timeout)
        if peer is None:
            raise GenerationError(
                f"no provider has served stage {pos} of {self.model} for {timeout:.0f} s"
            )
        self.addrs[peer] = self.parts.serving.peer_info(peer).addrs
        return peer

    async def failed(self, pos: int, peer: str, reason: str) -> None:
        await self.parts.serving.suspect(peer, f"a generation step failed: {reason}")

    def lost(self, peer: str) -> asyncio.Event | None:
        return self.parts.registry.lost_event(peer)

    async def checker(self, pos: int, avoid: set[str]) -> str | None:
        plan = self.parts.serving.plans[self.model]
        key = self.parts.serving.unit_keys(plan)[pos]
        holders = self.parts.registry.holders(key, avoid)
        return self.parts.rng.choice(holders) if holders else None  # unpredictable checkers

    async def distrust(self, pos: int, key: str, peer: str, reason: str) -> bool:
        return (await self.parts.verifier.report(peer, self.model, pos, reason))[1]


class BrokerBackend:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        config = parts.config
        self.host = parts.host
        self.limits = Limits(
            config.max_interactive,
            config.max_reading_bytes,
            config.max_work_tokens,
            config.max_body_bytes,
        )
        self.timeout_s = config.request_timeout_s
        self.max_attempts = config.max_attempts
        self.verify_share = config.verify_share

    async def decoder(self, model: str) -> ClientStages:
        if self.parts.models.models.get(model) is None:
            raise NotFound(f"no model named {model!r}")
        return await asyncio.to_thread(self.parts.models.client, model)

    async def stage_keys(self, model: str) -> list[str]:
        plan = self.parts.serving.plans.get(model)
        if plan is None:
            raise NotFound(f"no model named {model!r}")
        return self.parts.serving.unit_keys(plan)

    def router(self, model: str) -> Router:
        return BrokerRouter(self.parts, model, self.parts.inflight)

    async def embed(
        self, model: str, texts: list[str] | None, ids: list[list[int]] | None
    ) -> tuple[np.ndarray[Any, Any], int]:
        return await self.parts.embeds.embed_now(model, texts, ids)

    @contextlib.asynccontextmanager
    async def admit(self, key: str | None, model: str, session: bool) -> AsyncIterator[None]:
        leases = self.parts.leases
        lease = leases.acquire(self.parts.keys.holder(key), model, session=session)
        try:
            yield
        finally:
            leases.release(lease)

    def stopping(self) -> bool:
        return self.parts.stopping()

    async def verify(self, model: str, body: VerifyRequest) -> Verdict:
        return await self.parts.checks.verify(model, body)

    def served(self, endpoint: str, model: str, seconds: float) -> None:
        self.parts.metrics.interactive(endpoint, seconds)

    def generated(self, model: str, tokens: int) -> None:
        self.parts.metrics.tokens(model, tokens)

    def failover(self, model: str, session: str, stage: str, peer: str, reason: str) -> None:
        self.parts.events.emit(
            "session_failover", peer=peer, session=session, stage=stage, reason=reason
        )
        self.parts.metrics.failover("session_retry")
