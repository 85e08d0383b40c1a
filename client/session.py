"""Interactive generation through the swarm: a KV-cache session on each provider stage.

The client runs the tokenizer, the embedding stage and the head itself (`ClientStages`) and
sends only hidden states along the route, one `SessionStep` per stage per step. It keeps each
stage's inputs so far; when a provider dies, stalls past the request deadline or loses the
session, the session is opened on a replacement (the router names one) and that history is
replayed into it in one step, so the output equals an uninterrupted run.

    session = GenerationSession(host, stages, keys, router, timeout=10)
    async for token in generate(session, prompt_ids, max_new_tokens=32):
        ...
    await session.close()

`Router` is where routes come from: the broker passes its own route table, the SDK asks the
broker over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from client.chained import ChainInbox, chainable, chained_step, fill_history
from client.commitments import Commitments
from client.errors import GenerationError
from client.replay import Lost, Mismatch, joined
from client.sampling import Sampler
from client.shadow import checked_step, drop_shadow
from client.stages import ClientStageError, ClientStages
from client.stepmux import StepMux
from ir.manifest import StageInfo
from p2p import ErrorCode, Host, P2PError, RemoteError, RequestTimeout, Tensor
from p2p.tensor import encode
from proto.session import (
    SESSION,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionOutput,
    SessionStep,
)

log = logging.getLogger("fusionai.client")
Array = np.ndarray[Any, Any]
BUSY_WAIT_S = 0.2  # pause before asking again after a "busy" answer; seconds


class Router(Protocol):
    addrs: dict[str, list[str]]  # where each provider picked is (its announced addresses):
    # a chained step's hops dial the next by them when not yet connected to it

    async def pick(self, pos: int, avoid: set[str]) -> str:
        """A provider serving provider stage `pos`, not in `avoid` if there is another;
        waits for one (raising `GenerationError` when none comes)."""
        ...

    async def failed(self, pos: int, peer: str, reason: str) -> None:
        """A request to `peer` failed (connection, deadline): the broker may declare it lost."""
        ...

    def lost(self, peer: str) -> asyncio.Event | None:
        """Set when the broker declares `peer` lost, if this router can tell (else None)."""
        ...

    async def checker(self, pos: int, avoid: set[str]) -> str | None:
        """Another provider holding stage `pos` (serving it or standing by), not in `avoid`,
        to check answers with; None if there is none."""
        ...

    async def distrust(self, pos: int, key: str, peer: str, reason: str) -> bool:
        """`peer`'s answer disagreed with another provider's: the broker probes it. True if
        it is now quarantined (its answers are not to be used)."""
        ...


T = TypeVar("T")


@dataclass
class _Stage:
    key: str
    info: StageInfo
    peer: str | None = None
    sid: str | None = None  # the session id open on `peer` (None: open one first)
    opens: int = 0  # sessions opened for this stage so far (each gets a fresh id)
    history: list[dict[str, Array]] = field(default_factory=list)  # inputs of past steps
    shadow: tuple[str, str] | None = None  # (peer, session id) of the shadow session
    idle_timeout_s: float = float("inf")  # after which its provider drops the open session


class GenerationSession:
    """One sequence's sessions along a model's provider stages (batch 1)."""

    def __init__(
        self,
        host: Host,
        stages: ClientStages,
        keys: Sequence[str],
        router: Router,
        *,
        timeout: float = 30.0,
        max_attempts: int = 5,
        on_failover: Callable[[int, str, str], None] | None = None,
        adapters: Mapping[str, Array] | None = None,
        verify: bool = False,
        rtol: float = 1e-2,
        atol: float = 1e-3,
        mux: StepMux | None = None,
        chains: ChainInbox | None = None,
    ) -> None:
        provider = [s for s in stages.manifest.stages if s.placement == "provider"]
        if len(provider) != len(keys):
            raise ValueError(f"{len(provider)} provider stages but {len(keys)} stage keys")
        if not any(i.name.startswith("past_") for s in provider for i in s.inputs):
            raise ClientStageError(
                f"model {stages.manifest.name} keeps no KV cache: it is not a decoder"
            )
        self.host = host
        self.mux = mux  # shared by a client's sessions: their steps to a provider go together
        self.chains = chains  # this host's chained steps (None: every step the star way)
        self.chain_strikes = 0  # chained steps that broke with every provider still serving
        self.chain_excused = False  # the last broke for what may be another session's step
        self.chained = 0  # steps that went as chains
        self.client = stages
        self.router = router
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.on_failover = on_failover
        self.id = uuid.uuid4().hex
        self.stages = [_Stage(k, s) for k, s in zip(keys, provider, strict=True)]
        self.adapters = dict(adapters or {})  # a LoRA adapter: graph input name -> tensor
        self.past = 0  # tokens fed so far
        self.fed: list[int] = []  # and which
        self.valid_until = stages.manifest.cache_valid_until()
        self.wire = stages.manifest.wire  # how hidden states travel (`ir.manifest.WIRES`)
        self.hidden_bytes = 0  # bytes of hidden states sent and received, replays included
        self.failovers = 0
        self.abandoned: list[tuple[str, str, str]] = []  # (peer, stage key, session id)
        # Shadow steps: each stage's step also runs on a second provider and the answers are
        # compared; a provider the broker then finds wrong is not used again.
        self.verify, self.rtol, self.atol = verify, rtol, atol
        self.checked = 0  # stage steps whose answer a second provider confirmed
        self.unchecked = 0  # stage steps no second provider could check
        self.distrusted: set[str] = set()
        self.lost: set[str] = set()  # providers whose connection failed on one of our stages
        self.commitments = Commitments()  # the providers' signed commitments to their outputs
        self.last_step = time.monotonic()  # when the last step was answered

    async def feed(self, tokens: Sequence[int]) -> Array:
        """Run `tokens` after those fed before; returns the logits of the last one (vocab,)."""
        tokens = list(tokens)
        if self.valid_until is not None and 0 < self.past <= self.valid_until < self.past + len(
            tokens
        ):  # the providers' caches no longer hold what the longer context computes: again
            tokens = self.fed + tokens
            for stage in self.stages:
                self._abandon(stage)
                drop_shadow(self, stage)
                stage.history.clear()
            self.past, self.fed = 0, []
        ids = np.array([tokens], dtype=np.int64)
        positions = np.arange(self.past, self.past + ids.shape[1], dtype=np.int64)[None, :]
        if self.mux is not None:  # with the other sessions' embeddings of this moment
            hidden = await self.mux.embed(self.client, ids, positions, self.id)
        else:
            hidden = await asyncio.to_thread(self.client.embed, ids, positions)
        expect = self.past + ids.shape[1]
        try_chain = chainable(self)
        if try_chain and (out := await chained_step(self, hidden, positions, expect)) is not None:
            for pos, stage in enumerate(self.stages):  # (a later stage's hidden inputs
                # are kept by the previous stage's provider: `fill_history` asks for them)
                stage.history.append(_feeds(stage, hidden if pos == 0 else None, positions))
            hidden = out
            self.chained += 1
        else:
            failovers = self.failovers
            for pos, stage in enumerate(self.stages):
                feeds = _feeds(stage, hidden, positions)
                if self.verify:
                    hidden = await checked_step(self, pos, stage, feeds, expect)
                else:
                    hidden = await self._step(pos, stage, feeds, expect)
                stage.history.append(feeds)
            if try_chain and self.failovers == failovers and not self.chain_excused:
                self.chain_strikes += 1  # broken, yet everyone serves
        self.past += ids.shape[1]
        self.last_step = time.monotonic()
        self.fed += tokens
        if self.mux is not None:
            logits = await self.mux.head(self.client, hidden)
        else:
            logits = await asyncio.to_thread(self.client.head, hidden, np.ones_like(ids))
        return np.asarray(logits[0, -1], dtype=np.float32)

    async def _step(self, pos: int, stage: _Stage, feeds: dict[str, Array], expect: int) -> Array:
        """Run one step of `stage`; the provider must then hold `expect` tokens of context."""
        avoid: set[str] = self.distrusted | self.lost
        failures = 0
        busy_until: float | None = None
        if stage.peer is not None and stage.peer in self.lost:  # (lost on an earlier stage)
            lost = stage.peer
            self._abandon(stage)
            stage.peer = None
            failures += 1
            self._failed_over(pos, stage, lost, "its provider was lost on an earlier stage")
        while True:
            if stage.peer is None:
                stage.peer = await self.router.pick(pos, avoid)
            peer = stage.peer
            opening = stage.sid is None
            try:
                if stage.sid is None:
                    await self._open(stage, peer)
                out = await self._request(stage, peer, feeds)
                if out.past_len != expect:
                    raise Mismatch(f"it holds {out.past_len} tokens of context, not {expect}")
            except RemoteError as exc:
                now = asyncio.get_running_loop().time()
                if exc.code == ErrorCode.BUSY and (busy_until is None or now < busy_until):
                    busy_until = busy_until or now + self.timeout  # full for now: wait a while
                    await asyncio.sleep(BUSY_WAIT_S)  # (an open session is left unchanged)
                    continue
                busy_until = None
                self._abandon(stage)
                if exc.code != ErrorCode.NOT_FOUND or opening:
                    avoid.add(peer)  # (NOT_FOUND on a step: the session expired; reopen and
                    stage.peer = None  # replay there. On an open: the stage is not loaded.)
                reason = f"{exc.code}: {exc}"
            except (RequestTimeout, P2PError, Lost, Mismatch) as exc:
                self._abandon(stage)
                avoid.add(peer)
                if not isinstance(exc, Mismatch):
                    self.lost.add(peer)
                stage.peer = None
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, RequestTimeout | P2PError):
                    await self.router.failed(pos, peer, reason)
            else:
                hidden = out.outputs.get("hidden_states_out")
                if hidden is None:
                    raise GenerationError(f"{stage.key} on {peer} answered no hidden_states_out")
                return hidden.to_numpy()
            failures += 1
            self._failed_over(pos, stage, peer, reason)
            if failures >= self.max_attempts:
                raise GenerationError(
                    f"stage {stage.key} failed {failures} times; last on {peer}: {reason}"
                )

    def _failed_over(self, pos: int, stage: _Stage, peer: str, reason: str) -> None:
        self.failovers += 1
        if self.on_failover is not None:
            self.on_failover(pos, peer, reason)
        log.info("session %s: stage %s on %s failed (%s)", self.id, stage.key, peer, reason)

    def _abandon(self, stage: _Stage) -> None:
        """Stop using the stage's open session (closed, best effort, with the others)."""
        if stage.sid is not None and stage.peer is not None:
            self.abandoned.append((stage.peer, stage.key, stage.sid))
        stage.sid = None

    async def _open(self, stage: _Stage, peer: str) -> None:
        """Open a fresh session on `peer` and replay everything this stage has seen (for a
        replacement); only a session whose replay succeeded is used."""
        stage.opens += 1
        sid = f"{self.id}.{stage.opens}"
        opened = await self._call(peer, self._opening(stage, sid, peer))
        if isinstance(opened, SessionOpened):
            stage.idle_timeout_s = opened.idle_timeout_s
        self.commitments.opened(sid, peer, stage.key)
        try:
            if any("hidden_states" not in h for h in stage.history):  # (chained steps)
                await fill_history(self, self.stages.index(stage))
            if stage.history:
                out = await self._request(stage, peer, joined(stage.history), sid, past=0)
                if out.past_len != self.past:
                    raise Mismatch(f"after the replay it holds {out.past_len}, not {self.past}")
        except BaseException:
            self.abandoned.append((peer, stage.key, sid))
            raise
        stage.sid = sid

    def _opening(self, stage: _Stage, sid: str, peer: str, check: bool = False) -> SessionOpen:
        """The open of session `sid` on a stage on `peer`, with the session's adapter and,
        where its steps may chain, this host's key for the peer's tags of them."""
        mine = {
            name: Tensor.from_numpy(self.adapters[name])
            for a in stage.info.adapters
            for name in (a.a_input, a.b_input)
            if name in self.adapters
        }
        key = self.chains.key_for(peer) if self.chains is not None and not check else b""
        return SessionOpen(session=sid, stage=stage.key, adapters=mine, check=check, route_key=key)

    async def _request(
        self,
        stage: _Stage,
        peer: str,
        feeds: dict[str, Array],
        sid: str | None = None,
        *,
        past: int | None = None,
    ) -> SessionOutput:
        """A step of `stage`'s session (`sid`, else its open one) on `peer`, after `past`
        tokens (default: the session's so far; a provider that ran it answers it again)."""
        inputs = feeds  # adapter inputs: the session's adapter, or the provider's zeros
        names = {i.name for i in stage.info.inputs}
        session = sid or stage.sid
        assert session is not None
        sent = {
            k: encode(v, self.wire if k == "hidden_states" else "native")
            for k, v in inputs.items()
            if k in names
        }
        step = SessionStep(
            session=session, stage=stage.key, inputs=sent, past=self.past if past is None else past
        )
        answer = await self._call(peer, step)
        if not isinstance(answer, SessionOutput):
            raise Mismatch(f"it answered {type(answer).__name__} to a step")
        self.commitments.add(answer.commitments)
        back = answer.outputs.get("hidden_states_out")
        if back is not None and back.wire != self.wire:
            raise Mismatch(f"it answered hidden states in the {back.wire} format, not {self.wire}")
        out = sent.get("hidden_states")
        self.hidden_bytes += (out.nbytes if out else 0) + (back.nbytes if back else 0)
        return answer

    async def _call(self, peer: str, msg: SessionOpen | SessionStep | SessionClose) -> Any:
        if self.mux is not None and isinstance(msg, SessionStep):
            request = self.mux.step(peer, msg, self.timeout)
        else:
            request = self.host.request(peer, SESSION, msg, timeout=self.timeout)
        lost = self.router.lost(peer)
        if lost is None:
            return await request
        call = await unless_lost(request, lost)
        if call is None:
            raise Lost(f"{peer} was declared lost")
        return call.result()

    async def close(self) -> None:
        """Close the sessions, those given up on included (best effort: a provider that is
        gone has dropped them)."""
        idle = time.monotonic() - self.last_step
        for stage in self.stages:
            if stage.sid is not None and idle < stage.idle_timeout_s:  # in use to the end and
                # not dropped as idle since: to commit to every token it holds
                self.commitments.ended(stage.sid, stage.key, self.past)
            self._abandon(stage)
            drop_shadow(self, stage)
        if self.mux is not None:
            self.mux.forget(self.client, self.id)
        todo, self.abandoned = self.abandoned, []

        async def one(peer: str, key: str, sid: str) -> None:
            try:
                closed = await self.host.request(
                    peer, SESSION, SessionClose(session=sid, stage=key), timeout=5
                )
            except P2PError:
                closed = None
            if isinstance(closed, SessionClosed):  # (the commitments not sent yet)
                self.commitments.add(closed.commitments)
            else:
                self.commitments.unanswered(sid, key)

        await asyncio.gather(*(one(*t) for t in todo))


def _feeds(stage: _Stage, hidden: Array | None, positions: Array) -> dict[str, Array]:
    """A stage's inputs of a step (no hidden states: those of a chained step, which the
    previous stage's provider keeps)."""
    feeds = {} if hidden is None else {"hidden_states": hidden}
    if any(i.name == "position_ids" for i in stage.info.inputs):
        feeds["position_ids"] = positions
    return feeds


async def unless_lost(
    request: Awaitable[T], lost: asyncio.Event | Sequence[asyncio.Event]
) -> asyncio.Future[T] | None:
    """Await `request` unless `lost` (or any of several) is set first: the finished call (its
    result or error), or None when it was abandoned (cancelled) because a peer it needs was
    declared lost."""
    call = asyncio.ensure_future(request)
    events = [lost] if isinstance(lost, asyncio.Event) else list(lost)
    watches = [asyncio.ensure_future(e.wait()) for e in events]
    abandoned = True
    try:
        await asyncio.wait({call, *watches}, return_when=asyncio.FIRST_COMPLETED)
        abandoned = not call.done()
    finally:
        for watch in watches:
            watch.cancel()
        if abandoned:
            call.cancel()  # lost, or we were cancelled: the request is abandoned
    return None if abandoned else call


async def generate(
    session: GenerationSession,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler,
    *,
    stops: Collection[int] = (),
) -> AsyncGenerator[int]:
    """Yield up to `max_new_tokens` sampled tokens (stopping after any of `stops`, which is
    yielded)."""
    if not prompt:
        raise ClientStageError("the prompt has no tokens")
    logits = await session.feed(prompt)
    for i in range(max_new_tokens):
        if session.mux is not None:  # (with the other sessions' picks, off the loop)
            token = await session.mux.sample(sampler, logits)
        elif sampler.greedy:
            token = sampler.pick(logits)
        else:  # (a temperature over a large vocabulary: milliseconds)
            token = await asyncio.to_thread(sampler.pick, logits)
        yield token
        if token in stops or i + 1 == max_new_tokens:
            return
        logits = await session.feed([token])
