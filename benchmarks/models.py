"""Model sources benchmark: each decoder family and each GGUF tensor type, split by
`fusionai ir split` and served by a swarm, against transformers and against one process.

    python benchmarks/models.py [--tokens 24]

Prints one JSON object with, for every family (llama, mistral, qwen2, qwen3, phi3, gemma2,
gemma3: small random models whose special features take effect, as in tests/tiny_models.py)
and every GGUF type (f32, f16, q8_0, q4_0, q4_1, q4_k, q6_k and the q4_k_m mix: a random Llama
written as llama.cpp writes it, tests/gguf_files.py):
    <name>_equal          whether the swarm's greedy tokens (3 provider processes, 2 provider
                          stages, the SDK driving the session) equal transformers' own
                          `generate` for the same weights (a boolean);
    <name>_split_s        wall time of `fusionai ir split` (a child process);
    <name>_split_rss_mb   that process's peak resident memory;
    <name>_token_ms_swarm p50 time per generated token through the swarm;
    <name>_token_ms_local p50 of one decoding step of the same stages in this process
                          (onnxruntime, one thread), measured in the same run;
    <name>_token_ratio    token_ms_swarm / token_ms_local.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.*: the models and helpers the tests use

from benchmarks.e2e import Swarm  # noqa: E402
from tests.procs import run_measured  # noqa: E402
from tests.tiny_models import hf_answer  # noqa: E402

PROMPT = [5, 17, 42, 7, 99, 3]
PER_SWARM = 2  # models one swarm of 3 providers serves at once
GGUF_TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M"]


def sources(tmp: Path) -> dict[str, tuple[Path, Any]]:
    """name -> (what `ir split` reads, the transformers model holding the same weights)."""
    from tests.gguf_files import q4_k_m, uniform, write_gguf
    from tests.test_ir.test_gguf import gguf_llama
    from tests.tiny_models import FAMILIES, family_model

    out: dict[str, tuple[Path, Any]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in FAMILIES:
            model = family_model(family)
            model.save_pretrained(tmp / f"hf-{family}")
            out[family] = (tmp / f"hf-{family}", model)
        base = gguf_llama()
        for kind in GGUF_TYPES:
            path = tmp / f"tiny-{kind.lower()}.gguf"
            types = q4_k_m if kind == "Q4_K_M" else uniform(kind)
            out[kind.lower()] = (path, write_gguf(base, path, types))
    return out


def split(source: Path, out: Path, name: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of `fusionai ir split` into 2 float provider stages."""
    command = [sys.executable, "-m", "cli.main", "ir", "split", str(source), "--stages", "2"]
    command += ["--quantize", "none"]  # equality with transformers is the question here
    command += ["--out", str(out), "--name", name, "--json"]
    started = time.perf_counter()
    result = run_measured(command)
    wall = time.perf_counter() - started
    if result["rc"] != 0:
        raise RuntimeError(f"split of {source.name} failed: {result['err']}")
    return wall, result["peak"] / 1e6


def local_token_ms(package: Path, tokens: int) -> float:
    """p50 of one decoding step (all stages) in this process, one onnxruntime thread."""
    import numpy as np

    from ir.executors import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    os.environ["FUSIONAI_THREADS"] = "1"
    pkg = load_package(package)
    pipeline = LocalPipeline(
        pkg.manifest, [OrtExecutor(pkg.models[s.index], threads=1) for s in pkg.manifest.stages]
    )
    cache = pipeline.new_cache()
    pipeline.step(np.array([PROMPT], dtype=np.int64), 0, cache)
    times = []
    for i in range(tokens):
        started = time.perf_counter()
        pipeline.step(np.array([[7]], dtype=np.int64), len(PROMPT) + i, cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def serve(tmp: Path, models: dict[str, Any], tokens: int, report: dict[str, Any]) -> None:
    """Serve `models` on a swarm of 3 providers; generate with each; fill in the report."""
    from client import Client

    swarm = Swarm(tmp, f"models-{next(iter(models))}", 3)
    try:
        for name in models:
            swarm.add(tmp / f"pkg-{name}")
        with Client(swarm.http, timeout=60, cache_dir=tmp / "client-cache") as fa:
            for name, model in models.items():
                expected = hf_answer(model, PROMPT, tokens)
                fa.generate(PROMPT, 2, stream=False, model=f"m-{name}")  # sessions warm
                got = fa.generate(PROMPT, tokens, stream=False, model=f"m-{name}")
                report[f"{name}_equal"] = got.tokens == expected
                gaps = [b - a for a, b in zip(got.token_times, got.token_times[1:], strict=False)]
                swarm_ms = statistics.median(gaps) * 1e3
                local_ms = local_token_ms(tmp / f"pkg-{name}", tokens)
                report[f"{name}_token_ms_swarm"] = round(swarm_ms, 2)
                report[f"{name}_token_ms_local"] = round(local_ms, 2)
                report[f"{name}_token_ratio"] = round(swarm_ms / local_ms, 2)
    finally:
        swarm.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=24, help="generated per model")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fusionai-models-"))
    report: dict[str, Any] = {}
    try:
        models = sources(tmp)
        for name, (source, _) in models.items():
            wall, rss = split(source, tmp / f"pkg-{name}", f"m-{name}")
            report[f"{name}_split_s"] = round(wall, 2)
            report[f"{name}_split_rss_mb"] = round(rss)
        names = list(models)
        for group in range(0, len(names), PER_SWARM):  # a fresh swarm for each few models
            serve(
                tmp,
                {n: models[n][1] for n in names[group : group + PER_SWARM]},
                args.tokens,
                report,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["all_equal"] = all(v for k, v in report.items() if k.endswith("_equal"))
    report["peak_rss_mb_this_process"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    print(json.dumps(report, indent=1))
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
