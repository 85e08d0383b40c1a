"""Chained session steps, in-process on the memory network with real stage servers: a chained
session gives the star session's tokens in n + 1 network trips a token instead of 2n; a hop
killed mid-chain fails over to a spare with the same tokens; a pair of providers that cannot
reach each other sends the session back the star way; concurrent sessions chain together, a
message a hop; a forged or replayed route is refused, and a step sent again is answered from
what the provider kept."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.chained import ChainInbox
from client.sampling import Sampler
from client.session import GenerationSession, generate
from client.stages import ClientStages
from client.stepmux import StepMux
from ir.executors.ort import OrtExecutor
from ir.package import load_package
from p2p import ErrorCode, FrameError, Identity, Refused, RemoteError, Tensor
from p2p.codec import encode_message
from p2p.testing import MemoryHost, MemoryNetwork
from proto.session import (
    SESSION,
    SESSION_CHAIN,
    STEP_ROUTE_DOMAIN,
    ChainRow,
    ChainStep,
    ChainSteps,
    SessionOpen,
    SessionOutput,
    SessionStep,
    StepHop,
    route_tag,
    step_route_bytes,
    steps_route_bytes,
)
from provider import stepchain
from provider.serving import Server
from provider.stage import LoadedStage, Session
from provider.stepchain import check_step_route
from tests.tiny_models import greedy_with_gaps, same_as_alone

pytestmark = pytest.mark.timeout(120)
PROMPT, NEW_TOKENS = [5, 17, 300, 42], 12


class Swarm:
    """A provider per stage of a 3-stage decoder, and a spare for the middle one."""

    def __init__(self, net: MemoryNetwork, package: Path) -> None:
        self.net, self.package = net, package
        self.loaded = load_package(package)
        self.stages = [s for s in self.loaded.manifest.stages if s.placement == "provider"]
        self.keys = [f"m/{s.index}" for s in self.stages]
        self.holders: list[list[str]] = [[] for _ in self.stages]
        self.servers: dict[str, Server] = {}
        self.client_stages = ClientStages(package)  # one per model, as in a client
        self.hosts: list[MemoryHost] = []
        self.addrs: dict[str, list[str]] = {}  # (the in-memory network needs none)

    async def provider(self, *positions: int) -> str:
        host = self.net.host()
        await host.__aenter__()
        self.hosts.append(host)
        server = Server()
        for pos in positions:
            info = self.stages[pos]
            executor = OrtExecutor(self.loaded.models[info.index], threads=1)
            server.add(LoadedStage(self.keys[pos], info, executor, "active"))
            self.holders[pos].append(host.peer_id)
        server.peer_id = host.peer_id
        host.add_compute_handler(SESSION, server.session)
        host.add_compute_handler(SESSION_CHAIN, server.chain_step)
        self.servers[host.peer_id] = server
        return host.peer_id

    async def pick(self, pos: int, avoid: set[str]) -> str:  # (the session's router)
        alive = [p for p in self.holders[pos] if p in self.net.hosts]
        return next((p for p in alive if p not in avoid), alive[0])

    async def failed(self, pos: int, peer: str, reason: str) -> None:
        pass

    def lost(self, peer: str) -> None:
        return None

    async def close(self) -> None:
        for host in self.hosts:
            if host.peer_id in self.net.hosts:
                await host.__aexit__(None, None, None)


@pytest.fixture
async def swarm(llama3_packages: dict[str, Path]) -> AsyncIterator[Swarm]:
    s = Swarm(MemoryNetwork(), llama3_packages["fp32"])
    for pos in (0, 1, 2, 1):  # the last: a spare for the middle stage
        await s.provider(pos)
    yield s
    await s.close()


async def _generate(
    swarm: Swarm, client: MemoryHost, chains: ChainInbox | None, **hooks: Any
) -> GenerationSession:
    stages = swarm.client_stages
    session = GenerationSession(
        client, stages, swarm.keys, swarm, timeout=5, chains=chains, mux=hooks.get("mux"),
        on_failover=hooks.get("on_failover"),
    )  # fmt: skip
    tokens = []
    try:
        async for token in generate(session, PROMPT, hooks.get("new", NEW_TOKENS), Sampler(0.0)):
            tokens.append(token)
            if len(tokens) == hooks.get("kill_at"):
                swarm.net.kill(session.stages[hooks.get("victim", 1)].peer or "")
            if "on_token" in hooks:
                hooks["on_token"](session, len(tokens))
    finally:
        await session.close()
    session.tokens = tokens  # type: ignore[attr-defined]
    return session


def _legs(net: MemoryNetwork, since: int, protocols: tuple[str, ...]) -> int:
    return sum(1 for c in net.calls[since:] if c[2] in protocols)


async def test_a_chained_session_gives_the_star_tokens_in_fewer_trips(swarm: Swarm) -> None:
    want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
    async with swarm.net.host() as client:
        inbox = ChainInbox(client)
        n = len(swarm.net.calls)
        star = await _generate(swarm, client, None)
        star_legs = _legs(swarm.net, n, (SESSION.protocol_id,))
        n = len(swarm.net.calls)
        chained = await _generate(swarm, client, inbox)
        protocols = (SESSION.protocol_id, SESSION_CHAIN.protocol_id, "/fusionai/session-result/1")
        chain_legs = _legs(swarm.net, n, protocols)
    assert same_as_alone(star.tokens, want, gaps) and chained.tokens == star.tokens  # type: ignore[attr-defined]
    # the prompt goes the star way (it opens the sessions), every later step as one chain
    assert star.chained == 0 and chained.chained == NEW_TOKENS - 1
    assert chained.failovers == star.failovers == 0
    # per chained token: client -> 1 -> 2 -> 3 -> client, 4 legs for 3 stages, not 6
    opens_and_closes = 2 * 3
    assert star_legs == opens_and_closes + 3 * NEW_TOKENS
    assert chain_legs == opens_and_closes + 3 + 4 * (NEW_TOKENS - 1)
    assert not inbox.waiting


async def test_a_hop_killed_mid_chain_fails_over_with_the_same_tokens(swarm: Swarm) -> None:
    want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
    async with swarm.net.host() as client:
        inbox = ChainInbox(client)
        session = await _generate(swarm, client, inbox, kill_at=5)
    assert same_as_alone(session.tokens, want, gaps), session.tokens  # type: ignore[attr-defined]
    victim = swarm.holders[1][0]
    assert session.failovers == 1 and session.stages[1].peer == swarm.holders[1][1]
    assert victim not in swarm.net.hosts
    # the spare was replayed with the first stage's outputs so far (kept by its provider):
    # the chain broke once, that step went the star way, and the next ones chained again
    assert session.chained == NEW_TOKENS - 2 and session.chain_strikes == 0


async def test_a_provider_lost_on_one_stage_is_not_called_for_its_others(
    llama3_packages: dict[str, Path],
) -> None:
    """A provider serving two stages dies: both move to their spares, and the second without
    a call to the dead one (each call to it would cost a dial's wait on the Internet)."""
    swarm = Swarm(MemoryNetwork(), llama3_packages["fp32"])
    try:
        for positions in ((0, 1), (2,), (0, 1)):  # the last: a spare for both
            await swarm.provider(*positions)
        victim, spare = swarm.holders[0]
        want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
        moved: list[tuple[int, str, str]] = []
        async with swarm.net.host() as client:
            session = await _generate(
                swarm, client, ChainInbox(client), kill_at=5, victim=0,
                on_failover=lambda *e: moved.append(e),
            )  # fmt: skip
    finally:
        await swarm.close()
    assert same_as_alone(session.tokens, want, gaps), session.tokens  # type: ignore[attr-defined]
    assert [(pos, peer) for pos, peer, _ in moved] == [(0, victim), (1, victim)]
    assert "lost on an earlier stage" in moved[1][2]
    assert [s.peer for s in session.stages[:2]] == [spare, spare]


async def test_providers_that_cannot_reach_each_other_get_the_star_way(swarm: Swarm) -> None:
    want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
    first, second = swarm.holders[0][0], swarm.holders[1][0]
    swarm.net.block(first, second)
    async with swarm.net.host() as client:
        start = time.monotonic()
        session = await _generate(swarm, client, ChainInbox(client))
        took = time.monotonic() - start
    assert same_as_alone(session.tokens, want, gaps)  # type: ignore[attr-defined]
    assert session.failovers == 0 and session.chained == 0 and session.chain_strikes == 2
    # a chain whose first hop answers that it broke is given up at once: no wait for the
    # outputs it will never push (1 s each before, so over 2 s for the two broken steps;
    # about 0.15 s now, the whole generation)
    assert took < 1.8, took


async def test_generations_running_together_chain_their_steps_together(swarm: Swarm) -> None:
    """A client's concurrent generations of a model chain their steps along the same
    providers as one message a hop (`ChainSteps`, each hop running them as one batch), and
    give their tokens alone; with the middle hop killed mid-way, each fails over to the
    spare with the same tokens."""
    import asyncio

    want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
    async with swarm.net.host() as client:
        inbox, mux = ChainInbox(client), StepMux(client)
        n = len(swarm.net.calls)
        together = await asyncio.gather(
            *(_generate(swarm, client, inbox, mux=mux) for _ in range(3))
        )
        chain_calls = _legs(swarm.net, n, (SESSION_CHAIN.protocol_id,))
        for s in together:
            assert s.chained == NEW_TOKENS - 1 and s.failovers == 0
            assert same_as_alone(s.tokens, want, gaps), s.tokens  # type: ignore[attr-defined]
        # a ChainSteps carries several sessions' steps: fewer chain calls than chained steps
        assert inbox.batched > 0 and chain_calls < 3 * 3 * (NEW_TOKENS - 1)
        victim = swarm.holders[1][0]
        killed = await asyncio.gather(
            *(
                _generate(swarm, client, inbox, mux=mux, **({"kill_at": 5} if i == 0 else {}))
                for i in range(3)
            )
        )
    assert victim not in swarm.net.hosts
    for s in killed:
        assert same_as_alone(s.tokens, want, gaps), s.tokens  # type: ignore[attr-defined]
        assert s.failovers == 1 and s.stages[1].peer == swarm.holders[1][1]
    assert not inbox.waiting


async def test_a_step_refused_in_a_chain_of_several_counts_against_none(swarm: Swarm) -> None:
    """A provider drops one session of two chaining together: their shared chain breaks
    (that session's row is refused), both run the step the star way, the dropped one is
    opened again and replayed, and neither counts a broken route against its chains."""
    import asyncio

    want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
    dropped: list[str] = []

    def drop(session: GenerationSession, count: int) -> None:
        stage = session.stages[1]
        if count == 5 and not dropped and stage.peer is not None:
            server = swarm.servers[stage.peer]
            key = next(k for k in server.sessions if k[2] == stage.sid)
            server._dropped(server._taken([key]))
            dropped.append(session.id)

    async with swarm.net.host() as client:
        inbox, mux = ChainInbox(client), StepMux(client)
        sessions = await asyncio.gather(
            *(_generate(swarm, client, inbox, mux=mux, on_token=drop) for _ in range(2))
        )
    assert len(dropped) == 1
    for s in sessions:
        assert same_as_alone(s.tokens, want, gaps), s.tokens  # type: ignore[attr-defined]
        assert s.chain_strikes == 0 and s.chained >= NEW_TOKENS - 3


async def test_a_forged_chain_of_several_sessions_is_refused(swarm: Swarm) -> None:
    peers = [h[0] for h in swarm.holders]
    async with swarm.net.host() as client:
        for sid in ("a", "b"):
            for peer, key in zip(peers, swarm.keys, strict=True):
                await client.request(peer, SESSION, SessionOpen(session=sid, stage=key))
        route = [StepHop(p, k, "") for p, k in zip(peers, swarm.keys, strict=True)]
        hidden = np.random.default_rng(1).standard_normal((1, 1, 128)).astype(np.float32)
        inputs = {
            "hidden_states": Tensor.from_numpy(hidden),
            "position_ids": Tensor.from_numpy(np.zeros((1, 1), dtype=np.int64)),
        }

        def steps(signer: Identity, sessions: list[str], **changes: Any) -> ChainSteps:
            chain, expires = uuid.uuid4().hex, time.time() + 30
            rows = [ChainRow([sid] * len(route), 0, inputs) for sid in sessions]
            signed = steps_route_bytes(chain, route, rows, expires)
            msg = dict(
                chain=chain, origin=client.peer_id, route=route, rows=rows, hop=0,
                expires=expires, signature=signer.sign(signed, domain=STEP_ROUTE_DOMAIN),
            )  # fmt: skip
            return ChainSteps(**{**msg, **changes})

        short = [ChainRow(["a"], 0, inputs)]
        for bad, why in [
            (steps(Identity.ephemeral(), ["a", "b"]), "not signed by its origin"),
            (steps(client.identity, ["a", "a"]), "twice in one message"),
            (steps(client.identity, ["a", "b"], rows=short), "a session a hop"),
            (steps(client.identity, ["a", "b"], hop=1), "not this provider's"),
        ]:
            with pytest.raises(RemoteError, match=why) as info:
                await client.request(peers[0], SESSION_CHAIN, bad)
            assert info.value.code == ErrorCode.REFUSED
        assert all(s.past_len == 0 for s in swarm.servers[peers[0]].sessions.values())


async def test_forged_and_repeated_chained_steps(swarm: Swarm) -> None:
    peers = [h[0] for h in swarm.holders]
    server = swarm.servers[peers[0]]
    async with swarm.net.host() as client:
        for peer, key in zip(peers, swarm.keys, strict=True):
            await client.request(peer, SESSION, SessionOpen(session="s", stage=key))
        route = [StepHop(p, k, "s") for p, k in zip(peers, swarm.keys, strict=True)]
        hidden = np.random.default_rng(1).standard_normal((1, 1, 128)).astype(np.float32)
        inputs = {
            "hidden_states": Tensor.from_numpy(hidden),
            "position_ids": Tensor.from_numpy(np.zeros((1, 1), dtype=np.int64)),
        }

        def step(signer: Identity, **changes: Any) -> ChainStep:
            chain, expires = uuid.uuid4().hex, time.time() + 30
            signed = step_route_bytes(chain, route, 0, expires)
            msg = dict(
                chain=chain, origin=client.peer_id, route=route, hop=0, past=0, inputs=inputs,
                expires=expires, signature=signer.sign(signed, domain=STEP_ROUTE_DOMAIN),
            )  # fmt: skip
            return ChainStep(**{**msg, **changes})

        stranger = Identity.ephemeral()
        for bad, why in [
            (step(stranger), "not signed by its origin"),
            (step(client.identity, hop=1), "not this provider's"),
            (step(client.identity, expires=time.time() - 1), "expired"),
            (step(client.identity, past=3), "not signed by its origin"),  # (it covers past)
        ]:
            with pytest.raises(RemoteError, match=why) as info:
                await client.request(peers[0], SESSION_CHAIN, bad)
            assert info.value.code == ErrorCode.REFUSED
        assert all(s.past_len == 0 for s in server.sessions.values())
        # a step sent again after it ran: the same answer from what was kept, nothing run
        one = SessionStep(session="s", stage=swarm.keys[0], inputs=inputs, past=0)
        first = await client.request(peers[0], SESSION, one)
        runs = server.runs
        again = await client.request(peers[0], SESSION, one)
        assert isinstance(again, SessionOutput) and again == first and server.runs == runs
        assert again.past_len == 1
        with pytest.raises(RemoteError, match="holds 1 tokens, not the step's 5") as info:
            await client.request(peers[0], SESSION, SessionStep(**{**_fields(one), "past": 5}))
        assert info.value.code == ErrorCode.NOT_FOUND


async def test_hops_check_a_tag_made_with_their_key_not_the_signature(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client gives each provider a key with the sessions it opens there; a chained step
    carries a tag a hop made with it, which each hop checks instead of the route's Ed25519
    signature."""
    verified: list[str] = []
    real = stepchain.verify

    def counted(origin: str, *args: Any, **kwargs: Any) -> bool:
        verified.append(origin)
        return real(origin, *args, **kwargs)

    monkeypatch.setattr(stepchain, "verify", counted)
    want, gaps = greedy_with_gaps(swarm.package, PROMPT, NEW_TOKENS)
    async with swarm.net.host() as client:
        session = await _generate(swarm, client, ChainInbox(client))
    assert same_as_alone(session.tokens, want, gaps)  # type: ignore[attr-defined]
    assert session.chained == NEW_TOKENS - 1 and verified == []


def test_a_tag_stands_for_the_signature_only_with_the_hops_own_key() -> None:
    origin, stranger = Identity.ephemeral(), Identity.ephemeral()
    me, nxt = Identity.ephemeral().peer_id, Identity.ephemeral().peer_id
    mine, theirs = secrets.token_bytes(32), secrets.token_bytes(32)
    opened = {
        ("m/1", "s"): Session(origin.peer_id, "m/1", 1, {}, route_key=mine),
        ("m/1", "t"): Session(origin.peer_id, "m/1", 1, {}, route_key=theirs),
        ("m/1", "u"): Session(origin.peer_id, "m/1", 1, {}),  # opened without a key
    }
    route = [StepHop(me, "m/1", "s"), StepHop(nxt, "m/2", "s")]
    inputs = {"hidden_states": Tensor.from_numpy(np.zeros((1, 1, 4), dtype=np.float32))}

    def step(signer: Identity, keys: list[bytes], sid: str = "s") -> ChainStep:
        hops = [StepHop(h.peer, h.stage, sid) for h in route]
        chain, expires = uuid.uuid4().hex, time.time() + 30
        signed = step_route_bytes(chain, hops, 0, expires)
        return ChainStep(
            chain=chain, origin=origin.peer_id, route=hops, hop=0, past=0, inputs=inputs,
            expires=expires, signature=signer.sign(signed, domain=STEP_ROUTE_DOMAIN),
            tags=[route_tag(k, signed) for k in keys],
        )  # fmt: skip

    def steps(signer: Identity, keys: list[bytes], sids: list[str]) -> ChainSteps:
        hops = [StepHop(h.peer, h.stage, "") for h in route]
        rows = [ChainRow([sid] * len(hops), 0, inputs) for sid in sids]
        chain, expires = uuid.uuid4().hex, time.time() + 30
        signed = steps_route_bytes(chain, hops, rows, expires)
        return ChainSteps(
            chain=chain, origin=origin.peer_id, route=hops, rows=rows, hop=0, expires=expires,
            signature=signer.sign(signed, domain=STEP_ROUTE_DOMAIN),
            tags=[route_tag(k, signed) for k in keys],
        )  # fmt: skip

    def check(request: ChainStep | ChainSteps) -> None:
        check_step_route(request, origin.peer_id, me, lambda st, sid: opened.get((st, sid)))

    check(step(stranger, [mine, theirs]))  # the tag holds: no signature needed
    check(steps(stranger, [mine, theirs], ["s"]))
    check(step(origin, [theirs, mine]))  # a bad tag, a good signature
    for bad in [
        step(stranger, [theirs, theirs]),  # made with another hop's key
        step(stranger, [theirs, mine]),  # the next hop's tag in this hop's place
        step(stranger, [mine]),  # too few
        step(stranger, [mine, mine], sid="u"),  # the session has no key
        steps(stranger, [mine, mine], ["s", "t"]),  # its sessions' keys differ
    ]:
        with pytest.raises(Refused, match="not signed by its origin"):
            check(bad)
    with pytest.raises(FrameError, match="a route key has 32 bytes"):
        SESSION.decode_request(encode_message(SessionOpen(session="s", stage="m/1")).replace(
            b"\xa9route_key\xc4\x00", b"\xa9route_key\xc4\x05short"))  # fmt: skip


def _fields(msg: Any) -> dict[str, Any]:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}
