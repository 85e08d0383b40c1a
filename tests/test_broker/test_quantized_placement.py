"""A quantized package needs fewer providers: the placement and the providers' memory checks
read each stage's real bytes from the manifest."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.test_broker.inproc import Swarm, swarm

pytestmark = pytest.mark.timeout(120)


def package(tmp: Path, quantize: tuple[int, int] | None) -> Path:
    from ir.export import build_package
    from tests.tiny_models import family_model

    # wide enough that a stage's weights dominate what a provider must hold for it
    model = family_model(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=3, head_dim=128
    )
    out = tmp / ("int4" if quantize else "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 3, out, name=f"wide-{out.name}", quantize=quantize)
    return out


def pipelines(s: Swarm, model: str) -> list[list[str]]:
    """Each replica's providers, one per stage (a stage may hold several blocks)."""
    placement = s.broker.driver.core.plans[model].placement
    assert placement is not None
    return [[st.provider for st in r.stages] for r in placement.replicas]


async def test_an_int4_package_fits_one_provider_where_fp32_needs_three(tmp_path: Path) -> None:
    fp32, int4 = package(tmp_path, None), package(tmp_path, (4, 32))
    # per stage the placement counts 67 MB of activation workspace (4096 tokens of hidden
    # states), then 16.8 MB per fp32 block (12.6 MB weights, 4.2 MB KV cache) or 6.2 MB per int4
    # block: 0.9 x 100 MB holds one fp32 block, or all three int4 ones
    budget = 100 << 20
    s: Swarm = await swarm(tmp_path / "one")
    try:
        await s.provider(max_memory_bytes=budget)
        waiting = await s.add_model(fp32)
        small = await s.add_model(int4)
        await s.until("int4 served", lambda: all(s.broker.serving.route(small) or [[]]))
        placement = s.broker.driver.core.plans[small].placement
        assert placement is not None
        (stage,) = [st for r in placement.replicas for st in r.stages]  # all on the one
        assert (stage.provider, stage.first, stage.end) == (next(iter(s.providers)), 0, 3)
        assert not s.broker.serving.route(waiting)
        why = [e["reason"] for e in s.events("model_waiting") if e["model"] == waiting]
        assert why and "needs" in why[-1], why
    finally:
        await s.close()
    s = await swarm(tmp_path / "three")
    try:
        for _ in range(3):
            await s.provider(max_memory_bytes=budget)
        model = await s.add_model(fp32)
        await s.until("fp32 served", lambda: all(s.broker.serving.route(model) or [[]]))
        got: Any = pipelines(s, model)
        assert len(got) == 1 and len(set(got[0])) == 3, got  # one block per provider
    finally:
        await s.close()
