"""The erasure code of training snapshots and the shards a provider holds for others.

A stage's state (safetensors bytes) becomes n shards with a k-of-n code (zfec): any k rebuild
it. `ShardStore` keeps other providers' shards in RAM, bounded in bytes, newest snapshots only.
"""

from __future__ import annotations

import hashlib
import threading

from p2p import ErrorCode, Refused
from proto.snapshot import ShardPut


class ShardError(Exception):
    """Shards could not be encoded, stored or decoded; the message says why."""


def encode(data: bytes, k: int, n: int) -> list[bytes]:
    """n shards of `data`, any k of which rebuild it (zfec, a systematic Reed-Solomon code)."""
    if not 1 <= k <= n <= 256:
        raise ShardError(f"need 1 <= k <= n <= 256, got k={k} n={n}")
    import zfec.easyfec

    return [bytes(b) for b in zfec.easyfec.Encoder(k, n).encode(data)]


def decode(shards: dict[int, bytes], k: int, n: int, size: int) -> bytes:
    """The data back from at least k shards (index -> bytes)."""
    if len(shards) < k:
        raise ShardError(f"{len(shards)} of the {k} shards needed")
    import zfec.easyfec

    chosen = sorted(shards)[:k]
    blocks = [shards[i] for i in chosen]
    if len({len(b) for b in blocks}) != 1:
        raise ShardError("shards of different sizes")
    padlen = len(blocks[0]) * k - size
    if padlen < 0:
        raise ShardError("shards too small for the state's size")
    return bytes(zfec.easyfec.Decoder(k, n).decode(blocks, chosen, padlen))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ShardStore:
    """Shards of other providers' training state, in RAM, bounded in bytes. For each (job,
    stage), shards of snapshots older than the newest complete one (as the broker says) go."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.shards: dict[tuple[str, str, int, int], bytes] = {}  # (job, stage, step, index)
        self.lock = threading.Lock()

    @property
    def bytes_held(self) -> int:
        return sum(len(s) for s in self.shards.values())

    def put(self, msg: ShardPut) -> int:
        if not 1 <= msg.k <= msg.n <= 256 or not 0 <= msg.index < msg.n or msg.step < 0:
            raise Refused(ErrorCode.REFUSED, "bad shard: need 0 <= index < n, 1 <= k <= n <= 256")
        if not 0 < msg.size <= len(msg.data) * msg.k:
            raise Refused(ErrorCode.REFUSED, "bad shard: size does not fit k shards")
        with self.lock:
            key = (msg.job, msg.stage, msg.step, msg.index)
            old = self.shards.get(key)
            held = self.bytes_held - (len(old) if old is not None else 0)
            if held + len(msg.data) > self.budget:
                raise Refused(
                    ErrorCode.BUSY,
                    f"shard memory full ({self.bytes_held} of {self.budget} bytes)",
                )
            self.shards[key] = msg.data
            stale = [
                k
                for k in self.shards
                if k[:2] == (msg.job, msg.stage) and k[2] < min(msg.committed, msg.step)
            ]
            for k in stale:
                del self.shards[k]
            return self.bytes_held

    def get(self, job: str, stage: str, step: int, index: int) -> bytes | None:
        with self.lock:
            return self.shards.get((job, stage, step, index))

    def drop(self, job: str) -> int:
        with self.lock:
            for k in [k for k in self.shards if k[0] == job]:
                del self.shards[k]
            return self.bytes_held
