"""The provider's side of the hardware check: only its broker is answered, with its own
executor, and the answer it committed to is the one it reveals."""

from __future__ import annotations

import hashlib

import pytest

from ir.challenge import Work, wrong_rows
from p2p import Refused
from proto.challenge import Challenge, Committed, Reveal, Revealed
from provider.challenge import Checks
from provider.hosting import ExecutorChoice

BROKER = "broker-peer"
SEED = b"s" * 16


def test_the_broker_gets_a_committed_answer_and_then_reveals_it() -> None:
    checks = Checks(ExecutorChoice("ort"), BROKER)
    checks.prepare()
    committed = checks.on_challenge(
        BROKER, Challenge(seed=SEED, rows=80, rounds=17, width=512, window_s=30.0)
    )
    assert isinstance(committed, Committed) and committed.rounds == 17
    revealed = checks.on_challenge(BROKER, Reveal(seed=SEED))
    assert isinstance(revealed, Revealed)
    assert hashlib.sha256(revealed.answer).digest() == committed.digest
    assert wrong_rows(Work(SEED, 80, 17), 17, revealed.answer, list(range(80))) == []
    checks.release()
    with pytest.raises(Refused, match="no answer"):  # released: nothing kept
        checks.on_challenge(BROKER, Reveal(seed=SEED))


def test_no_one_but_its_broker_can_make_it_compute() -> None:
    checks = Checks(ExecutorChoice("ort"), BROKER)
    ask = Challenge(seed=SEED, rows=80, rounds=1, width=512, window_s=1.0)
    with pytest.raises(Refused, match="only this provider's broker"):
        checks.on_challenge("someone-else", ask)
    with pytest.raises(Refused, match="512 wide"):
        checks.on_challenge(BROKER, Challenge(seed=SEED, rows=8, rounds=1, width=64, window_s=1.0))
    with pytest.raises(Refused, match="no answer"):
        checks.on_challenge(BROKER, Reveal(seed=b"x" * 16))
