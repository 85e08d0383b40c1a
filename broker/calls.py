"""Stage calls: the broker's requests to providers running a job's stages.

One stage at a time (`forward`), or consecutive stages as one chained request (`chain`, with
`proto.forward`): the hidden states pass from provider to provider along a route the broker
signs, and the last pushes the result here (`on_chain_result`). A failed call becomes
`CallFailed` (after a short wait when the provider was busy, a liveness check when it timed
out); a provider that could not reach the next one in a chain is routed through the broker
for `UNREACHABLE_S`. Requests outstanding per provider (`inflight`) steer `pick` to the least
loaded provider of a stage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from broker.config import BrokerConfig
from broker.events import EventLog
from broker.jobkinds import JobFailed, Ref
from broker.models import ModelStore
from broker.serving import Serving
from client.session import unless_lost
from dag.cost import Workload
from p2p import ErrorCode, Host, P2PError, Refused, RemoteError, RequestTimeout, Tensor
from p2p.codec import Message, ProtocolSpec
from p2p.tensor import encode
from proto.forward import (
    FORWARD,
    ROUTE_DOMAIN,
    TIMEOUT,
    UNREACHABLE,
    ChainAccepted,
    ChainBroken,
    ChainResult,
    Forward,
    ForwardResult,
    Hop,
    HopDone,
    route_bytes,
)

Array = np.ndarray[Any, Any]
BUSY_WAIT_S = 0.2  # pause before trying again after a "busy" answer; seconds
UNREACHABLE_S = 300.0  # a provider that could not reach the next in a chain: star for so long


class StageCalls:
    def __init__(
        self,
        config: BrokerConfig,
        events: EventLog,
        serving: Serving,
        models: ModelStore,
        host: Host,
        on_stage: Callable[[str, float, str], None] = lambda model, seconds, relay: None,
    ) -> None:
        """`on_stage(model, seconds, "chain" or "direct")`: a stage task was answered (for
        the metrics)."""
        self.config = config
        self.events = events
        self.serving = serving
        self.models = models
        self.host = host
        self.clock = serving.clock
        self.inflight: dict[str, int] = {}  # requests we have outstanding per provider
        # chained requests waiting for their result: chain id -> (last hop, its outputs)
        self.chains: dict[str, tuple[str, asyncio.Future[dict[str, Tensor]]]] = {}
        # (provider, next provider) -> until when the first cannot reach the second
        self.unreachable: dict[tuple[str, str], float] = {}
        self.on_stage = on_stage

    async def check(
        self, peer: str, spec: ProtocolSpec, msg: Message
    ) -> asyncio.Future[Any] | None:
        """A request of the verifier's (a second opinion, a probe)."""
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        try:
            return await self.request_unless_lost(peer, spec, msg, self.config.request_timeout_s)
        finally:
            self.inflight[peer] -= 1

    def unreachable_to(self, source: str, target: str) -> bool:
        """Whether `source` recently failed to reach `target` (their hidden states then go
        through the broker)."""
        until = self.unreachable.get((source, target))
        if until is not None and until <= self.clock():
            del self.unreachable[(source, target)]
            return False
        return until is not None

    async def chain(
        self,
        job: Ref,
        hops: list[tuple[int, str]],
        hidden: Array,
        mask: Array,
        used: list[str],
        *,
        chain: str = "",
        done: list[HopDone] | None = None,
    ) -> Array:
        """Stages as one chained request along `hops` (stage, provider): the activations go
        from provider to provider, and the last pushes the result here (`on_chain_result`).
        `chain`: its id (default: a new one); `done` gets the hops' accounts of their work."""
        model = self.models.models[job.model]
        stages = [pos for pos, _ in hops]
        keys = [model.unit_key(model.units[pos]) for pos in stages]
        peers = [peer for _, peer in hops]
        used.extend(peers)
        profiles = self.serving.registry.profiles
        route = [
            Hop(peer, key, list(profiles[peer].addrs) if peer in profiles else [])
            for peer, key in zip(peers, keys, strict=True)
        ]
        chain = chain or uuid.uuid4().hex
        timeout = self.config.request_timeout_s * len(route)
        expires = time.time() + timeout + 5.0
        signature = self.host.identity.sign(route_bytes(chain, route, expires), domain=ROUTE_DOMAIN)
        msg = Forward(
            stage=keys[0],
            inputs=self._inputs(job, stages[0], hidden, mask),
            chain=chain,
            route=route,
            expires=expires,
            signature=signature,
        )
        arrived: asyncio.Future[dict[str, Tensor]] = asyncio.get_running_loop().create_future()
        self.chains[chain] = (peers[-1], arrived)
        for peer in peers:
            self.inflight[peer] = self.inflight.get(peer, 0) + 1
        start = time.perf_counter()
        lost = [self.serving.registry.lost_event(p) for p in peers]
        try:
            call = await unless_lost(
                self.host.request(peers[0], FORWARD, msg, timeout=timeout), lost
            )
        finally:
            del self.chains[chain]
            for peer in peers:
                self.inflight[peer] -= 1
        if call is None:  # (the events as they were: a peer that joins again gets a new one)
            at = next((i for i, e in enumerate(lost) if e.is_set()), 0)
            raise CallFailed(peers[at], keys[at], "the provider was declared lost")
        answer = await self._answer(call, peers[0], keys[0])
        if isinstance(answer, ChainBroken):
            # the hop that failed ("": pushing the result here failed, after the last hop)
            at = keys.index(answer.stage) if answer.stage in keys else len(keys) - 1
            peer, key = peers[at], keys[at]
            if answer.code == ErrorCode.BUSY:
                await asyncio.sleep(BUSY_WAIT_S)
                raise CallFailed(peer, key, answer.reason, busy=True)
            if answer.code == UNREACHABLE and answer.stage in keys and at > 0:
                source = peers[at - 1]
                self.unreachable[(source, peer)] = self.clock() + UNREACHABLE_S
                self.events.emit(
                    "chain_unreachable",
                    job=job.id,
                    peer=source,
                    to=peer,
                    reason=answer.reason,
                    seconds=UNREACHABLE_S,
                )
            if answer.code in (TIMEOUT, UNREACHABLE):
                await self.serving.suspect(peer, f"a chained stage request failed: {answer.reason}")
            else:
                await self.serving.changed(0.5)
            raise CallFailed(peer, key, answer.reason)
        if not arrived.done() or [h.peer for h in answer.hops] != peers:
            raise CallFailed(peers[-1], keys[-1], "the chain's result did not arrive whole")
        elapsed = time.perf_counter() - start
        work = _workload(hidden)
        for hop in answer.hops:
            self.serving.observe(hop.peer, job.model, work, hop.compute_ms / 1e3)
        if done is not None:
            done.extend(answer.hops)
        for _ in route:
            self.on_stage(job.model, elapsed / len(route), "chain")
        return self._hidden(arrived.result(), peers[-1], keys[-1])

    async def on_chain_result(self, peer: str, msg: ChainResult) -> ChainAccepted:
        """The last hop of a chain pushes its outputs here."""
        waiting = self.chains.get(msg.chain)
        if waiting is None or waiting[0] != peer:
            raise Refused(ErrorCode.NOT_FOUND, "no chain of yours with that id is waiting here")
        if not waiting[1].done():
            waiting[1].set_result(msg.outputs)
        return ChainAccepted(chain=msg.chain)

    async def _answer(self, call: asyncio.Future[Any], peer: str, key: str) -> Any:
        """A stage request's answer; a failure becomes `CallFailed` (after a busy wait, a
        liveness check of `peer`, or a moment for the route table to catch up)."""
        try:
            return call.result()
        except RemoteError as exc:
            if exc.code == ErrorCode.BUSY:  # full or leaving: wait, it is not a failure
                await asyncio.sleep(BUSY_WAIT_S)
                raise CallFailed(peer, key, f"{exc.code}: {exc}", busy=True) from None
            await self.serving.changed(0.5)  # e.g. promoted but not confirmed yet
            raise CallFailed(peer, key, f"{exc.code}: {exc}") from None
        except RequestTimeout as exc:
            await self.serving.suspect(peer, "a stage request timed out")
            raise CallFailed(peer, key, str(exc)) from None
        except P2PError as exc:
            await self.serving.suspect(peer, f"a stage request failed: {exc}")
            raise CallFailed(peer, key, str(exc)) from None

    @staticmethod
    def _hidden(outputs: dict[str, Tensor], peer: str, key: str) -> Array:
        tensor = outputs.get("hidden_states_out")
        if tensor is None:
            raise CallFailed(peer, key, "the answer has no hidden_states_out")
        try:
            return tensor.to_numpy()
        except ValueError as exc:
            raise CallFailed(peer, key, f"a bad tensor: {exc}") from None

    def _inputs(self, job: Ref, pos: int, hidden: Array, mask: Array) -> dict[str, Tensor]:
        """What stage `pos` takes of the hidden states and the mask (adapters: the provider's
        zeros)."""
        model = self.models.models[job.model]
        names = {i.name for i in model.manifest.stages[model.units[pos]].inputs}
        wire = model.manifest.wire
        feeds = {"hidden_states": encode(hidden, wire), "attention_mask": Tensor.from_numpy(mask)}
        return {k: v for k, v in feeds.items() if k in names}

    async def forward(
        self, job: Ref, pos: int, peer: str, hidden: Array, mask: Array, used: list[str]
    ) -> tuple[Array, Forward]:
        """Stage `pos` on `peer`: its output, and the request (a spot check sends it again)."""
        model = self.models.models[job.model]
        key = model.unit_key(model.units[pos])
        used.append(peer)
        msg = Forward(stage=key, inputs=self._inputs(job, pos, hidden, mask))
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        start = time.perf_counter()
        try:
            call = await self.request_unless_lost(peer, FORWARD, msg, self.config.request_timeout_s)
        finally:
            self.inflight[peer] -= 1
        if call is None:
            raise CallFailed(peer, key, "the provider was declared lost")
        answer = await self._answer(call, peer, key)
        if not isinstance(answer, ForwardResult):
            raise CallFailed(peer, key, f"an unexpected {type(answer).__name__}")
        elapsed = time.perf_counter() - start
        self.serving.observe(peer, job.model, _workload(hidden), answer.compute_ms / 1e3 or elapsed)
        self.on_stage(job.model, elapsed, "direct")
        return self._hidden(answer.outputs, peer, key), msg

    async def request_unless_lost(
        self, peer: str, spec: ProtocolSpec, msg: Message, timeout: float
    ) -> asyncio.Future[Any] | None:
        """Send `msg` to `peer`; the finished call (its result or error), or None if the
        registry declared `peer` lost first (the request is then abandoned)."""
        lost = self.serving.registry.lost_event(peer)
        return await unless_lost(self.host.request(peer, spec, msg, timeout=timeout), lost)

    async def pick(self, job: Ref, pos: int, avoid: set[str]) -> str:
        """The least loaded provider serving stage `pos`, preferring those not in `avoid`;
        waits (up to the request timeout) for a route when there is none."""
        timeout = self.config.request_timeout_s
        peer = await self.serving.pick(job.model, pos, avoid, self.inflight, timeout)
        if peer is None:
            raise JobFailed(
                f"no provider has served stage {pos} of {job.model} for {timeout:.0f} s"
            )
        return peer


def _workload(hidden: Array) -> Workload:
    return Workload(
        tokens=int(hidden.shape[0] * hidden.shape[1]),
        sequences=int(hidden.shape[0]),
        context=int(hidden.shape[1]),
        dtype="float32",
    )


class CallFailed(Exception):
    """A stage call failed: which provider, which stage, why (busy: try again soon)."""

    def __init__(self, peer: str, key: str, reason: str, busy: bool = False) -> None:
        super().__init__(f"{key} on {peer}: {reason}")
        self.peer, self.key, self.reason, self.busy = peer, key, reason, busy
