"""Gradient compression for data-parallel training over slow links.

Every replica holds the same weights and computes the gradient of its own shard of a global
batch, already scaled so that the replicas' gradients *add up* to the global batch's mean
gradient. A compressor turns a replica's gradient into one flat float32 buffer per phase (all
its tensors fused: one all-reduce each, not one per tensor), the all-reduce sums the buffers
over the replicas, and the compressor turns the sum back into the gradient every replica
applies, the same on each.

- `none`: the gradient as it is (float32).
- `fp16`: the same values sent as float16 (the all-reduce adds in float32 and rounds what it
  sends on).
- `powersgd`: Power-SGD (arXiv:1905.13727) with the semantics of torch's PowerSGD hook: a
  matrix M (its own gradient plus the error left last step) becomes P = M Q, P is summed and
  orthogonalised, Q = M^T P is summed, the gradient is P Q^T and the error M - P Q^T is kept;
  Q starts random (the same seed everywhere) and is warm-started from the last step. Two
  all-reduces a step.
- `acp`: ACP-SGD (arXiv:2306.08881, after its authors' `acpsgd.py`): one all-reduce a step, of
  P on even steps (P = M Q with the last summed Q, orthogonalised) and of Q on odd steps
  (Q = M^T P with the last summed P, orthogonalised); error feedback against the local P Q^T.
  About half Power-SGD's bytes, and every step's buffer can be all-reduced as a whole.

Vectors (biases, norm weights) and matrices too small to gain from a low rank travel
uncompressed, in the same buffer. A matrix with more than two dimensions is taken as
(first dimension, the rest).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]
COMPRESSORS = ("none", "fp16", "powersgd", "acp")
MAX_RANK = 256
# all-reduce(buffer, wire dtype) -> the buffers' sum over the replicas (float32)
AllReduce = Callable[[Array, str], Awaitable[Array]]


class CompressionError(ValueError):
    """A compressor was asked for what it cannot do; the message says why."""


def make_compressor(
    name: str,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    replicas: int,
    rank: int = 4,
    seed: int = 0,
) -> Compressor:
    """The compressor `name` for gradients of these `shapes` (name -> shape), on one of
    `replicas` replicas."""
    check_compressor(name, rank)
    if name == "none":
        return Plain(shapes)
    if name == "fp16":
        return Plain(shapes, wire="float16")
    if name == "powersgd":
        return PowerSGD(shapes, rank, seed, replicas)
    return ACPSGD(shapes, rank, seed)


def check_compressor(name: str, rank: int) -> None:
    """Raise `CompressionError` unless `name` (at `rank`, for the low-rank ones) can run."""
    if name not in COMPRESSORS:
        raise CompressionError(f"unknown compressor {name!r}; use one of {list(COMPRESSORS)}")
    if name in ("powersgd", "acp") and not 1 <= rank <= MAX_RANK:
        raise CompressionError(f"rank must be from 1 to {MAX_RANK} (it was {rank})")


class Compressor:
    """One step: `encode(phase, grads)` gives the buffer to all-reduce, `decode(phase, sum)`
    takes its sum; after the last phase `decode` returns the gradient to apply."""

    name = "none"
    phases = 1
    wire = "float32"

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.names = sorted(shapes)  # the same order on every replica
        self.shapes = {n: tuple(shapes[n]) for n in self.names}

    def encode(self, phase: int, grads: Mapping[str, Array]) -> Array:
        raise NotImplementedError

    def decode(self, phase: int, summed: Array) -> dict[str, Array] | None:
        raise NotImplementedError

    def buffer_values(self, phase: int) -> int:
        """Values in the buffer of `phase` (this step)."""
        raise NotImplementedError

    def step_bytes(self) -> int:
        """Bytes of the buffers one replica hands to the all-reduces this step (at the wire's
        width)."""
        width = 2 if self.wire == "float16" else 4
        return width * sum(self.buffer_values(p) for p in range(self.phases))

    def state(self) -> dict[str, Array]:
        """What the compressor carries from step to step (error feedback, warm starts)."""
        return {}

    def load_state(self, state: Mapping[str, Array]) -> None:
        pass


class Plain(Compressor):
    """The gradient itself, as float32 or float16 on the wire."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], wire: str = "float32") -> None:
        super().__init__(shapes)
        self.wire = wire
        self.name = "none" if wire == "float32" else "fp16"

    def buffer_values(self, phase: int) -> int:
        return sum(int(np.prod(s)) for s in self.shapes.values())

    def encode(self, phase: int, grads: Mapping[str, Array]) -> Array:
        return _flat([grads[n] for n in self.names])

    def decode(self, phase: int, summed: Array) -> dict[str, Array] | None:
        return _split(summed, [(n, self.shapes[n]) for n in self.names])


def _flat(arrays: list[Array]) -> Array:
    if not arrays:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays])


def _split(vec: Array, layout: list[tuple[str, tuple[int, ...]]]) -> dict[str, Array]:
    out, at = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape))
        out[name] = vec[at : at + n].reshape(shape)
        at += n
    if at != vec.size:
        raise CompressionError(f"the summed buffer has {vec.size} values, expected {at}")
    return out


def _orthogonal(m: Array) -> Array:
    """Orthonormal columns spanning `m`'s (QR, as both papers' code does)."""
    import torch

    q: Array = torch.linalg.qr(torch.from_numpy(np.ascontiguousarray(m))).Q.numpy()
    return q


class _LowRank(Compressor):
    """What Power-SGD and ACP-SGD share: which tensors are matrices worth compressing, their
    factors, error feedback, and the uncompressed rest."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], rank: int, seed: int) -> None:
        super().__init__(shapes)
        self.rank = rank
        self.matrices: dict[str, tuple[int, int, int]] = {}  # name -> (rows, cols, rank)
        for n in self.names:
            s = self.shapes[n]
            if len(s) < 2:
                continue
            rows, cols = s[0], int(np.prod(s[1:]))
            r = min(rank, rows, cols)
            if r * (rows + cols) < rows * cols:  # (else the factors are no smaller)
                self.matrices[n] = (rows, cols, r)
        self.plain = [n for n in self.names if n not in self.matrices]
        rng = np.random.default_rng(seed)
        self.q: dict[str, Array] = {
            n: rng.standard_normal((c, r)).astype(np.float32)
            for n, (_, c, r) in self.matrices.items()
        }
        self.p: dict[str, Array] = {
            n: np.zeros((rows, r), np.float32) for n, (rows, _, r) in self.matrices.items()
        }
        self.error: dict[str, Array] = {
            n: np.zeros((rows, c), np.float32) for n, (rows, c, _) in self.matrices.items()
        }
        self.steps = 0  # steps completed

    def _plain_values(self) -> int:
        return sum(int(np.prod(self.shapes[n])) for n in self.plain)

    def _with_error(self, grads: Mapping[str, Array]) -> dict[str, Array]:
        return {
            n: np.asarray(grads[n], dtype=np.float32).reshape(rows, cols) + self.error[n]
            for n, (rows, cols, _) in self.matrices.items()
        }

    def _result(self, plain: Array, approx: Mapping[str, Array]) -> dict[str, Array]:
        out = _split(plain, [(n, self.shapes[n]) for n in self.plain])
        out.update({n: approx[n].reshape(self.shapes[n]) for n in self.matrices})
        return out

    def state(self) -> dict[str, Array]:
        out = {f"q.{n}": v for n, v in self.q.items()}
        out.update({f"p.{n}": v for n, v in self.p.items()})
        out.update({f"error.{n}": v for n, v in self.error.items()})
        out["steps"] = np.array([self.steps], dtype=np.int64)
        return out

    def load_state(self, state: Mapping[str, Array]) -> None:
        for store, key in ((self.q, "q"), (self.p, "p"), (self.error, "error")):
            for n, old in store.items():
                new = state.get(f"{key}.{n}")
                if new is None or new.shape != old.shape:
                    raise CompressionError(f"the compressor state has no valid {key}.{n}")
                store[n] = np.array(new, dtype=np.float32)
        self.steps = int(state["steps"][0]) if "steps" in state else 0


class PowerSGD(_LowRank):
    name = "powersgd"
    phases = 2

    def __init__(
        self, shapes: Mapping[str, tuple[int, ...]], rank: int, seed: int, replicas: int
    ) -> None:
        super().__init__(shapes, rank, seed)
        self.replicas = replicas

    def buffer_values(self, phase: int) -> int:
        if phase == 0:  # P and the uncompressed tensors
            return self._plain_values() + sum(r * rows for rows, _, r in self.matrices.values())
        return sum(r * cols for _, cols, r in self.matrices.values())

    def encode(self, phase: int, grads: Mapping[str, Array]) -> Array:
        if phase == 0:
            self.m: dict[str, Array] = self._with_error(grads)
            ps = [self.m[n] @ self.q[n] for n in self.matrices]
            return _flat([grads[n] for n in self.plain] + ps)
        return _flat([self.m[n].T @ self.p[n] for n in self.matrices])

    def decode(self, phase: int, summed: Array) -> dict[str, Array] | None:
        if phase == 0:
            plain_n = self._plain_values()
            self.plain_sum = summed[:plain_n]
            at = plain_n
            for n, (rows, _, r) in self.matrices.items():
                self.p[n] = _orthogonal(summed[at : at + rows * r].reshape(rows, r))
                at += rows * r
            return None
        approx, at = {}, 0
        for n, (_, cols, r) in self.matrices.items():
            self.q[n] = summed[at : at + cols * r].reshape(cols, r).copy()  # warm start
            at += cols * r
            approx[n] = self.p[n] @ self.q[n].T
            # torch's hook keeps (local gradient + error) - the mean's approximation; here a
            # replica's gradient is already divided by the replicas, and so is its error
            self.error[n] = self.m[n] - approx[n] / self.replicas
        self.steps += 1
        del self.m
        return self._result(self.plain_sum, approx)


class ACPSGD(_LowRank):
    name = "acp"

    def _computes_p(self) -> bool:
        return self.steps % 2 == 0

    def buffer_values(self, phase: int) -> int:
        side = 0 if self._computes_p() else 1
        return self._plain_values() + sum(
            r * (rows, cols)[side] for rows, cols, r in self.matrices.values()
        )

    def encode(self, phase: int, grads: Mapping[str, Array]) -> Array:
        m = self._with_error(grads)
        factors = []
        for n in self.matrices:
            if self._computes_p():
                self.q[n] = _orthogonal(self.q[n])
                self.p[n] = m[n] @ self.q[n]
            else:
                self.p[n] = _orthogonal(self.p[n])
                self.q[n] = m[n].T @ self.p[n]
            self.error[n] = m[n] - self.p[n] @ self.q[n].T
            factors.append(self.p[n] if self._computes_p() else self.q[n])
        return _flat([grads[n] for n in self.plain] + factors)

    def decode(self, phase: int, summed: Array) -> dict[str, Array] | None:
        at = self._plain_values()
        plain, approx = summed[:at], {}
        for n, (rows, cols, r) in self.matrices.items():
            if self._computes_p():
                self.p[n] = summed[at : at + rows * r].reshape(rows, r).copy()
                at += rows * r
            else:
                self.q[n] = summed[at : at + cols * r].reshape(cols, r).copy()
                at += cols * r
            approx[n] = self.p[n] @ self.q[n].T
        self.steps += 1
        return self._result(plain, approx)


async def reduce(
    compressor: Compressor,
    grads: Mapping[str, Array],
    allreduce: AllReduce,
    plain: Compressor | None = None,
) -> dict[str, Array]:
    """The gradient every replica applies this step: `grads` through the compressor and the
    all-reduces (sums over the replicas); through `plain` instead, if given (the steps before
    compression starts, as torch's hook's `start_powerSGD_iter`)."""
    if plain is not None:
        compressor = plain
    for phase in range(compressor.phases):  # (the arithmetic off the event loop)
        buffer = await asyncio.to_thread(compressor.encode, phase, grads)
        expected = compressor.buffer_values(phase)
        if buffer.size != expected:
            raise CompressionError(f"phase {phase}: a buffer of {buffer.size}, not {expected}")
        summed = await allreduce(buffer, compressor.wire)
        result = await asyncio.to_thread(compressor.decode, phase, summed)
        if result is not None:
            return result
    raise CompressionError(f"{compressor.name}: no gradient after {compressor.phases} phases")
