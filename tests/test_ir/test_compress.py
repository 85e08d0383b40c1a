"""Gradient compressors through a real ring all-reduce in one process: what each sends, that
low-rank gradients come through whole, error feedback, and bad requests refused."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from dag.collective import LocalRing, ring_allreduce
from ir.compress import CompressionError, Compressor, make_compressor, reduce

pytestmark = pytest.mark.timeout(60)
Array = np.ndarray[Any, Any]
# the shapes of the shipped 6-block Llama at hidden 384 (vocabulary 4096), one block's worth
LLAMA_14M = {
    "embed": (4096, 384),
    "head": (384, 4096),
    "norm": (384,),
    **{f"b.{i}.{w}": (384, 384) for i in range(6) for w in "qkvo"},
    **{f"b.{i}.{w}": (384, 1024) for i in range(6) for w in ("gate", "up")},
    **{f"b.{i}.down": (1024, 384) for i in range(6)},
    **{f"b.{i}.{n}": (384,) for i in range(6) for n in ("in_norm", "post_norm")},
}


async def _step(
    compressors: list[Compressor], grads: list[dict[str, Array]], ring: LocalRing, round_id: int
) -> list[dict[str, Array]]:
    size = len(compressors)
    rounds = [round_id * 10]

    def allreduce(rank: int) -> Any:
        count = [0]

        async def one(buffer: Array, wire: str) -> Array:
            count[0] += 1
            return await ring_allreduce(
                buffer, rank, size, ring.links(rank), rounds[0] + count[0], wire
            )

        return one

    return await asyncio.gather(
        *(
            reduce(c, g, allreduce(i))
            for i, (c, g) in enumerate(zip(compressors, grads, strict=True))
        )
    )


def _replicas(
    name: str, shapes: dict[str, tuple[int, ...]], size: int, rank: int = 4
) -> list[Compressor]:
    return [make_compressor(name, shapes, replicas=size, rank=rank, seed=7) for _ in range(size)]


def test_bytes_per_step_at_rank_4_on_the_shipped_model() -> None:
    """ACP-SGD sends P or Q: at most 1/20 of the gradient and 0.55 of Power-SGD's P and Q."""
    sizes = {
        n: make_compressor(n, LLAMA_14M, replicas=2).step_bytes()
        for n in ("none", "fp16", "powersgd")
    }
    acp = make_compressor("acp", LLAMA_14M, replicas=2)
    acp_bytes = []
    for _ in range(2):  # P on even steps, Q on odd ones
        acp_bytes.append(acp.step_bytes())
        acp.steps += 1
    full = 4 * sum(int(np.prod(s)) for s in LLAMA_14M.values())
    assert sizes["none"] == full and sizes["fp16"] == full // 2
    mean_acp = sum(acp_bytes) / 2
    assert mean_acp <= full / 20, (mean_acp, full)
    assert mean_acp <= 0.55 * sizes["powersgd"], (mean_acp, sizes["powersgd"])


@pytest.mark.parametrize("name", ["none", "fp16", "powersgd", "acp"])
async def test_every_replica_applies_the_same_gradient(name: str) -> None:
    shapes = {"w": (48, 32), "b": (32,), "tiny": (2, 3)}
    size, ring = 3, LocalRing(3)
    compressors = _replicas(name, shapes, size)
    rng = np.random.default_rng(1)
    for step in range(4):
        grads = [
            {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
            for _ in range(size)
        ]
        out = await _step(compressors, grads, ring, step)
        for o in out[1:]:
            assert all(o[n].tobytes() == out[0][n].tobytes() for n in shapes)
        want_b = sum(g["b"] for g in grads)  # vectors and tiny matrices travel whole
        tol = 0.01 if name == "fp16" else 1e-5
        np.testing.assert_allclose(out[0]["b"], want_b, atol=tol)
        np.testing.assert_allclose(out[0]["tiny"], sum(g["tiny"] for g in grads), atol=tol)
        assert out[0]["w"].shape == (48, 32)


async def test_a_gradient_of_low_rank_comes_through_whole() -> None:
    """Replicas whose gradients share a rank-2 column space, compressed at rank 4: Power-SGD
    gives their sum at every step; ACP-SGD's P step and Q step together give twice the sum,
    with nothing left over (the Q step delivers what the P step left out)."""
    size = 2
    rng = np.random.default_rng(2)
    u = rng.standard_normal((40, 2)).astype(np.float32)
    grads = [{"w": u @ rng.standard_normal((2, 30)).astype(np.float32)} for _ in range(size)]
    total = grads[0]["w"] + grads[1]["w"]
    power, ring = _replicas("powersgd", {"w": (40, 30)}, size), LocalRing(2)
    for step in range(3):
        out = await _step(power, grads, ring, step)
        np.testing.assert_allclose(out[0]["w"], total, rtol=1e-4, atol=1e-4)
    acp, ring = _replicas("acp", {"w": (40, 30)}, size), LocalRing(2)
    for pair in range(2):
        p_step = (await _step(acp, grads, ring, 2 * pair))[0]["w"]
        assert np.abs(p_step - total).max() > 0.1  # (a random Q: the P step alone is not it)
        q_step = (await _step(acp, grads, ring, 2 * pair + 1))[0]["w"]
        np.testing.assert_allclose(p_step + q_step, 2 * total, rtol=1e-4, atol=1e-4)
        assert all(np.abs(c.error["w"]).max() < 1e-4 for c in acp)


@pytest.mark.parametrize("name", ["powersgd", "acp"])
async def test_error_feedback_delivers_what_was_left_out(name: str) -> None:
    """A constant full-rank gradient: what was applied over many steps approaches what was
    computed (the error carried is bounded), where rank 2 of 24 alone would lose most of it."""
    size, ring = 2, LocalRing(2)
    rng = np.random.default_rng(3)
    grads = [{"w": rng.standard_normal((24, 24)).astype(np.float32)} for _ in range(size)]
    total = grads[0]["w"] + grads[1]["w"]
    compressors = _replicas(name, {"w": (24, 24)}, size, rank=2)
    applied = np.zeros_like(total)
    steps = 120
    for step in range(steps):
        applied += (await _step(compressors, grads, ring, step))[0]["w"]
    relative = np.linalg.norm(applied / steps - total) / np.linalg.norm(total)
    assert relative < 0.15, relative  # one step alone keeps about 2/24 of it
    one = await _step(_replicas(name, {"w": (24, 24)}, size, rank=2), grads, LocalRing(2), 0)
    assert np.linalg.norm(one[0]["w"] - total) / np.linalg.norm(total) > 0.5


def test_state_round_trips_and_bad_requests_are_refused() -> None:
    shapes = {"w": (40, 30), "b": (30,)}
    a = make_compressor("acp", shapes, replicas=2, seed=1)
    a.error["w"][:] = 1.5
    a.steps = 3
    b = make_compressor("acp", shapes, replicas=2, seed=2)
    b.load_state(a.state())
    assert b.steps == 3 and np.array_equal(b.error["w"], a.error["w"])
    assert np.array_equal(b.q["w"], a.q["w"])
    with pytest.raises(CompressionError, match="no valid"):
        b.load_state({"steps": np.array([1])})
    with pytest.raises(CompressionError, match="unknown compressor"):
        make_compressor("topk", shapes, replicas=2)
    for rank in (0, -1, 10_000):
        with pytest.raises(CompressionError, match="rank must be"):
            make_compressor("powersgd", shapes, replicas=2, rank=rank)
