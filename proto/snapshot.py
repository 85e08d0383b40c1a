"""Erasure-coded, in-memory snapshots of fine-tuning state.

`/fusionai/snapshot/1` (broker -> provider): `SnapshotTake` makes the provider encode the state
it kept at a step (safetensors bytes) into n shards, any k of which rebuild it, and push one
shard to each holder; `SnapshotRestore` makes a provider rebuild a stage's state from k shards
(pulled from their holders, or its own copy) and go on training from it.

`/fusionai/shard/1` (provider -> provider): holders keep shards in RAM (`ShardPut`) and hand
them out (`ShardGet`); the broker may make them forget a job's shards (`ShardDrop`; closing the
job's training with `TrainClose` does it too).
"""

from __future__ import annotations

from p2p.codec import Message, ProtocolSpec
from proto.train import TrainOpen, TrainReady

MAX_SHARD_BYTES = 256 * 1024 * 1024


class Holder(Message, frozen=True, tag="Holder/1"):
    peer: str
    addrs: list[str]


class SnapshotTake(Message, frozen=True, tag="SnapshotTake/1"):
    job: str
    stage: str
    step: int
    k: int
    holders: list[Holder]  # n holders: shard i goes to holders[i]
    committed: int = 0  # the newest complete snapshot: holders keep it and newer ones


class SnapshotTaken(Message, frozen=True, tag="SnapshotTaken/1"):
    step: int
    sha256: str  # of the whole state
    size: int  # bytes of the whole state
    shards: list[str]  # SHA-256 of each shard, in holder order
    encode_ms: float = 0.0
    push_ms: float = 0.0


class SnapshotRestore(Message, frozen=True, tag="SnapshotRestore/1"):
    open: TrainOpen  # the run's settings (adapters left empty: they come from the snapshot)
    step: int
    k: int
    sha256: str
    size: int
    shards: list[str]  # SHA-256 of each shard
    holders: list[Holder]  # holders[i] keeps shard i


class ShardPut(Message, frozen=True, tag="ShardPut/1"):
    job: str
    stage: str
    step: int
    index: int
    k: int
    n: int
    size: int  # bytes of the whole state (the shards carry padding)
    data: bytes
    committed: int = 0  # shards of this stage older than this step may be dropped


class ShardGet(Message, frozen=True, tag="ShardGet/1"):
    job: str
    stage: str
    step: int
    index: int


class ShardDrop(Message, frozen=True, tag="ShardDrop/1"):
    job: str


class ShardStored(Message, frozen=True, tag="ShardStored/1"):
    bytes_held: int


class ShardData(Message, frozen=True, tag="ShardData/1"):
    data: bytes


SNAPSHOT = ProtocolSpec(
    "/fusionai/snapshot/1",
    request=(SnapshotTake, SnapshotRestore),
    response=(SnapshotTaken, TrainReady),
    max_message_bytes=16 * 1024 * 1024,
)
SHARD = ProtocolSpec(
    "/fusionai/shard/1",
    request=(ShardPut, ShardGet, ShardDrop),
    response=(ShardStored, ShardData),
    max_message_bytes=MAX_SHARD_BYTES,
)
