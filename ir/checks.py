"""Checking one run of a stage against another: the comparison, and synthetic inputs.

Two machines running the same validated stage give the same answer up to floating-point
noise (another GPU, fp16, another executor). `agree` says whether two answers match within a
tolerance; `probe_feeds` makes inputs to run any provider stage on when no real ones are at
hand (a probe of a provider someone says is wrong).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ir.manifest import StageInfo

Array = np.ndarray[Any, Any]


def agree(a: Array, b: Array, rtol: float, atol: float) -> tuple[bool, float]:
    """Whether `a` matches the reference `b`: same shape, and the largest difference at
    most `atol + rtol * max|b|` (a norm, not elementwise: tiny elements may differ more in
    fp16 on another GPU). Returns (agrees, largest difference); NaN or inf where the
    reference is finite never agrees."""
    if a.shape != b.shape:
        return False, math.inf
    if a.size == 0:
        return True, 0.0
    x, y = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(y)
    if not np.array_equal(np.isfinite(x), finite):
        return False, math.inf
    if not np.array_equal(x[~finite], y[~finite], equal_nan=True):
        return False, math.inf
    diff = float(np.max(np.abs(x[finite] - y[finite]), initial=0.0))
    scale = float(np.max(np.abs(y[finite]), initial=0.0))
    return diff <= atol + rtol * scale, diff


def probe_feeds(stage: StageInfo, seq: int = 4, seed: int = 0) -> tuple[dict[str, Array], bool]:
    """Inputs for one batch of `seq` tokens through `stage` (adapters and KV-cache inputs
    left out, and a decoder's attention mask, which the provider makes): hidden states drawn
    at random, positions 0..seq-1, a mask of ones. Returns
    (feeds, whether the stage keeps a KV cache)."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, Array] = {}
    adapters = {n for a in stage.adapters for n in (a.a_input, a.b_input)}
    cached = any(info.name.startswith("past_") for info in stage.inputs)
    for info in stage.inputs:
        if info.name.startswith("past_") or info.name in adapters:
            continue
        if cached and info.name == "attention_mask":  # a session's: the provider makes it
            continue
        shape = [1 if d == "batch" else d if isinstance(d, int) else seq for d in info.shape]
        if np.issubdtype(np.dtype(info.dtype), np.floating):
            feeds[info.name] = rng.standard_normal(shape).astype(info.dtype)
        elif "position" in info.name:
            feeds[info.name] = np.broadcast_to(np.arange(seq), shape).astype(info.dtype)
        else:
            feeds[info.name] = np.ones(shape, dtype=info.dtype)
    return feeds, cached


def empty_cache(stage: StageInfo) -> dict[str, Array]:
    """The KV-cache inputs of a fresh batch-1 session: no tokens cached."""
    return {
        info.name: np.zeros(
            [1 if d == "batch" else d if isinstance(d, int) else 0 for d in info.shape],
            dtype=info.dtype,
        )
        for info in stage.inputs
        if info.name.startswith("past_")
    }
