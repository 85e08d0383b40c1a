"""Activation commitments (`ir.toploc`) on real stages: a prover decodes one token at a time
and commits to each provider stage's outputs; a verifier recomputes the whole sequence in one
prefill pass. Honest sessions (onnxruntime and torch on either side, fp32 and fp16 packages)
are never accused; each cheat is caught in every trial.

Measured with these models (the margins behind `ir.toploc.TOLERANCES`; 20 sessions of ~50
tokens per case): honest fp32 runs pool a mantissa mean of at most 0.004 with no mismatch,
honest fp16 runs at most 0.07 with at most 2 mismatches in a chunk. Caught against fp32 (mean
bound 0.025): a stage computed in fp16 (pooled mean at least 0.078), Gaussian noise at 0.1 %
of the hidden state's RMS (at least 0.039; the smallest level caught every time), int4
weights, another model, a skipped layer (tens of mismatches). Against fp16 (bound 0.2): noise
at 1 % (at least 0.45); 0.3 % is not caught every time (0.15).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ir.toploc import (
    CHUNK,
    PRIME,
    TOLERANCES,
    CommitmentError,
    Committer,
    K,
    _evaluate,
    _interpolate,
    check_rows,
    commit,
    commit_many,
    largest,
    parse,
    sequence_chunks,
)
from tests.toploc_runs import (
    accused,
    build_packages,
    forget_executors,
    garbage,
    noise,
    replayed,
    serve,
    verdicts,
)

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """torch on one thread: these stages are small, and threads only wait on each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.tiny_models import tiny_llama

    yield build_packages(tiny_llama(), tmp_path_factory.mktemp("toploc"))
    forget_executors()


def test_a_commitment_is_258_bytes_and_garbage_is_refused_or_fails() -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((CHUNK, 128)).astype(np.float32)
    made = commit(rows)
    assert len(made) == 258  # TOPLOC's size for K = 128
    m, coeffs = parse(made)
    assert m <= 65497 and len(coeffs) == 128
    same = check_rows(rows, [made])
    assert (same.mismatches, same.mantissa_sum, same.compared) == (0, 0, 128)
    for bad in (b"", b"\x00", made[:3], made + b"\x00\x00", b"\xff\xff" + made[2:]):
        with pytest.raises(CommitmentError):
            parse(bad)
    # well-formed garbage: a random modulus in range and random coefficients
    for _ in range(20):
        junk = int(rng.integers(2**15 + 1, 65497)).to_bytes(2, "big")
        junk += rng.integers(0, 65497, size=128).astype(">u2").tobytes()
        assert not check_rows(rows, [junk]).within(TOLERANCES["float16"])
    assert not check_rows(rows, []).within(TOLERANCES["float16"])  # a commitment withheld
    with pytest.raises(CommitmentError, match="NaN"):
        commit(np.full((2, 4), np.nan, dtype=np.float32))


@pytest.mark.timeout(300)
def test_two_hundred_honest_sessions_accuse_no_one(packages: dict[str, Any]) -> None:
    """onnxruntime and torch on either side, fp32 and fp16 packages, one token at a time
    against one prefill pass."""
    rng = np.random.default_rng(1)
    sides = [("ort", "ort"), ("ort", "torch"), ("torch", "ort"), ("ort", "ort")]
    checked = 0
    for i in range(200):
        pkg = packages["fp32" if i % 2 else "fp16"]
        prover, verifier = sides[i // 2 % len(sides)]
        prompt = [int(t) for t in rng.integers(1, 500, size=int(rng.integers(2, 12)))]
        tokens, sent = serve(pkg, prover, prompt, new=int(rng.integers(6, 30)))
        checks = verdicts(pkg, verifier, tokens, sent)
        assert not accused(pkg, checks), (i, prover, verifier, checks)
        checked += sum(c.chunks for c in checks)
    assert checked >= 400


@pytest.mark.timeout(300)
def test_each_cheat_is_caught_in_every_trial(packages: dict[str, Any]) -> None:
    rng = np.random.default_rng(2)
    fp32, fp16 = packages["fp32"], packages["fp16"]
    trials = 20
    caught: dict[str, int] = {}

    def trial(name: str, honest: Any, run: Callable[[list[int]], tuple[list[int], Any]]) -> None:
        prompt = [int(t) for t in rng.integers(1, 500, size=int(rng.integers(8, 12)))]
        tokens, sent = run(prompt)
        caught[name] = caught.get(name, 0) + accused(honest, verdicts(honest, "ort", tokens, sent))

    for _ in range(trials):
        trial("another model", fp32, lambda p: serve(packages["other"], "ort", p, 16))
        # (the package without its last block: one of its stages runs a block fewer)
        trial("a layer skipped", fp32, lambda p: serve(packages["skip"], "ort", p, 16))
        # (its differences are the smallest: a longer session, so that they add up)
        trial("fp32 computed in fp16", fp32, lambda p: serve(fp32, "fp16", p, 40))
        trial("int4 for fp32", fp32, lambda p: serve(packages["int4"], "ort", p, 16))
        trial("noise 1% (fp32)", fp32, lambda p: serve(fp32, "ort", p, 16, noise(0.01, rng)))
        trial("noise 1% (fp16)", fp16, lambda p: serve(fp16, "ort", p, 24, noise(0.01, rng)))
        trial("replay", fp32, lambda p: replayed(fp32, p, rng))
        trial("garbage", fp32, lambda p: garbage(fp32, p, rng))
    assert caught == dict.fromkeys(caught, trials), caught


def test_a_commitment_per_chunk_as_rows_come() -> None:
    rows = np.random.default_rng(3).standard_normal((70, 16)).astype(np.float32)
    c = Committer()
    assert c.add(rows[:10]) == []
    done = [x for i in range(10, 70) for x in c.add(rows[i : i + 1])]
    assert len(done) == 2 and len(c.finish()) == 1 and len(c.commitments) == 3
    assert check_rows(rows, c.commitments).within(TOLERANCES["float32"])
    assert not check_rows(rows[:40], c.commitments).within(TOLERANCES["float16"])


def test_the_polynomial_passes_through_every_committed_value() -> None:
    # (the interpolation is two matrix products in float64: exact only while every sum stays
    # below 2^53; checked here against plain integer arithmetic, degrees 0 to K - 1)
    # (some points among 0 .. n - 1, where the interpolation takes the value as given)
    rng = np.random.default_rng(4)
    for n, low in ((1, 0), (2, 1), (3, 0), (31, 5), (64, 0), (100, 40), (K, 0), (K, 3)):
        x = np.concatenate([rng.choice(n, size=low, replace=False), rng.choice(
            np.arange(n, PRIME), size=n - low, replace=False)]).astype(np.int64)  # fmt: skip
        y = rng.integers(0, 2**16, size=n).astype(np.int64)
        coeffs = [int(c) for c in _interpolate(x, y)]
        assert len(coeffs) == n and all(0 <= c < PRIME for c in coeffs)
        for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
            assert sum(c * pow(xi, e, PRIME) for e, c in enumerate(coeffs)) % PRIME == yi % PRIME
        assert _evaluate(np.array(coeffs), x).tolist() == (y % PRIME).tolist()


def test_the_largest_values_are_those_of_a_full_sort() -> None:
    rng = np.random.default_rng(6)
    for size, k in ((4096, K), (200, 7), (5, 5), (5, 1)):
        flat = rng.standard_normal(size).astype(np.float32)
        expect = np.sort(np.argsort(-np.abs(flat), kind="stable")[:k])
        assert largest(flat, k).tolist() == expect.tolist()
    tied = np.array([3.0, -1.0, 1.0, 2.0, -1.0, 0.5], dtype=np.float32)
    assert largest(tied, 3).tolist() == [0, 1, 3]  # (of the three tied at 1, the first)
    assert largest(tied, 5).tolist() == [0, 1, 2, 3, 4]


def test_commitments_made_together_are_each_chunks_own() -> None:
    """A microbatch's rows committed in one batched pass give each chunk's `commit` bytes:
    sequences cut into chunks of 128 tokens (a short last one), and a sequence of features."""
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((3, 300, 24)).astype(np.float32)
    parts = sequence_chunks(hidden, 128)
    assert [len(p) for p in parts] == [128, 128, 44] * 3
    assert commit_many(parts) == [commit(p) for p in parts]
    features = rng.standard_normal((4, 900)).astype(np.float32)
    assert commit_many(sequence_chunks(features, 128)) == [commit(f) for f in features]
    bad = hidden.copy()
    bad[1, 5, 3] = np.nan
    with pytest.raises(CommitmentError):
        commit_many(sequence_chunks(bad, 128))


def test_what_chunk_commitments_cover() -> None:
    """Chunks 0, 1, ... of CHUNK tokens, the last possibly fewer; anything else covers
    nothing a verifier can check (the client's and the broker's rule)."""
    from ir.toploc import covered

    assert covered({}) == 0 and covered({0: 5}) == 5 and covered({0: CHUNK, 1: 3}) == CHUNK + 3
    assert covered({1: CHUNK}) is None  # (a gap)
    assert covered({0: 5, 1: 5}) is None  # (a short chunk before the last)
    assert covered({0: 10_000}) is None and covered({0: 0}) is None
