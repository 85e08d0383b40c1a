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
    from ir.export import Encoding, build_package
    from tests.tiny_models import family_model

    # wide enough that a stage's weights dominate what a provider must hold for it
    model = family_model(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=3, head_dim=128
    )
    out = tmp / ("int4" if quantize else "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 3, out, name=f"wide-{out.name}", encoding=Encoding(quantize=quantize))
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


def test_the_cost_model_counts_the_bytes_the_int8_wire_saves(
    llama_package: Path, llama_int8_wire_package: Path
) -> None:
    """The placement reads what a token's hidden states cost to send from the manifest: over
    the same uplinks, the int8 wire's sends take 136/512 of the fp32 wire's time."""
    from broker.core.placement import PlacementConfig, provider_costs
    from broker.models import model_spec
    from broker.swarms import random_swarm
    from dag.cost import Workload
    from ir.manifest import ModelManifest

    specs = [
        model_spec(ModelManifest.from_json((p / "manifest.json").read_bytes()))
        for p in (llama_package, llama_int8_wire_package)
    ]
    assert [s.hidden_bytes_per_token for s in specs] == [128 * 4, 128 + 4 * 2]
    swarm = random_swarm(6, 1)
    config = PlacementConfig(work=Workload(tokens=8, sequences=8, context=512, kv_tokens=4096))
    fp32, int8 = (provider_costs(s, swarm, config) for s in specs)
    assert (int8.x > 0).all() and int8.x == pytest.approx(fp32.x * 136 / 512, rel=0.05)
    assert (int8.t == fp32.t).all() and (int8.cap == fp32.cap).all()  # compute and memory alike
