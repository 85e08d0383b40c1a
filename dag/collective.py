"""Ring all-reduce: how K replicas sum a buffer by talking only to their ring neighbours.

The buffer is cut into K chunks. In K - 1 reduce-scatter rounds each replica sends one chunk's
running sum to the next replica and adds what the previous one sent; then chunk c is complete
at replica c. In K - 1 all-gather rounds the complete chunks go once round the ring. Each
replica sends 2 (K - 1) / K of the buffer, whatever K is, and every replica ends with the very
same bytes (a complete chunk is copied, never re-added), so replicas that apply the sum stay
identical.

A chunk travels at the `wire` width (float32, or float16 to halve the bytes); the adding is in
float32, and the complete chunk is rounded to the wire width where it is made, so its owner
keeps what the others receive.

The links are passed in (`Links`): the p2p layer between providers, or queues in one process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

Array = np.ndarray[Any, Any]
WIRES = {"float32": np.float32, "float16": np.float16}


class CollectiveError(RuntimeError):
    """An all-reduce could not complete (a peer is gone, or sent what does not fit)."""


class Links(Protocol):
    """A replica's two ring links: send to the next replica, receive from the previous one.
    `tag` (round id, phase, chunk) tells chunks apart."""

    async def send(self, tag: tuple[int, int, int], data: Array) -> None: ...

    async def recv(self, tag: tuple[int, int, int]) -> Array: ...


def chunk_bounds(values: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each of `size` chunks of a buffer of `values` (numpy's array_split)."""
    base, extra = divmod(values, size)
    bounds, at = [], 0
    for i in range(size):
        n = base + (1 if i < extra else 0)
        bounds.append((at, at + n))
        at += n
    return bounds


def ring_bytes(values: int, size: int, wire: str = "float32") -> int:
    """Bytes one replica sends in a ring all-reduce of `values` (the largest share)."""
    if size <= 1:
        return 0
    width = np.dtype(WIRES[wire]).itemsize
    biggest = -(-values // size)
    return 2 * (size - 1) * biggest * width


async def ring_allreduce(
    buffer: Array, rank: int, size: int, links: Links, round_id: int, wire: str = "float32"
) -> Array:
    """The sum of every replica's `buffer` (float32, the same length everywhere), as replica
    `rank` of `size`; `round_id` must differ between all-reduces of one run."""
    if wire not in WIRES:
        raise CollectiveError(f"unknown wire type {wire!r}; use one of {list(WIRES)}")
    dtype = WIRES[wire]
    out = np.array(buffer, dtype=np.float32).reshape(-1)
    if size <= 1:
        return out.astype(dtype).astype(np.float32) if wire != "float32" else out
    bounds = chunk_bounds(out.size, size)

    def part(c: int) -> Array:
        start, end = bounds[c]
        return out[start:end]

    for step in range(size - 1):  # reduce-scatter
        send_c, recv_c = (rank - step) % size, (rank - step - 1) % size
        got, _ = await asyncio.gather(
            links.recv((round_id, 0, recv_c)),
            links.send((round_id, 0, send_c), part(send_c).astype(dtype)),
        )
        _check(got, part(recv_c), dtype)
        part(recv_c)[:] += got.astype(np.float32)
    mine = (rank + 1) % size  # complete here now
    part(mine)[:] = part(mine).astype(dtype).astype(np.float32)
    for step in range(size - 1):  # all-gather
        send_c, recv_c = (rank + 1 - step) % size, (rank - step) % size
        got, _ = await asyncio.gather(
            links.recv((round_id, 1, recv_c)),
            links.send((round_id, 1, send_c), part(send_c).astype(dtype)),
        )
        _check(got, part(recv_c), dtype)
        part(recv_c)[:] = got.astype(np.float32)
    return out


def _check(got: Array, want: Array, dtype: Any) -> None:
    if not isinstance(got, np.ndarray) or got.dtype != dtype or got.shape != want.shape:
        shape = getattr(got, "shape", None)
        raise CollectiveError(
            f"a neighbour sent {getattr(got, 'dtype', type(got).__name__)} {shape}, "
            f"expected {np.dtype(dtype)} {want.shape}"
        )


@dataclass
class LocalRing:
    """`size` replicas in one process (one asyncio loop): each replica's `Links` are queues."""

    size: int
    boxes: dict[tuple[int, tuple[int, int, int]], asyncio.Future[Array]] = field(
        default_factory=dict
    )
    sent: list[int] = field(default_factory=list)  # bytes each replica sent

    def __post_init__(self) -> None:
        self.sent = [0] * self.size

    def _box(self, to: int, tag: tuple[int, int, int]) -> asyncio.Future[Array]:
        key = (to, tag)
        if key not in self.boxes:
            self.boxes[key] = asyncio.get_running_loop().create_future()
        return self.boxes[key]

    def links(self, rank: int) -> Links:
        ring = self

        class _Links:
            async def send(self, tag: tuple[int, int, int], data: Array) -> None:
                ring.sent[rank] += data.nbytes
                ring._box((rank + 1) % ring.size, tag).set_result(data)

            async def recv(self, tag: tuple[int, int, int]) -> Array:
                box = ring._box(rank, tag)
                try:
                    return await box
                finally:
                    ring.boxes.pop((rank, tag), None)

        return _Links()
