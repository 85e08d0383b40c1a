"""The shard store a provider keeps for others: bounded, newest snapshots only, checked input."""

from __future__ import annotations

import pytest

from p2p import Refused
from proto.snapshot import ShardPut
from provider.training import ShardStore


def put(store: ShardStore, step: int, index: int = 0, size: int = 100, **extra: object) -> int:
    fields = {"job": "j", "stage": "m/1", "step": step, "index": index, "k": 2, "n": 3}
    fields.update(extra)  # type: ignore[arg-type]
    return store.put(ShardPut(size=size, data=b"x" * 50, **fields))  # type: ignore[arg-type]


def test_keeps_the_newest_complete_snapshot_and_later_ones_within_its_budget() -> None:
    store = ShardStore(budget_bytes=300)
    for step in (3, 6, 9):  # the broker says which snapshot every stage completed
        put(store, step, 0, committed=step - 3)
        put(store, step, 1, committed=step - 3)
    assert {k[2] for k in store.shards} == {6, 9}
    assert store.get("j", "m/1", 9, 1) == b"x" * 50 and store.get("j", "m/1", 3, 0) is None
    put(store, 9, 2, stage="m/2")
    put(store, 9, 0, stage="m/3")
    with pytest.raises(Refused, match="shard memory full"):
        put(store, 9, 1, stage="m/3")
    store.drop("j")
    assert store.bytes_held == 0


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"index": 3}, "index < n"),
        ({"k": 4}, "k <= n"),
        ({"size": 101}, "size does not fit"),
        ({"size": 0}, "size does not fit"),
    ],
)
def test_refuses_malformed_shards(extra: dict[str, int], why: str) -> None:
    with pytest.raises(Refused, match=why):
        put(ShardStore(1 << 20), 1, **extra)
