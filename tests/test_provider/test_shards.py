"""The shard store a provider keeps for others: bounded, newest snapshots only, checked input;
a restore rebuilds from the first k shards that check out."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from p2p import Refused
from p2p.testing import MemoryNetwork
from proto.snapshot import SHARD, Holder, ShardPut, SnapshotRestore
from proto.train import TrainOpen
from provider.serving import Server
from provider.shards import ShardStore, encode, sha256
from provider.training import Training


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


async def test_a_restore_rebuilds_from_the_first_k_shards_and_waits_for_no_other_holder() -> None:
    net = MemoryNetwork()
    state = os.urandom(10_000)
    shards = encode(state, 2, 3)
    trainings = [Training(Server(), "broker", lambda stage: None) for _ in range(3)]
    hosts = [net.host() for _ in trainings]
    for host, training in zip(hosts, trainings, strict=True):
        await host.start()
        training.host = host
        host.add_compute_handler(SHARD, training.shard)
    try:
        for i, training in enumerate(trainings):  # holder i keeps shard i
            training.store.put(
                ShardPut(job="j", stage="m/1", step=4, index=i, k=2, n=3, size=len(state),
                         data=shards[i], committed=0)
            )  # fmt: skip
        net.freeze(hosts[2].peer_id)  # the third holder does not answer (its timeout: 30 s)
        request = SnapshotRestore(
            open=TrainOpen(job="j", stage="m/1", method="lora-fa", lr=0.1, microbatches=1,
                           adapters={}),
            step=4,
            k=2,
            sha256=sha256(state),
            size=len(state),
            shards=[sha256(s) for s in shards],
            holders=[Holder(peer=h.peer_id, addrs=[f"/memory/p2p/{h.peer_id}"]) for h in hosts],
        )  # fmt: skip
        start = time.monotonic()
        rebuilt = await asyncio.wait_for(trainings[0]._gather(request), 5.0)
        assert rebuilt == state and time.monotonic() - start < 5.0
        assert len(trainings[0].stragglers) == 1  # the frozen holder's fetch, left running
        net.freeze(hosts[2].peer_id, frozen=False)
        await asyncio.wait_for(asyncio.gather(*trainings[0].stragglers), 5.0)
        assert not trainings[0].stragglers
        for host in hosts[1:]:  # now only the shard held here is left: a clear refusal
            net.kill(host.peer_id)
        with pytest.raises(Refused, match="1 of the 2 shards needed are reachable"):
            await asyncio.wait_for(trainings[0]._gather(request), 5.0)
    finally:
        for host in hosts:
            await host.close()
