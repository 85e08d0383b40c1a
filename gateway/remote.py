"""The OpenAI endpoints' backend in a gateway process (`broker.gateway.Backend`): the broker's
HTTP API through the SDK, with the gateway's own credential.

Models' client stages are downloaded once into the gateway's cache (as the SDK does); stage
keys are asked again after `KEYS_TTL_S`; key decisions are cached at most the `ttl_s` the
broker states (`broker.keystore.DECISION_TTL_S`); each request's lease is taken from the
broker before any work, so a revoked key starts nothing more at once.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from broker.admission import Limits
from broker.errors import NotFound, TooBusy, Unavailable
from broker.jobkinds import JobError
from client.api import AsyncClient
from client.errors import (
    AuthenticationError,
    BadRequestError,
    FusionAIError,
    NotFoundError,
    RateLimitError,
)
from client.routing import HttpRouter, quote_part
from client.session import Router
from client.stages import ClientStages
from proto.api.keys import (
    AdmitRequest,
    Admitted,
    Decision,
    KeyQuery,
    ModelTraffic,
    Release,
    Released,
)
from proto.api.openai import EmbeddingList, EmbeddingRequest
from proto.api.swarm import Verdict, VerifyRequest

KEYS_TTL_S = 10.0  # a model's stage keys are asked again after this
T = TypeVar("T")


class KeyRefused(Exception):
    """The broker refused the user's API key (401 at the gateway)."""


@dataclass
class Traffic:
    """This gateway's counters since it started, per model (what it reports)."""

    models: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    refused: int = 0

    def report(self) -> dict[str, ModelTraffic]:
        return {
            m: ModelTraffic(int(c["tokens"]), int(c["requests"]), c["seconds"], int(c["failovers"]))
            for m, c in self.models.items()
        }


async def broker_call(call: Awaitable[T]) -> T:
    """A call to the broker, its errors as this gateway answers them to its user."""
    try:
        return await call
    except RateLimitError as exc:
        raise TooBusy(exc.message, exc.retry_after or 1.0) from None
    except AuthenticationError as exc:
        raise KeyRefused(exc.message) from None
    except NotFoundError as exc:
        raise NotFound(exc.message) from None
    except BadRequestError as exc:
        raise JobError(exc.field or "request", exc.message) from None
    except FusionAIError as exc:
        raise Unavailable(f"the broker: {exc}") from None


class RemoteBackend:
    def __init__(
        self,
        sdk: AsyncClient,
        name: str,
        limits: Limits,
        max_attempts: int = 3,
        verify_share: float = 0.21,
    ) -> None:
        self.sdk = sdk
        self.verify_share = verify_share
        self.name = name
        self.limits = limits
        self.timeout_s = sdk.timeout
        self.max_attempts = max_attempts
        self.host: Any = None  # the SDK's p2p host: `start`
        self.traffic = Traffic()
        self.leases: set[str] = set()  # held now: reported, so the broker keeps them
        self._keys: dict[str, tuple[float, list[str]]] = {}
        self._decisions: dict[str | None, tuple[float, Decision]] = {}
        self._closing = False

    async def start(self) -> None:
        self.host = await self.sdk._p2p()

    def close(self) -> None:
        self._closing = True

    async def decision(self, key: str | None) -> Decision:
        """What `key` may do, asked of the broker at most once per its stated `ttl_s`."""
        now = time.monotonic()
        cached = self._decisions.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        body = KeyQuery(key)
        out = await broker_call(
            self.sdk._call("POST", "/v1/gateway/keys", Decision, body, retry="never")
        )
        if len(self._decisions) > 10_000:  # (a flood of made-up keys)
            self._decisions.clear()
        self._decisions[key] = (now + min(out.ttl_s, 60.0), out)
        return out

    async def decoder(self, model: str) -> ClientStages:
        return await broker_call(self.sdk.stages(model))

    async def stage_keys(self, model: str) -> list[str]:
        cached = self._keys.get(model)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        route = await broker_call(self.sdk.model(model))
        keys = [s.key for s in route.stages]
        self._keys[model] = (time.monotonic() + KEYS_TTL_S, keys)
        return keys

    def router(self, model: str) -> Router:
        return HttpRouter(self.sdk, model)

    async def embed(
        self, model: str, texts: list[str] | None, ids: list[list[int]] | None
    ) -> tuple[np.ndarray[Any, Any], int]:
        """The broker's embeddings (the encoder's stages run on providers; the broker's job
        runner walks them)."""
        given: list[Any] = list(texts) if texts is not None else list(ids or [])
        body = EmbeddingRequest(model, given)
        out = await broker_call(
            self.sdk._call("POST", "/v1/embeddings", EmbeddingList, body, retry="never")
        )
        rows = [d.embedding for d in sorted(out.data, key=lambda d: d.index)]
        return np.asarray(rows, dtype=np.float32), out.usage.prompt_tokens

    @contextlib.asynccontextmanager
    async def admit(self, key: str | None, model: str, session: bool) -> AsyncIterator[None]:
        body = AdmitRequest(self.name, model, key, session)
        try:
            out = await broker_call(
                self.sdk._call("POST", "/v1/gateway/admit", Admitted, body, retry="never")
            )
        except KeyRefused:
            self._decisions.pop(key, None)  # revoked since: ask afresh next time
            self.traffic.refused += 1
            raise
        except TooBusy:
            self.traffic.refused += 1
            raise
        self.leases.add(out.lease)
        try:
            yield
        finally:
            self.leases.discard(out.lease)
            with contextlib.suppress(FusionAIError):  # (unreleased, it lapses)
                await self.sdk._call(
                    "POST", "/v1/gateway/release", Released, Release(self.name, out.lease),
                    retry="never",
                )  # fmt: skip

    def stopping(self) -> bool:
        return self._closing

    async def verify(self, model: str, body: VerifyRequest) -> Verdict:
        path = f"/v1/models/{quote_part(model)}/verify"
        return await broker_call(self.sdk._call("POST", path, Verdict, body, retry="never"))

    def served(self, endpoint: str, model: str, seconds: float) -> None:
        counts = self.traffic.models[model]
        counts["requests"] += 1
        counts["seconds"] += seconds

    def generated(self, model: str, tokens: int) -> None:
        self.traffic.models[model]["tokens"] += tokens

    def failover(self, model: str, session: str, stage: str, peer: str, reason: str) -> None:
        self.traffic.models[model]["failovers"] += 1
