"""A matmul workload whose answer is cheap to check: the hardware check a broker puts to a
joining provider (`proto.challenge`), run by the provider's own executor.

From a seed, a start matrix X (`rows` x `WIDTH`) and a matrix B (`WIDTH` x `WIDTH`) are
derived, every entry +1 or -1. A round is X <- step(X @ B), step(h) = 1 where h > 0, else -1;
after the rounds the answer is c = X @ v (v: `WIDTH` signs), one small integer per row.
Every value on the way is an integer of magnitude at most `WIDTH`: exact in float32, and in
float16, bfloat16 or tf32 inputs with float32 sums, so any hardware gets the same answer bit
for bit. The step is not linear, so rounds cannot be folded into one product (as powers of B
could be); and a row's answer depends on that row alone, so the checker recomputes a few rows
(rounds x `WIDTH`^2 multiply-adds each) while the provider must compute every row, not knowing
which will be checked.

Sizes are bounded (`MAX_ROWS`, `MAX_ROUNDS`): a check's tensors are 16 MB each on the
provider (with onnxruntime's arenas a check peaks at about 300 MB), and the checker does at
most `CHECK_ROWS` x `MAX_ROUNDS` x `WIDTH`^2 multiply-adds (2 G, about 0.1 s of numpy).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ir.executors.base import Executor

WIDTH = 512  # columns of X and the size of B
SEED_WIDTH = 32  # X's rows start as step(U @ W), U: rows x SEED_WIDTH, W: SEED_WIDTH x WIDTH
MIN_ROWS = 64
MAX_ROWS = 8192  # 16 MB of float32 rows
MAX_ROUNDS = 1024
RUN_ROUNDS = 16  # rounds per executor call once they fit in the window (else 1 per call)
CHECK_ROWS = 8  # rows the checker recomputes: a provider that skipped half passes 1 in 256

Array = np.ndarray[Any, Any]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _signs(seed: bytes, stream: int, start: int, count: int) -> Array:
    """Entries start..start+count of one stream of +1/-1 (float32): the bits of a counter
    hash (splitmix64) of each 64-entry word, so any entry is drawn without the ones before."""
    key = int.from_bytes(hashlib.sha256(seed + bytes([stream])).digest()[:8], "little")
    first, end = start // 64, (start + count + 63) // 64
    z = np.arange(first, end, dtype=np.uint64) * _GOLDEN + np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    bits = np.unpackbits(z.astype("<u8").view(np.uint8), bitorder="little")[start - 64 * first :][
        :count
    ]
    return bits.astype(np.float32) * 2 - 1


def _step(h: Array) -> Array:
    return np.where(h > 0, np.float32(1), np.float32(-1))


@dataclass(frozen=True)
class Work:
    """One check: `rows` rows through `rounds` rounds, all derived from `seed`."""

    seed: bytes
    rows: int
    rounds: int
    width: int = WIDTH

    def flops(self, rounds: int | None = None) -> float:
        """Multiply-adds (x2) of `rounds` rounds (default: all of them) over every row."""
        return (
            2.0 * self.rows * self.width * self.width * (self.rounds if rounds is None else rounds)
        )

    def matrix(self) -> Array:
        """B, `width` x `width`."""
        return _signs(self.seed, 1, 0, self.width * self.width).reshape(self.width, self.width)

    def seeds(self, first: int = 0, count: int | None = None) -> tuple[Array, Array]:
        """(U, W) of rows first..first+count: their start is step(U @ W)."""
        count = self.rows - first if count is None else count
        u = _signs(self.seed, 2, first * SEED_WIDTH, count * SEED_WIDTH)
        w = _signs(self.seed, 3, 0, SEED_WIDTH * self.width)
        return u.reshape(count, SEED_WIDTH), w.reshape(SEED_WIDTH, self.width)

    def projection(self) -> Array:
        return _signs(self.seed, 4, 0, self.width)


def sized(flops: float, seconds: float, seed: bytes, width: int = WIDTH) -> Work:
    """A check that takes about `seconds` at `flops` FLOP/s, within the bounds: as many rows
    as needed up to `MAX_ROWS`, then more rounds."""
    per_row_round = 2.0 * width * width
    want = max(0.0, flops * seconds) / per_row_round  # row-rounds
    rounds = min(MAX_ROUNDS, max(1, int(np.ceil(want / MAX_ROWS))))
    rows = int(min(MAX_ROWS, max(MIN_ROWS, round(want / rounds))))
    return Work(seed, rows, rounds, width)


def round_graph(rounds: int, start: bool, width: int = WIDTH) -> onnx.ModelProto:
    """`rounds` rounds as one ONNX graph: x (rows x width), b -> y; with `start`, the rows
    start as step(u @ w) instead (inputs u, w, b)."""
    from onnx import TensorProto, helper

    def step(inputs: list[str], out: str, r: int | str) -> list[onnx.NodeProto]:
        return [
            helper.make_node("MatMul", inputs, [f"h{r}"]),
            helper.make_node("Greater", [f"h{r}", "zero"], [f"g{r}"]),
            helper.make_node("Where", [f"g{r}", "one", "minus_one"], [out]),
        ]

    def tensor(name: str, *dims: int | str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))

    nodes = step(["u", "w"], "x", "s") if start else []
    first = [tensor("u", "rows", SEED_WIDTH), tensor("w", SEED_WIDTH, width)]
    inputs = [*(first if start else [tensor("x", "rows", width)]), tensor("b", width, width)]
    x = "x"
    for r in range(rounds):
        y = "y" if r == rounds - 1 else f"x{r + 1}"
        nodes += step([x, "b"], y, r)
        x = y
    scalar = lambda name, v: helper.make_tensor(name, TensorProto.FLOAT, [], [v])  # noqa: E731
    graph = helper.make_graph(
        nodes,
        f"check_{rounds}",
        inputs,
        [tensor("y", "rows", width)],
        [scalar("zero", 0.0), scalar("one", 1.0), scalar("minus_one", -1.0)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _answer(x: Array, v: Array) -> bytes:
    return np.asarray(x @ v).astype("<i2").tobytes()


def reference(work: Work, rows: Sequence[int], rounds: int) -> Array:
    """The answers of `rows` after `rounds` rounds, computed here (numpy), as int16."""
    b = work.matrix()
    seeds = [work.seeds(i, 1) for i in rows]
    x = _step(np.concatenate([u for u, _ in seeds]) @ seeds[0][1]) if seeds else np.zeros((0, 1))
    for _ in range(rounds):
        x = _step(x @ b)
    return np.asarray(x @ work.projection()).astype(np.int16)


def wrong_rows(work: Work, rounds: int, answer: bytes, rows: Sequence[int]) -> list[int]:
    """Of `rows`, those whose answer differs from the reference (all of them if the answer
    has the wrong size)."""
    if len(answer) != 2 * work.rows or not 1 <= rounds <= work.rounds:
        return list(rows)
    got = np.frombuffer(answer, dtype="<i2")
    want = reference(work, rows, rounds)
    return [r for r, w in zip(rows, want, strict=True) if int(got[r]) != int(w)]


def run(
    work: Work,
    executor: Callable[[int, bool], Executor],
    window_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, bytes]:
    """Compute the check with `executor(n, start)` (one that runs `round_graph(n, start)`):
    the start and one round first, then `RUN_ROUNDS` rounds per call while they fit in what is
    left of `window_s` at the pace so far, else one; no call starts after the window (three
    graphs in all, so three executors' memory). Returns (rounds done, answer)."""
    began = clock()
    b = work.matrix()
    u, w = work.seeds()
    x = executor(1, True).run({"u": u, "w": w, "b": b})["y"]
    done = 1
    while done < work.rounds:
        now = clock()
        left = window_s - (now - began)
        if left <= 0:
            break
        per_round = (now - began) / done
        fits = RUN_ROUNDS * per_round <= left and done + RUN_ROUNDS <= work.rounds
        n = RUN_ROUNDS if fits else 1
        x = executor(n, False).run({"x": x, "b": b})["y"]
        done += n
    return done, _answer(x, work.projection())
