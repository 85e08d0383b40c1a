"""Commitments to a stage's hidden states, checked by recomputing them (TOPLOC: Ong et al.,
"TOPLOC: A Locality Sensitive Hashing Scheme for Trustless Verifiable Inference", arXiv
2501.16007).

A commitment covers one chunk of a stage's output: the hidden-state rows of up to `CHUNK`
consecutive tokens, flattened. It keeps the `K` values of largest magnitude, each rounded to
bfloat16, as a polynomial over GF(`PRIME`) that maps each value's index (modulo `m`, the largest
modulus up to `PRIME` under which the K indices stay distinct) to the value's 16 bits. Bytes:
`m` (2), then the K coefficients, lowest degree first (2 each), big-endian: 258 bytes for
K = 128, about 8 bytes per token. (The `toploc` package implements the same scheme in C++
against libtorch, which a provider running onnxruntime does not have; this is numpy.)

A verifier recomputes the chunk (in one prefill pass over the whole sequence), takes its own
top-K indices and evaluates the polynomial there: where the prover's top K held the same
index, that gives the prover's value, elsewhere an unrelated number. Per chunk it counts the
values whose sign and exponent differ (`Check.mismatches`) and, over the rest, the absolute
differences of the 7-bit mantissas, pooled over the sequence into a mean. A sequence passes
when no chunk has more mismatches, and the pooled mean is no larger, than a `Tolerance`
allows: one per dtype the package's stages send (`TOLERANCES`), measured on honest runs
(onnxruntime and torch, one token at a time against one prefill pass) and on cheats.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ir.errors import IRError

Array = np.ndarray[Any, Any]
PRIME = 65497  # the largest prime below 2^16 - 38: every finite bfloat16's bits are below it
K = 128  # values committed per chunk
CHUNK = 32  # tokens per chunk
SPARSITY = 32  # at most one value in this many is committed
_SMALLEST_MODULUS = 2**15
_P = np.uint32(PRIME)


class CommitmentError(IRError):
    """A commitment that cannot be read (its length or values are not a commitment's)."""


@dataclass(frozen=True)
class Tolerance:
    mismatches: int  # values of one chunk whose sign or exponent differ, at most
    mantissa_mean: float  # mean 7-bit mantissa difference of the rest, over a whole sequence


@dataclass(frozen=True)
class Check:
    """How a recomputation compares with the commitments: one chunk's, or a sequence's (the
    sum of its chunks': the most mismatches of any chunk, the mantissas pooled)."""

    mismatches: int  # values whose sign or exponent differ (the most in one chunk)
    compared: int  # values whose sign and exponent agree
    mantissa_sum: int  # their 7-bit mantissas' absolute differences, summed
    chunks: int = 1

    @property
    def mantissa_mean(self) -> float:
        return self.mantissa_sum / self.compared if self.compared else float("inf")

    def within(self, tolerance: Tolerance) -> bool:
        return (
            self.mismatches <= tolerance.mismatches
            and self.mantissa_mean <= tolerance.mantissa_mean
        )

    def __add__(self, other: Check) -> Check:
        return Check(
            max(self.mismatches, other.mismatches),
            self.compared + other.compared,
            self.mantissa_sum + other.mantissa_sum,
            self.chunks + other.chunks,
        )


# What honest recomputation stays within, per dtype a package's stages send their hidden
# states in (an fp16 package computes in fp32 from fp16 weights and rounds its outputs to
# fp16): measured with `tests/test_ir/test_toploc.py`, where the margins to honest runs and
# to the cheats they catch are stated.
TOLERANCES = {
    "float32": Tolerance(mismatches=2, mantissa_mean=0.025),
    "float16": Tolerance(mismatches=4, mantissa_mean=0.2),
}


def bf16_bits(values: Array) -> Array:
    """float values -> bfloat16 bits (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _modulus(indices: Array) -> int:
    for m in range(PRIME, _SMALLEST_MODULUS, -1):
        if np.diff(np.sort(indices % m)).all():  # (distinct)
            return m
    raise CommitmentError("no modulus keeps these indices apart")  # (not for K <= 2^15)


def _mulmod(a: Array, b: Array) -> Array:
    """a @ b mod PRIME, exact in float64: the entries are below PRIME, so every sum of up to
    2^20 products stays below 2^53."""
    return (np.asarray(a, np.float64) @ np.asarray(b, np.float64) % PRIME).astype(np.int64)


def _powers(x: Array, n: int) -> Array:
    """(len(x), n): x_i^e mod PRIME for e < n, by doubling the columns (in 32 bits: a
    product of two values below PRIME fits)."""
    v = np.ones((len(x), n), dtype=np.uint32)
    width, power = 1, (np.asarray(x, dtype=np.int64) % PRIME).astype(np.uint32)  # x^width
    while width < n:
        take = min(width, n - width)
        v[:, width : width + take] = v[:, :take] * power[:, None] % _P
        width, power = width + take, power * power % _P
    return v.astype(np.int64)


def _interpolate(x: Array, y: Array) -> Array:
    """Coefficients (lowest degree first) of the polynomial over GF(PRIME) through (x, y), the
    x distinct."""
    return _interpolate_many(np.asarray(x)[None, :], np.asarray(y)[None, :])[0]


def _evaluate(coeffs: Array, x: Array) -> Array:
    return _mulmod(_powers(x, len(coeffs)), coeffs)


def covered(chunks: dict[int, int]) -> int | None:
    """The tokens a sequence's chunk commitments cover (chunk number -> its tokens): chunks
    0, 1, ... of `CHUNK` tokens, the last possibly fewer; None when they are not that."""
    sizes = [chunks[n] for n in sorted(chunks)]
    if sorted(chunks) != list(range(len(sizes))) or any(t != CHUNK for t in sizes[:-1]):
        return None
    if sizes and not 1 <= sizes[-1] <= CHUNK:
        return None
    return sum(sizes)


def top_k(size: int, k: int = K) -> int:
    """Values committed from a chunk of `size`: K, or one in `SPARSITY` of a smaller chunk
    (a short last chunk of a small model): the largest values, not the ones near zero, whose
    bits honest executors disagree on."""
    return max(1, min(k, size // SPARSITY))


def largest(flat: Array, k: int) -> Array:
    """The indices of the `k` values of `flat` largest in magnitude (int64, in index order;
    of values tied at the k-th, the first), for 0 < k <= flat.size: the k-th by a partition
    of the magnitudes, then those above it (half an argpartition's time)."""
    magnitudes = np.abs(flat)
    if k >= magnitudes.size:
        return np.arange(magnitudes.size, dtype=np.int64)
    kth = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
    above = np.flatnonzero(magnitudes > kth)  # (fewer than k)
    at = np.flatnonzero(magnitudes == kth)[: k - len(above)]
    return np.sort(np.concatenate([above, at])).astype(np.int64)


def commit(chunk: Array, k: int = K) -> bytes:
    """The commitment to one chunk of hidden states (any shape: flattened)."""
    flat = np.asarray(chunk, dtype=np.float32).reshape(-1)
    if not np.isfinite(flat).all():
        raise CommitmentError("hidden states with NaN or infinity cannot be committed to")
    k = top_k(flat.size, k)
    top = largest(flat, k)
    m = _modulus(top)
    coeffs = _interpolate(top % m, bf16_bits(flat[top]).astype(np.int64))
    return m.to_bytes(2, "big") + coeffs.astype(">u2").tobytes()


def commit_many(chunks: list[Array], k: int = K) -> list[bytes]:
    """`commit` of each chunk, the same bytes, with the polynomial arithmetic of chunks of
    equal size done together (a microbatch's rows: one pass of batched matrix products
    instead of a Python-level pass per chunk)."""
    flats = [np.asarray(c, dtype=np.float32).reshape(-1) for c in chunks]
    out: list[bytes] = [b""] * len(flats)
    groups: dict[int, list[int]] = {}
    for i, flat in enumerate(flats):
        if not np.isfinite(flat).all():
            raise CommitmentError("hidden states with NaN or infinity cannot be committed to")
        groups.setdefault(flat.size, []).append(i)
    for size, members in groups.items():
        n = top_k(size, k)
        values = np.stack([flats[i] for i in members])  # (chunks, size)
        top = np.stack([largest(row, n) for row in values])
        moduli = np.array([_modulus(t) for t in top], dtype=np.int64)
        bits = bf16_bits(np.take_along_axis(values, top, axis=1)).astype(np.int64)
        coeffs = _interpolate_many(top % moduli[:, None], bits)
        for row, i in enumerate(members):
            out[i] = int(moduli[row]).to_bytes(2, "big") + coeffs[row].astype(">u2").tobytes()
    return out


def _interpolate_many(x: Array, y: Array) -> Array:
    """`_interpolate` of each row of x and y (chunks, n), through the polynomial's values at
    0 .. n - 1: with M = prod (t - x_i), Lagrange's form gives
    f(z) = M(z) sum_i y_i / (M'(x_i) (z - x_i)) where z is no x_i, and f(x_i) = y_i where it
    is; the coefficients are then a fixed matrix (`_from_values`) times those values. The
    products M(z_j) and M'(x_i) are sums of discrete logarithms (`_tables`), and the sums over
    i one matrix product, exact in float64 (`_mulmod`): each step is one pass over the (n, n)
    differences, which are taken plus PRIME so that no step divides."""
    n = x.shape[1]
    x = np.asarray(x, dtype=np.int64) % PRIME
    y = np.asarray(y, dtype=np.int64) % PRIME
    exp, log, inverse = _tables()
    neg = (PRIME - x).astype(np.int32)  # (chunks, n): PRIME - x_i, from 1 to PRIME
    d = np.arange(n, dtype=np.int32)[None, :, None] + neg[:, None, :]  # z_j - x_i (+ PRIME)
    e = x.astype(np.int32)[:, :, None] + neg[:, None, :]  # x_i - x_k (+ PRIME)
    # (log 0 counts as 0: e's diagonal, the factor M' leaves out; and d where z_j = x_i,
    # whose f(z_j) is y_i, set below)
    at_z = exp[np.take(log, d).sum(axis=2, dtype=np.int64) % ORDER]  # M(z_j)
    slopes = np.take(log, e).sum(axis=2, dtype=np.int64) % ORDER  # log M'(x_i)
    weights = y * exp[(ORDER - slopes) % ORDER] % PRIME  # y_i / M'(x_i)
    sums = _mulmod(np.take(inverse, d), weights[:, :, None])[:, :, 0]  # (1/0 counts as 0)
    values = at_z * sums % PRIME
    row, i = np.nonzero(x < n)  # f(x_i) = y_i where x_i is one of 0 .. n - 1
    values[row, x[row, i]] = y[row, i]
    return _mulmod(values, _from_values(n))


ORDER = PRIME - 1  # of GF(PRIME)'s multiplicative group


@functools.cache
def _tables() -> tuple[Array, Array, Array]:
    """(exp, log, inverse) over GF(PRIME), from its least generator g: exp[k] = g^k for
    k < ORDER; log[v] and inverse[v] (1/v) for v < 2 PRIME, taken modulo PRIME (log and
    inverse of 0: 0), as uint16: 256 KB each, which stay in a core's cache between chunks."""
    primes = [q for q in range(2, ORDER + 1) if ORDER % q == 0 and _prime(q)]
    g = next(g for g in range(2, PRIME) if all(pow(g, ORDER // q, PRIME) != 1 for q in primes))
    exp = np.empty(ORDER, dtype=np.int64)
    exp[0] = 1
    width, power = 1, g  # g^width
    while width < ORDER:  # exp[w : 2w] = exp[:w] g^w
        take = min(width, ORDER - width)
        exp[width : width + take] = exp[:take] * power % PRIME
        width, power = width + take, power * power % PRIME
    log = np.zeros(PRIME, dtype=np.uint16)
    log[exp] = np.arange(ORDER, dtype=np.uint16)
    inverse = np.zeros(PRIME, dtype=np.uint16)
    inverse[exp] = exp[(ORDER - np.arange(ORDER)) % ORDER]
    tables = exp, np.concatenate([log, log]), np.concatenate([inverse, inverse])
    for table in tables:
        table.flags.writeable = False  # (shared by every call)
    return tables


def _prime(q: int) -> bool:
    return q > 1 and all(q % r for r in range(2, int(q**0.5) + 1))


def _sub(a: Array, b: Array) -> Array:
    """(a - b) mod PRIME of uint32 values below PRIME, without a division."""
    v = a + (_P - b)  # below 2 PRIME
    return np.minimum(v, v - _P)  # (v - PRIME wraps around to a larger value when v < PRIME)


def _row_products(a: Array) -> Array:
    """The product mod PRIME of each row along the last axis (uint32 values below PRIME), by
    halving: the row padded with ones to a power of two."""
    width = a.shape[-1]
    full = 1 << max(0, (width - 1).bit_length())
    if full != width:
        ones = np.ones((*a.shape[:-1], full - width), dtype=np.uint32)
        a = np.concatenate([a, ones], axis=-1)
    while a.shape[-1] > 1:
        half = a.shape[-1] // 2
        a = a[..., :half] * a[..., half:] % _P
    return a[..., 0]


@functools.lru_cache(maxsize=8)
def _from_values(n: int) -> Array:
    """(n, n), float64: the coefficients of the polynomial of degree < n through (z, f_z) for
    z = 0 .. n - 1 are f times this (the inverse of those points' Vandermonde matrix). Row j
    holds Lagrange's basis prod_{k != j} (t - k) / (j - k): M = prod (t - k) divided by (t - j)
    (synthetic division), over M'(j)."""
    m = np.zeros(n + 1, dtype=np.int64)  # M's coefficients, lowest degree first
    m[0] = 1
    for k in range(n):  # M times (t - k)
        m = (np.concatenate([[0], m[:-1]]) - k * m) % PRIME
    j = np.arange(n, dtype=np.int64)
    basis = np.zeros((n, n), dtype=np.int64)
    carry = np.zeros(n, dtype=np.int64)
    for degree in range(n, 0, -1):
        carry = (m[degree] + j * carry) % PRIME
        basis[:, degree - 1] = carry
    ju = j.astype(np.uint32)
    differences = _sub(ju[:, None], ju[None, :]) + np.eye(n, dtype=np.uint32)  # (1: k = j)
    slopes = _row_products(differences)  # M'(j)
    inverses = _tables()[2][slopes].astype(np.int64)  # (slopes below PRIME)
    matrix = (basis * inverses[:, None] % PRIME).astype(np.float64)
    matrix.flags.writeable = False  # (shared by every call)
    return matrix


def parse(commitment: bytes, k: int = K) -> tuple[int, Array]:
    """(modulus, coefficients) of a commitment; CommitmentError if it is not one."""
    if len(commitment) < 4 or len(commitment) % 2 or len(commitment) > 2 + 2 * k:
        raise CommitmentError(f"a commitment is 2 + 2 x (at most {k}) bytes")
    m = int.from_bytes(commitment[:2], "big")
    coeffs = np.frombuffer(commitment[2:], dtype=">u2").astype(np.int64)
    if not _SMALLEST_MODULUS < m <= PRIME or (coeffs >= PRIME).any():
        raise CommitmentError("a commitment's modulus or coefficients are out of range")
    return m, coeffs


def check(chunk: Array, commitment: bytes, k: int = K) -> Check:
    """Compare a recomputed chunk with the prover's commitment to it."""
    m, coeffs = parse(commitment, k)
    flat = np.asarray(chunk, dtype=np.float32).reshape(-1)
    k = top_k(flat.size, k)
    if not np.isfinite(flat).all() or len(coeffs) != k:  # (not this chunk's commitment)
        return Check(max(k, len(coeffs)), 0, 0)
    top = largest(flat, k)
    theirs = _evaluate(coeffs, top % m)
    ours = bf16_bits(flat[top]).astype(np.int64)
    head = (theirs >> 7) != (ours >> 7)  # sign and exponent
    diff = np.abs((theirs & 0x7F) - (ours & 0x7F))[~head]
    return Check(int(head.sum()), int(diff.size), int(diff.sum()))


def check_rows(rows: Array, commitments: list[bytes], chunk: int = CHUNK) -> Check:
    """Compare a sequence's recomputed rows (tokens, ...) with its commitments, chunk by
    chunk; a missing or extra commitment counts as a chunk with every value mismatched."""
    parts = chunks(rows, chunk)
    total = Check(0, 0, 0, 0)
    for i in range(max(len(parts), len(commitments))):
        if i >= len(parts) or i >= len(commitments):
            total += Check(K, 0, 0)
        else:
            total += check(parts[i], commitments[i])
    return total


def sequence_chunks(hidden: Array, chunk: int) -> list[Array]:
    """A batch's hidden states (sequences, tokens, ...; or sequences, features) cut into
    chunks of `chunk` tokens, sequence after sequence (a sequence of features: one chunk)."""
    hidden = np.asarray(hidden, dtype=np.float32)
    rows = hidden.reshape(len(hidden), 1, -1) if hidden.ndim < 3 else hidden
    return [part for sequence in rows for part in chunks(sequence, chunk)]


def chunks(rows: Array, chunk: int = CHUNK) -> list[Array]:
    """A sequence's hidden-state rows (tokens, ...) cut into chunks of `chunk` tokens."""
    return [rows[i : i + chunk] for i in range(0, len(rows), chunk)]


class Committer:
    """A stage's commitments for one sequence, built as its output rows come: a prompt's at
    once, then one token's at a time."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.pending: list[Array] = []
        self.held = 0  # rows pending
        self.commitments: list[bytes] = []

    def add(self, rows: Array) -> list[bytes]:
        """Take the next rows (tokens, ...); the commitments of the chunks they complete."""
        rows = np.asarray(rows, dtype=np.float32)
        done: list[bytes] = []
        while len(rows):
            take = min(self.chunk - self.held, len(rows))
            self.pending.append(rows[:take])
            self.held += take
            rows = rows[take:]
            if self.held == self.chunk:
                done.append(self._close())
        return done

    def finish(self) -> list[bytes]:
        """The last, partial chunk's commitment (none when the rows filled whole chunks)."""
        return [self._close()] if self.held else []

    def _close(self) -> bytes:
        out = commit(np.concatenate(self.pending))
        self.pending, self.held = [], 0
        self.commitments.append(out)
        return out
