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

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ir.toploc import (
    CHUNK,
    TOLERANCES,
    Check,
    CommitmentError,
    Committer,
    check_rows,
    commit,
    parse,
)

pytest.importorskip("torch")
pytest.importorskip("transformers")

Array = np.ndarray[Any, Any]
Hop = Callable[[int, Array], Array]  # (stage, its output) -> what goes on


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
    """The tiny Llama as fp32 and fp16 packages, and the cheats' packages: int4 weights,
    another model's weights, and the last block left out (2 provider stages each)."""
    import torch
    import transformers

    from ir.export import Encoding, build_package
    from ir.package import load_package
    from tests.tiny_models import tiny_llama

    base = tiny_llama()
    torch.manual_seed(7)
    other = transformers.LlamaForCausalLM(base.config).eval()
    skip = copy.deepcopy(base)
    skip.model.layers = skip.model.layers[:3]
    skip.config.num_hidden_layers = 3
    models = {"fp32": (base, Encoding()), "fp16": (base, Encoding(fp16=True)),
              "int4": (base, Encoding(quantize=(4, 32))), "other": (other, Encoding()),
              "skip": (skip, Encoding())}  # fmt: skip
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (model, encoding) in models.items():
            path = tmp_path_factory.mktemp(name)
            build_package(model, 2, path, name=name, encoding=encoding)
            out[name] = load_package(path)
    yield out
    _EXECUTORS.clear()


class Fp16Compute:
    """A cheat: an fp32 stage computed in fp16 (torch's autocast)."""

    def __init__(self, model: Any) -> None:
        from ir.executors.torch_exec import TorchExecutor

        self.inner = TorchExecutor(model)
        self.inputs, self.outputs = self.inner.inputs, self.inner.outputs

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        import torch

        with torch.autocast("cpu", dtype=torch.float16):
            out = self.inner.run(feeds)
        return {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in out.items()}


_EXECUTORS: dict[tuple[str, str], list[Any]] = {}


def pipeline(pkg: Any, executor: str, hop: Hop | None = None) -> Any:
    """The package's stages on `executor` ("ort", "torch", or "fp16": provider stages computed
    in fp16); `hop` sees each provider stage's output. (Executors are made once per package
    and kind: a session's state lives in its cache, not in them.)"""
    from ir.executors.ort import OrtExecutor
    from ir.executors.torch_exec import TorchExecutor
    from ir.pipeline import LocalPipeline

    key = (pkg.manifest.name, executor)
    if key not in _EXECUTORS:
        runs: list[Any] = []
        for s in pkg.manifest.stages:
            model = pkg.models[s.index]
            if executor == "torch":
                runs.append(TorchExecutor(model))
            elif executor == "fp16" and s.placement == "provider":
                runs.append(Fp16Compute(model))
            else:
                runs.append(OrtExecutor(model, threads=1))
        _EXECUTORS[key] = runs
    runs = _EXECUTORS[key]
    seen = [0]
    middle = len(pkg.manifest.stages) - 2

    def each(hidden: Array) -> Array:  # called with the embedding's output, then each stage's
        i, seen[0] = seen[0] % (middle + 1), seen[0] + 1
        return hop(i - 1, hidden) if hop and i > 0 else hidden

    return LocalPipeline(pkg.manifest, runs, hop=each)


def serve(
    pkg: Any, executor: str, prompt: list[int], new: int, cheat: Hop | None = None
) -> tuple[list[int], list[list[bytes]]]:
    """The prover: the prompt in one pass, then `new` tokens one at a time (greedy); each
    provider stage commits to its outputs as they come. Returns the tokens fed and each
    stage's commitments."""
    stages = len(pkg.manifest.stages) - 2
    committers = [Committer() for _ in range(stages)]

    def hop(stage: int, hidden: Array) -> Array:
        if cheat is not None:
            hidden = cheat(stage, hidden)
        committers[stage].add(hidden[0].astype(np.float32))
        return hidden

    pipe = pipeline(pkg, executor, hop)
    cache = pipe.new_cache()
    tokens = list(prompt)
    logits = pipe.step(np.array([tokens], dtype=np.int64), 0, cache)
    for _ in range(new):
        tokens.append(int(np.argmax(logits[0, -1])))
        logits = pipe.step(np.array([tokens[-1:]], dtype=np.int64), len(tokens) - 1, cache)
    for c in committers:
        c.finish()
    return tokens, [c.commitments for c in committers]


def recompute(pkg: Any, executor: str, tokens: list[int]) -> list[Array]:
    """The verifier: every provider stage's outputs for the whole sequence in one pass."""
    rows: dict[int, Array] = {}

    def hop(stage: int, hidden: Array) -> Array:
        rows[stage] = hidden[0].astype(np.float32)
        return hidden

    pipe = pipeline(pkg, executor, hop)
    pipe.step(np.array([tokens], dtype=np.int64), 0, pipe.new_cache())
    return [rows[i] for i in sorted(rows)]


def verdicts(pkg: Any, executor: str, tokens: list[int], sent: list[list[bytes]]) -> list[Check]:
    return [check_rows(r, c) for r, c in zip(recompute(pkg, executor, tokens), sent, strict=True)]


def accused(pkg: Any, checks: list[Check]) -> bool:
    dtype = pkg.manifest.stages[1].outputs[0].dtype
    return not all(c.within(TOLERANCES[dtype]) for c in checks)


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


def _noise(level: float, rng: np.random.Generator) -> Hop:
    def add(stage: int, hidden: Array) -> Array:
        if stage != 0:
            return hidden
        rms = float(np.sqrt(np.mean(hidden.astype(np.float32) ** 2)))
        return (hidden + level * rms * rng.standard_normal(hidden.shape)).astype(hidden.dtype)

    return add


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
        trial("noise 1% (fp32)", fp32, lambda p: serve(fp32, "ort", p, 16, _noise(0.01, rng)))
        trial("noise 1% (fp16)", fp16, lambda p: serve(fp16, "ort", p, 24, _noise(0.01, rng)))
        trial("replay", fp32, lambda p: _replayed(fp32, p, rng))
        trial("garbage", fp32, lambda p: _garbage(fp32, p, rng))
    assert caught == dict.fromkeys(caught, trials), caught


def _replayed(
    pkg: Any, prompt: list[int], rng: np.random.Generator
) -> tuple[list[int], list[list[bytes]]]:
    """Another session's commitments (another prompt) sent for this one."""
    tokens, _ = serve(pkg, "ort", prompt, 16)
    other = [int(t) for t in rng.integers(1, 500, size=len(prompt))]
    _, sent = serve(pkg, "ort", other, 16)
    return tokens, sent


def _garbage(
    pkg: Any, prompt: list[int], rng: np.random.Generator
) -> tuple[list[int], list[list[bytes]]]:
    tokens, sent = serve(pkg, "ort", prompt, 16)
    junk = [
        [
            int(rng.integers(2**15 + 1, 65497)).to_bytes(2, "big")
            + rng.integers(0, 65497, size=128).astype(">u2").tobytes()
            for _ in stage
        ]
        for stage in sent
    ]
    return tokens, junk


def test_a_commitment_per_chunk_as_rows_come() -> None:
    rows = np.random.default_rng(3).standard_normal((70, 16)).astype(np.float32)
    c = Committer()
    assert c.add(rows[:10]) == []
    done = [x for i in range(10, 70) for x in c.add(rows[i : i + 1])]
    assert len(done) == 2 and len(c.finish()) == 1 and len(c.commitments) == 3
    assert check_rows(rows, c.commitments).within(TOLERANCES["float32"])
    assert not check_rows(rows[:40], c.commitments).within(TOLERANCES["float16"])
