"""KV cache benchmark: a decoder stage's generation step as its context grows, with the stage
writing its new keys and values into the cache in place, against the stage of packages split
before (which output the whole cache again, a copy of it every step); same run, alternated.

    python benchmarks/kv_cache.py [--steps 32] [--rounds 3]

The stage is the benchmarks' decoder's first provider stage (a random Llama of hidden 256,
8 query heads on 4 key heads, 3 blocks: `benchmarks/e2e.py`), run by onnxruntime on one
thread, each step as a provider runs it: the cache and mask fed (`ir.pipeline.cache_feeds`),
the stage run, the new cache kept (`ir.pipeline.next_cache`). Each case runs `--steps` steps
from `cached` tokens on, every row as long.

Prints one JSON object: `cases`, a list of {rows, cached, ms_in_place, ms_whole_cache, ratio}
(the median step's milliseconds over `--rounds` rounds; ratio = in place over whole cache:
below 1 is faster), and `ratio_16x512` (16 rows at 512 cached tokens: target <= 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.*: the helpers the tests use

import numpy as np  # noqa: E402

from benchmarks.e2e import decoder_model  # noqa: E402

CASES = [(1, 64), (16, 64), (16, 256), (16, 512), (1, 960)]  # (rows, cached tokens)
Array = np.ndarray[Any, Any]


def steps_ms(executor: Any, info: Any, rows: int, cached: int, steps: int) -> list[float]:
    """Milliseconds of each of `steps` steps of `rows` sessions from `cached` tokens on."""
    from ir.pipeline import cache_feeds, next_cache

    rng = np.random.default_rng(0)
    cache: dict[str, Array] = {
        i.name: rng.standard_normal((rows, int(i.shape[1]), cached, int(i.shape[3]))).astype(
            np.float32
        )
        for i in info.inputs
        if i.name.startswith("past_")
    }
    times = []
    for step in range(steps):
        length = cached + step
        feeds = {
            "hidden_states": rng.standard_normal((rows, 1, 256)).astype(np.float32),
            "position_ids": np.full((rows, 1), length, dtype=np.int64),
        }
        start = time.perf_counter()
        feeds.update(cache_feeds(info, cache, [length] * rows, 1))
        outputs = executor.run(feeds)
        kept = next_cache(cache, [length] * rows, outputs)
        times.append((time.perf_counter() - start) * 1e3)
        assert kept is not None and kept[1] == length + 1
        cache = kept[0]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be positive")

    from ir.executors import OrtExecutor
    from ir.export import build_package
    from ir.package import load_package
    from ir.pipeline import appends
    from tests.tiny_models import whole_cache_stage

    with tempfile.TemporaryDirectory(prefix="kv-cache-") as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_package(decoder_model(), 3, Path(tmp) / "decoder", name="decoder")
        loaded = load_package(Path(tmp) / "decoder")
    info = loaded.manifest.provider_stages()[0]
    model = loaded.models[info.index]
    old_model, old_info = whole_cache_stage(model, info)
    assert appends(info) and not appends(old_info)
    kinds = {
        "in_place": (OrtExecutor(model, threads=1), info),
        "whole_cache": (OrtExecutor(old_model, threads=1), old_info),
    }
    times: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for rows, cached in CASES:
            for kind, (executor, stage) in kinds.items():
                steps_ms(executor, stage, rows, cached, 3)  # (warm)
                ms = steps_ms(executor, stage, rows, cached, args.steps)
                times.setdefault((rows, cached, kind), []).extend(ms)
    cases = []
    for rows, cached in CASES:
        new = statistics.median(times[(rows, cached, "in_place")])
        old = statistics.median(times[(rows, cached, "whole_cache")])
        cases.append(
            {
                "rows": rows,
                "cached": cached,
                "ms_in_place": round(new, 3),
                "ms_whole_cache": round(old, 3),
                "ratio": round(new / old, 3),
            }
        )
    ratio = next(c["ratio"] for c in cases if (c["rows"], c["cached"]) == (16, 512))
    print(json.dumps({"cases": cases, "ratio_16x512": ratio, "steps": args.steps}))


if __name__ == "__main__":
    main()
