"""Real models split into ONNX stages give the unsplit model's results."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from ir.executors import OrtExecutor
from ir.manifest import ModelManifest
from ir.package import load_package
from ir.pipeline import LocalPipeline, next_cache, room
from p2p.tensor import through_wire

pytestmark = pytest.mark.timeout(300)


def wire_hop(manifest: ModelManifest) -> Any:
    """What the package's wire format does to hidden states between stages."""
    return functools.partial(through_wire, wire=manifest.wire)


def ort_pipeline(directory: Any) -> LocalPipeline:
    package = load_package(directory)
    executors = [
        OrtExecutor(package.models[i], threads=1) for i in range(len(package.manifest.stages))
    ]
    return LocalPipeline(package.manifest, executors, hop=wire_hop(package.manifest))


@pytest.mark.parametrize("n_stages", [1, 2, 3, 6])
def test_minilm_split_embeddings_equal_the_unsplit_model_on_ort(
    minilm: Any, minilm_batch: Any, build: Any, n_stages: int
) -> None:
    model, _, path = minilm
    ids, mask, ref = minilm_batch
    manifest, directory = build(model, n_stages, tokenizer_file=path / "tokenizer.json")
    assert len(manifest.provider_stages()) == n_stages
    assert [s.placement for s in manifest.stages] == ["client", *["provider"] * n_stages, "client"]
    got = ort_pipeline(directory).encode(ids, mask)
    assert np.abs(got - ref).max() <= 1e-4


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_decoder_greedy_generation_with_kv_cache_equals_torch(
    request: pytest.FixtureRequest, build: Any, family: str, n_stages: int
) -> None:
    model = request.getfixturevalue(family)
    prompt = [5, 17, 42, 7, 99, 3]
    reference = _hf_greedy(model, prompt, 20)
    assert len(set(reference)) > 3, "the reference output is degenerate; the test would be weak"
    manifest, directory = build(model, n_stages)
    stage = manifest.provider_stages()[0]
    assert any(i.name.startswith("past_key.") for i in stage.inputs)
    assert stage.kv_bytes_per_token > 0
    pipeline = ort_pipeline(directory)
    assert pipeline.generate_greedy(prompt, 20) == reference
    assert pipeline.generate_greedy(prompt, 20, use_cache=False) == reference


def test_after_the_prompt_each_step_sends_one_token_of_hidden_state(llama: Any, build: Any) -> None:
    manifest, directory = build(llama, 2)
    pipeline = ort_pipeline(directory)
    cache = pipeline.new_cache()
    pipeline.step(np.array([[5, 17, 42]], dtype=np.int64), 0, cache)
    stage = manifest.provider_stages()[0]
    key = cache[stage.index]["past_key.0"]
    assert key.shape[2] == room(3)  # its 3 tokens, and room for more after them
    seen: list[tuple[int, ...]] = []
    executor = pipeline.executors[stage.index]
    original = executor.run
    executor.run = lambda feeds: (seen.append(feeds["hidden_states"].shape), original(feeds))[1]  # type: ignore[method-assign]
    pipeline.step(np.array([[9]], dtype=np.int64), 3, cache)
    assert seen == [(1, 1, int(manifest.config["hidden_size"]))]
    assert cache[stage.index]["past_key.0"] is key  # the 4th token's written in place
    assert not key[:, :, 4:].any()  # (and nothing after it)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_decoder_stage_copies_no_kv_cache(
    request: pytest.FixtureRequest, build: Any, family: str
) -> None:
    """Attention reads the past keys and values where they are: no node joins them to the
    new token's (the stage outputs only the new tokens' keys and values, `new_*`, which its
    caller writes into the cache in place), and none repeats them per query head (the tiny
    Llama has 4 query heads on 2 key heads)."""
    import onnx

    manifest, directory = build(request.getfixturevalue(family), 2)
    stage = manifest.provider_stages()[0]
    graph = onnx.load(str(directory / stage.file), load_external_data=False).graph
    pasts = {i.name for i in stage.inputs if i.name.startswith("past_")}
    readers = {p: [n.op_type for n in graph.node if p in n.input] for p in sorted(pasts)}
    assert pasts and all("Concat" not in ops for ops in readers.values()), readers
    news = {o.name for o in stage.outputs if o.name.startswith("new_")}
    assert news == {p.replace("past_", "new_") for p in pasts}
    assert all(o.shape[2] == "sequence" for o in stage.outputs if o.name in news)
    assert not {"Tile", "Expand"} & {n.op_type for n in graph.node}


def test_new_keys_are_written_after_each_rows_tokens_in_place_or_in_a_grown_copy() -> None:
    rng = np.random.default_rng(0)
    cache = {"past_key.0": rng.standard_normal((3, 2, 10, 4)).astype(np.float32)}
    before = cache["past_key.0"].copy()
    new = rng.standard_normal((3, 2, 1, 4)).astype(np.float32)
    kept = next_cache(cache, [3, 9, 5], {"new_key.0": new, "hidden_states_out": new})
    assert kept is not None
    arrays, longest = kept
    assert longest == 10 and arrays["past_key.0"] is cache["past_key.0"]  # room: in place
    for row, n in enumerate([3, 9, 5]):
        got, want = arrays["past_key.0"][row], before[row].copy()
        want[:, n] = new[row, :, 0]
        assert np.array_equal(got, want)  # its token after its own, nothing else changed
    # two more tokens for every row: the longest has no room, so a copy with room grows
    two = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)
    kept = next_cache(arrays, [4, 10, 6], {"new_key.0": two})
    assert kept is not None
    grown, longest = kept
    assert longest == 12 and grown["past_key.0"].shape == (3, 2, room(12), 4) == (3, 2, 44, 4)
    assert np.array_equal(grown["past_key.0"][1, :, :10], arrays["past_key.0"][1])
    assert np.array_equal(grown["past_key.0"][1, :, 10:12], two[1])
    assert np.array_equal(grown["past_key.0"][0, :, 4:6], two[0])
    assert not grown["past_key.0"][1, :, 12:].any()
    # a stage split before gives its whole cache again: that is the cache
    whole = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    assert next_cache({}, [4], {"present_key.0": whole}) == ({"past_key.0": whole}, 5)
    assert next_cache(cache, [3], {"hidden_states_out": new}) is None
    assert room(1000) == 1125  # long caches grow by an eighth


def test_an_empty_cache_of_one_row_takes_a_prompt_of_several(llama: Any, build: Any) -> None:
    """`new_cache()` (one row) for a step of two rows: the cache after it has both rows, and
    their logits are each row's alone."""
    _, directory = build(llama, 2)
    pipeline = ort_pipeline(directory)
    rows = np.array([[5, 17, 42], [9, 8, 7]], dtype=np.int64)
    cache = pipeline.new_cache()
    logits = pipeline.step(rows, 0, cache)
    assert all(a.shape[0] == 2 for c in cache.values() for a in c.values())
    for i in range(2):
        alone = pipeline.step(rows[i : i + 1], 0, pipeline.new_cache())
        assert np.allclose(alone, logits[i : i + 1], atol=1e-5)
