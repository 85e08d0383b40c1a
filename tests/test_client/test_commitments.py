"""Providers' signed commitments to a generation's outputs (`provider/commitments.py`), as the
SDK gathers them (`client/commitments.py`), in-process on the memory network with real stage
servers: star and chained steps, a failover, and a forged commitment."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from client.chained import ChainInbox
from ir.package import load_package
from ir.toploc import CHUNK, TOLERANCES, check_rows
from p2p import Identity, verify
from p2p.testing import MemoryNetwork
from proto.session import COMMITMENT_DOMAIN, Commitment
from tests.test_client.test_chains import PROMPT, Swarm, _generate
from tests.toploc_runs import forget_executors, recompute

pytestmark = pytest.mark.timeout(120)
NEW = 40  # tokens generated: 4 + 39 fed, two chunks of each stage's outputs


@pytest.fixture
async def swarm(llama3_packages: dict[str, Path]) -> Any:
    s = Swarm(MemoryNetwork(), llama3_packages["fp32"])
    for pos in (0, 1, 2, 1):  # the last: a spare for the middle stage
        peer = await s.provider(pos)
        identity = next(h.identity for h in s.hosts if h.peer_id == peer)
        s.servers[peer].sign = lambda data, i=identity: i.sign(data, domain=COMMITMENT_DOMAIN)
    yield s
    await s.close()
    forget_executors()


def _checked(swarm: Swarm, session: Any, sent: dict[str, Any] | None = None) -> None:
    """Every provider session committed to each chunk of its outputs, signed by the provider
    it was opened on, and one prefill pass over the tokens fed reproduces them."""
    fed = session.fed
    assert len(fed) == len(PROMPT) + NEW - 1
    rows = recompute(load_package(swarm.package), "ort", fed)
    assert session.commitments.refused == 0
    opened = session.commitments.checkable(len(fed))
    assert {o.stage for _, o in opened} == set(swarm.keys)
    for sid, o in opened:
        pos = swarm.keys.index(o.stage)
        chunks = [o.chunks[i] for i in sorted(o.chunks)]
        assert [c.chunk for c in chunks] == list(range(len(chunks)))
        assert [c.tokens for c in chunks] == [CHUNK, len(fed) - CHUNK]
        check = check_rows(rows[pos], [c.data for c in chunks])
        assert check.within(TOLERANCES["float32"]), (o.stage, check)
        if pos > 0 and session.failovers == 0:  # given what the stage before committed to
            (before,) = [b for _, b in opened if b.stage == swarm.keys[pos - 1]]
            assert [c.input_data for c in chunks] == [before.chunks[c.chunk].data for c in chunks]
        if sent is not None and pos == 0:  # what the first stage was given: the embedding
            given = sent[sid]
            for c in chunks:
                start = c.chunk * CHUNK
                digest = hashlib.sha256(given[start : start + c.tokens].tobytes()).digest()
                assert c.input_sha256 == digest


async def test_each_stage_commits_to_its_outputs_star_and_chained(swarm: Swarm) -> None:
    async with swarm.net.host() as client:
        star = await _generate(swarm, client, None, new=NEW)
        chained = await _generate(swarm, client, ChainInbox(client), new=NEW)
    assert star.chained == 0 and chained.chained == NEW - 1
    embedded = swarm.client_stages.embed(np.array([star.fed], dtype=np.int64))[0]
    first = {
        sid: embedded
        for sid, o in star.commitments.checkable(len(star.fed))
        if o.stage == swarm.keys[0]
    }
    _checked(swarm, star, first)
    _checked(swarm, chained)


async def test_a_replacement_commits_to_the_whole_session_from_its_replay(swarm: Swarm) -> None:
    async with swarm.net.host() as client:
        session = await _generate(swarm, client, ChainInbox(client), new=NEW, kill_at=5)
    assert session.failovers == 1
    middle = [
        o for _, o in session.commitments.checkable(len(session.fed)) if o.stage == swarm.keys[1]
    ]
    assert len(middle) == 1  # the dead one committed to nothing (its 4 + 4 tokens went with it)
    _checked(swarm, session)


async def test_a_provider_that_withholds_commitments_fails_the_check(swarm: Swarm) -> None:
    """A session in use to the end commits to every token it held: the middle stage's
    provider signing nothing (or its close's commitments not coming) fails the generation's
    check, whatever the broker finds of the others; no one is quarantined for it."""
    from client.verifying import with_withheld
    from proto.api.swarm import Verdict

    async with swarm.net.host() as client:
        whole = await _generate(swarm, client, None, new=NEW)
        assert not whole.commitments.withheld(len(whole.fed))
        assert with_withheld("m", whole, None) is None
        middle = swarm.keys[1]
        for server in swarm.servers.values():
            if middle in server.stages:
                server.sign = None  # (as a provider that sends no commitments)
        session = await _generate(swarm, client, None, new=NEW)
    ((_, o, _),) = session.commitments.withheld(len(session.fed))
    assert o.stage == middle and o.covered == 0 and o.held == len(session.fed) == 43
    broker_found = Verdict("m", True, [], [])
    verdict = with_withheld("m", session, broker_found)
    assert verdict is not None and not verdict.ok and not verdict.quarantined
    (found,) = verdict.sessions
    assert found.ok is False and found.stage == middle and "0 of the 43 tokens" in found.reason


def test_a_commitment_not_signed_by_the_provider_of_that_session_is_refused() -> None:
    from client.commitments import Commitments
    from proto.session import commitment_bytes

    provider, stranger = Identity.ephemeral(), Identity.ephemeral()
    book = Commitments()
    book.opened("s.1", provider.peer_id, "m/1")
    fields = ("s.1", "m/1", 0, CHUNK, b"\x00" * 32, b"\x03" * 258, b"\x01" * 258)

    def made(by: Identity, *values: Any) -> Commitment:
        unsigned = Commitment(*values, b"")
        signature = by.sign(commitment_bytes(unsigned), domain=COMMITMENT_DOMAIN)
        return msgspec.structs.replace(unsigned, signature=signature)

    good = made(provider, *fields)
    book.add([made(stranger, *fields), made(provider, "s.2", *fields[1:])])
    book.add([msgspec.structs.replace(good, data=b"\x02" * 258)])  # altered after signing
    assert book.refused == 3 and not book.checkable(CHUNK)
    book.add([good, good])  # (a step answered again sends its commitments again)
    assert book.refused == 3 and book.sessions[("s.1", "m/1")].chunks == {0: good}
    assert [sid for sid, _ in book.checkable(CHUNK)] == ["s.1"] and not book.withheld(CHUNK)
    book.ended("s.1", "m/1", CHUNK + 5)  # in use to the end, holding more than it covers
    ((sid, _, why),) = book.withheld(CHUNK + 5)
    assert sid == "s.1" and f"committed to {CHUNK} of the {CHUNK + 5} tokens" in why
    # a chunk that claims more tokens than a chunk holds covers nothing: not sent to be
    # checked (the broker would refuse the whole request), and it fails the check
    book.opened("s.3", provider.peer_id, "m/1")
    book.add([made(provider, "s.3", "m/1", 0, 10_000, *fields[4:])])
    assert book.sessions[("s.3", "m/1")].covered is None
    assert [sid for sid, _ in book.checkable(CHUNK + 5)] == ["s.1"]
    assert [sid for sid, _, _ in book.withheld(CHUNK + 5)] == ["s.1", "s.3"]


def test_only_a_stage_given_the_right_inputs_is_found_guilty_of_wrong_outputs() -> None:
    from broker.commitcheck import judge
    from ir.toploc import Check

    tol = TOLERANCES["float32"]
    good, bad = Check(0, 128, 0), Check(40, 88, 300)
    # the second stage computed wrong: guilty; the third, given its outputs, is not judged
    found = judge([(0, good, good), (1, good, bad), (2, bad, bad)], tol)
    assert [(f.ok, f.guilty) for f in found] == [(True, False), (False, True), (None, False)]
    # the second stage says it was given other than the first committed to sending: one of
    # them lies about the hand-over, and neither is found guilty
    found = judge([(0, good, good), (1, bad, bad), (2, bad, bad)], tol)
    assert [(f.ok, f.guilty) for f in found] == [(True, False), (False, False), (None, False)]
    assert "hand-over" in found[1].reason


@pytest.mark.parametrize("deferred", [False, True])
def test_a_ledger_hands_out_each_chunk_once_in_order_and_the_rest_at_its_close(
    deferred: bool,
) -> None:
    """A provider's ledger (`provider.commitments.Ledger`), its chunks worked out in the
    provider's commitment thread or on the step's path: every chunk's signed commitment comes
    out once, in order, each answer carrying those finished since the one before and the
    close the rest; a chunk with NaN ends them."""
    from ir.toploc import commit
    from proto.session import commitment_bytes
    from provider.commitments import Ledger, worker

    provider = Identity.ephemeral()
    rng = np.random.default_rng(3)
    given = rng.standard_normal((2 * CHUNK + 6, 16)).astype(np.float32)
    sent = rng.standard_normal((2 * CHUNK + 6, 16)).astype(np.float32)

    def sign(data: bytes) -> bytes:
        return provider.sign(data, domain=COMMITMENT_DOMAIN)

    ledger = Ledger("s.1", "m/1", sign, worker() if deferred else None)
    made = ledger.add(given[:12], sent[:12])  # a prompt, then a token at a time
    for i in range(12, len(sent)):
        made += ledger.add(given[i : i + 1], sent[i : i + 1])
    made += ledger.finish()
    assert [c.chunk for c in made] == [0, 1, 2]
    assert [c.tokens for c in made] == [CHUNK, CHUNK, 6]
    assert ledger.finish() == []  # (nothing twice)
    for c in made:
        rows = slice(c.chunk * CHUNK, c.chunk * CHUNK + c.tokens)
        assert c.data == commit(sent[rows]) and c.input_data == commit(given[rows])
        assert c.input_sha256 == hashlib.sha256(given[rows].tobytes()).digest()
        assert verify(provider.peer_id, commitment_bytes(c), c.signature, domain=COMMITMENT_DOMAIN)

    broken = sent.copy()
    broken[CHUNK + 3, 0] = np.nan
    ledger = Ledger("s.2", "m/1", sign, worker() if deferred else None)
    made = [c for i in range(len(sent)) for c in ledger.add(given[i : i + 1], broken[i : i + 1])]
    assert [c.chunk for c in made + ledger.finish()] == [0]


def test_a_close_does_not_wait_behind_other_sessions_commitments() -> None:
    """Chunks still waiting for a busy commitment thread are worked out by the close itself,
    in order; a dropped session's are not worked out at all."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from provider.commitments import Ledger

    provider = Identity.ephemeral()
    rows = np.random.default_rng(4).standard_normal((2 * CHUNK + 3, 16)).astype(np.float32)

    def sign(data: bytes) -> bytes:
        return provider.sign(data, domain=COMMITMENT_DOMAIN)

    busy, release = ThreadPoolExecutor(1), threading.Event()
    try:
        busy.submit(release.wait, 60)  # (another session's work, for as long as it takes)
        ledger = Ledger("s.1", "m/1", sign, busy)
        made = [c for i in range(len(rows)) for c in ledger.add(rows[i : i + 1], rows[i : i + 1])]
        assert made == []  # (the thread is busy: nothing finished yet)
        assert [c.chunk for c in ledger.finish()] == [0, 1, 2]
        dropped = Ledger("s.2", "m/1", sign, busy)
        for i in range(len(rows)):
            dropped.add(rows[i : i + 1], rows[i : i + 1])
        waiting = [f for f, _ in dropped.pending]
        dropped.cancel()
        assert len(waiting) == 2 and all(f.cancelled() for f in waiting)
    finally:
        release.set()
        busy.shutdown()
