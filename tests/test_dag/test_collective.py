"""Ring all-reduce between replicas in one process: the sum, the same bytes on every replica,
the bytes each sends, float16 on the wire, and a neighbour that sends what does not fit."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from dag.collective import CollectiveError, LocalRing, ring_allreduce, ring_bytes

pytestmark = pytest.mark.timeout(30)
Array = np.ndarray[Any, Any]


async def _all(buffers: list[Array], wire: str = "float32", rounds: int = 1) -> list[Array]:
    ring = LocalRing(len(buffers))
    out: list[Array] = []
    for r in range(rounds):  # (several rounds on one ring: tags keep them apart)
        out = await asyncio.gather(
            *(
                ring_allreduce(b, i, len(buffers), ring.links(i), r, wire)
                for i, b in enumerate(buffers)
            )
        )
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("values", [1, 4, 1001])
async def test_every_replica_ends_with_the_same_sum(size: int, values: int) -> None:
    rng = np.random.default_rng([size, values])
    buffers = [rng.standard_normal(values).astype(np.float32) for _ in range(size)]
    out = await _all(buffers, rounds=2)
    want = np.sum(np.stack(buffers).astype(np.float64), axis=0)
    for o in out:
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
        assert o.dtype == np.float32 and o.tobytes() == out[0].tobytes()  # identical bytes
    for b in buffers:  # the inputs are left as they were
        assert b.dtype == np.float32


async def test_each_replica_sends_two_shares_of_the_buffer() -> None:
    size, values = 4, 1000
    ring = LocalRing(size)
    buffers = [np.ones(values, np.float32) for _ in range(size)]
    await asyncio.gather(
        *(ring_allreduce(b, i, size, ring.links(i), 0) for i, b in enumerate(buffers))
    )
    assert ring.sent == [ring_bytes(values, size)] * size == [2 * 3 * 250 * 4] * size


async def test_float16_on_the_wire_halves_the_bytes_and_keeps_replicas_identical() -> None:
    size, values = 3, 999
    rng = np.random.default_rng(3)
    buffers = [rng.standard_normal(values).astype(np.float32) for _ in range(size)]
    ring = LocalRing(size)
    out = await asyncio.gather(
        *(ring_allreduce(b, i, size, ring.links(i), 0, "float16") for i, b in enumerate(buffers))
    )
    assert ring.sent == [ring_bytes(values, size, "float16")] * size
    assert ring_bytes(values, size, "float16") * 2 == ring_bytes(values, size)
    want = np.sum(buffers, axis=0)
    for o in out:
        assert o.tobytes() == out[0].tobytes()
        np.testing.assert_allclose(o, want, rtol=0, atol=0.02)  # float16 rounding of sums < 6
        assert np.array_equal(o, o.astype(np.float16).astype(np.float32))


async def test_a_neighbour_sending_the_wrong_shape_is_an_error() -> None:
    ring = LocalRing(2)
    good = ring_allreduce(np.ones(10, np.float32), 0, 2, ring.links(0), 0)

    async def bad() -> None:  # replica 1 sends a chunk of the wrong size
        await ring.links(1).send((0, 0, 1), np.ones(3, np.float32))

    with pytest.raises(CollectiveError, match="expected float32"):
        await asyncio.wait_for(asyncio.gather(good, bad()), 5)


async def test_an_unknown_wire_type_is_refused() -> None:
    with pytest.raises(CollectiveError, match="unknown wire"):
        await ring_allreduce(np.ones(3, np.float32), 0, 1, LocalRing(1).links(0), 0, "int8")
