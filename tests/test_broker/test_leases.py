"""Managed keys and leases in process, on a virtual clock: limits per key and per model,
Retry-After, lapsed leases, revocation, and the first key being an admin's."""

from __future__ import annotations

import sqlite3

import pytest

from broker.auth import Keys
from broker.errors import TooBusy
from broker.jobkinds import JobError
from broker.keystore import Holder, KeyStore
from broker.leases import LEASE_TTL_S, LOCAL, Leases
from broker.schema import open_schema
from proto.api.keys import KeyRequest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_key_limits_model_slots_and_lapsed_leases() -> None:
    clock = Clock()
    slots = {"m": 3}
    leases = Leases(lambda model: slots.get(model, 0), clock=clock)
    bob = Holder("key_bob", "user", max_streams=2)
    held = [leases.acquire(bob, "m", "gw-a"), leases.acquire(bob, "m", "gw-b")]
    with pytest.raises(TooBusy, match="requests in progress") as busy:
        leases.acquire(bob, "m", "gw-a")  # bob's third, at either gateway
    assert busy.value.retry_after_s >= 1
    alice = Holder("key_alice", "user")
    leases.acquire(alice, "m")  # the broker's own: never lapses
    with pytest.raises(TooBusy, match="batch slots"):
        leases.acquire(alice, "m", "gw-a")  # the model's 3 slots are taken
    embeds = leases.acquire(alice, "m", "gw-a", session=False)  # embeddings take no slot
    assert leases.release(held[0], "gw-a") and not leases.release(held[0], "gw-a")
    assert not leases.release(held[1], "gw-a")  # only its gateway ends a lease
    # gw-b stops reporting: its lease lapses after the TTL, and frees bob's slot
    clock.now += LEASE_TTL_S - 1
    assert leases.renew("gw-a", [embeds]) == []  # gw-a's report keeps its lease
    clock.now += 2
    leases.expire()
    assert held[1] not in leases.leases
    assert leases.held() == {LOCAL: 1, "gw-a": 1}
    assert leases.renew("gw-b", [held[1]]) == [held[1]]  # lost: it learns so
    leases.acquire(bob, "m", "gw-a")


def test_per_minute_limit_says_when_to_come_back() -> None:
    clock = Clock()
    leases = Leases(lambda model: 0, clock=clock)
    carol = Holder("key_carol", "user", per_minute=2)
    for _ in range(2):
        leases.release(leases.acquire(carol, "m"))
        clock.now += 10
    with pytest.raises(TooBusy, match="last minute") as busy:
        leases.acquire(carol, "m")
    assert busy.value.retry_after_s == pytest.approx(40.0)  # the first start leaves at 60 s
    clock.now += 40
    leases.acquire(carol, "m")


def test_managed_keys_hashed_revoked_and_an_admin_first() -> None:
    db = sqlite3.connect(":memory:", isolation_level=None)
    open_schema(db)
    store = KeyStore(db, Keys([]))
    assert not store.required
    with pytest.raises(JobError, match="admin key first"):
        store.add(KeyRequest("alice"))
    admin, _ = store.add(KeyRequest("ops", "admin"))
    key, info = store.add(KeyRequest("alice", max_streams=4))
    assert store.required
    assert store.holder(key) == Holder(info.id, "user", 4, None)
    stored = [bytes(r[0]) for r in db.execute("SELECT digest FROM api_keys")]
    assert all(key.encode() not in d and len(d) == 32 for d in stored)  # SHA-256 alone
    store.revoke(info.id)
    assert store.holder(key) is None and store.holder(admin) is not None
    assert KeyStore(db, Keys([])).holder(key) is None  # as the database says, after a restart
    static = KeyStore(db, Keys(["s" * 16], ["a" * 16]))
    assert static.holder("s" * 16) == Holder("static", "user")
    assert static.holder("a" * 16) == Holder("static", "admin")
