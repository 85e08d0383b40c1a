"""Sessions with activation commitments on real stages (`ir.toploc`), for the tests and the
benchmark: a prover decodes one token at a time and commits to each provider stage's
outputs; a verifier recomputes the whole sequence in one prefill pass; and the cheats."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ir.toploc import TOLERANCES, Check, Committer, check_rows

Array = np.ndarray[Any, Any]
Hop = Callable[[int, Array], Array]  # (stage, its output) -> what goes on


def build_packages(model: Any, root: Path) -> dict[str, Any]:
    """`model` (a transformers Llama) as fp32 and fp16 packages, and the cheats' packages:
    int4 weights, another model's weights (same config, other seed), and the last block left
    out (2 provider stages each)."""
    import torch
    import transformers

    from ir.export import Encoding, build_package
    from ir.package import load_package

    torch.manual_seed(7)
    other = transformers.LlamaForCausalLM(model.config).eval()
    skip = copy.deepcopy(model)
    skip.model.layers = skip.model.layers[:-1]
    skip.config.num_hidden_layers -= 1
    models = {"fp32": (model, Encoding()), "fp16": (model, Encoding(fp16=True)),
              "int4": (model, Encoding(quantize=(4, 32))), "other": (other, Encoding()),
              "skip": (skip, Encoding())}  # fmt: skip
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (m, encoding) in models.items():
            build_package(m, 2, root / name, name=name, encoding=encoding)
            out[name] = load_package(root / name)
    return out


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


def pipeline(
    pkg: Any,
    executor: str,
    hop: Hop | None = None,
    given: Callable[[int, Array], None] | None = None,
) -> Any:
    """The package's stages on `executor` ("ort", "torch", or "fp16": provider stages computed
    in fp16); `hop` sees each provider stage's output, `given` each one's input. (Executors
    are made once per package and kind: a session's state lives in its cache, not in them.)"""
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
        out = hop(i - 1, hidden) if hop and i > 0 else hidden
        if given is not None and i < middle:
            given(i, out)
        return out

    return LocalPipeline(pkg.manifest, runs, hop=each)


def serve(
    pkg: Any,
    executor: str,
    prompt: list[int],
    new: int,
    cheat: Hop | None = None,
    commits: bool = True,
    ledgers: list[Any] | None = None,
) -> tuple[list[int], list[list[bytes]]]:
    """The prover: the prompt in one pass, then `new` tokens one at a time (greedy); each
    provider stage commits to its outputs as they come (unless not `commits`). Returns the
    tokens fed and each stage's commitments. With `ledgers` (a `provider.commitments.Ledger`
    a stage), the stages commit as a provider does: to their inputs too, signed."""
    stages = len(pkg.manifest.stages) - 2
    committers = [Committer() for _ in range(stages)]
    inputs: dict[int, Array] = {}
    made: list[list[Any]] = [[] for _ in range(stages)]  # the ledgers' commitments

    def hop(stage: int, hidden: Array) -> Array:
        if cheat is not None:
            hidden = cheat(stage, hidden)
        if ledgers is not None:
            made[stage] += ledgers[stage].add(inputs[stage][0], hidden[0])
        elif commits:
            committers[stage].add(hidden[0].astype(np.float32))
        return hidden

    def given(stage: int, hidden: Array) -> None:
        inputs[stage] = hidden

    pipe = pipeline(pkg, executor, hop, given if ledgers is not None else None)
    cache = pipe.new_cache()
    tokens = list(prompt)
    logits = pipe.step(np.array([tokens], dtype=np.int64), 0, cache)
    for _ in range(new):
        tokens.append(int(np.argmax(logits[0, -1])))
        logits = pipe.step(np.array([tokens[-1:]], dtype=np.int64), len(tokens) - 1, cache)
    if ledgers is not None:
        for ledger, mine in zip(ledgers, made, strict=True):
            mine += ledger.finish()
        return tokens, [[c.data for c in mine] for mine in made]
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


def noise(level: float, rng: np.random.Generator) -> Hop:
    def add(stage: int, hidden: Array) -> Array:
        if stage != 0:
            return hidden
        rms = float(np.sqrt(np.mean(hidden.astype(np.float32) ** 2)))
        return (hidden + level * rms * rng.standard_normal(hidden.shape)).astype(hidden.dtype)

    return add


def replayed(
    pkg: Any, prompt: list[int], rng: np.random.Generator, new: int = 16
) -> tuple[list[int], list[list[bytes]]]:
    """Another session's commitments (another prompt) sent for this one."""
    tokens, _ = serve(pkg, "ort", prompt, new)
    other = [int(t) for t in rng.integers(1, 500, size=len(prompt))]
    _, sent = serve(pkg, "ort", other, new)
    return tokens, sent


def garbage(
    pkg: Any, prompt: list[int], rng: np.random.Generator, new: int = 16
) -> tuple[list[int], list[list[bytes]]]:
    """Commitments of the right count and form, with random contents."""
    tokens, sent = serve(pkg, "ort", prompt, new)
    junk = [
        [
            int(rng.integers(2**15 + 1, 65497)).to_bytes(2, "big")
            + rng.integers(0, 65497, size=128).astype(">u2").tobytes()
            for _ in stage
        ]
        for stage in sent
    ]
    return tokens, junk


def forget_executors() -> None:
    _EXECUTORS.clear()
