"""Job graphs: builders produce valid DAGs, validation names what is wrong, JSON round trips."""

from __future__ import annotations

import networkx as nx
import pytest

from dag.builders import data_parallel_train, finetune, generation, inference_pipeline
from dag.cost import HardwareProfile, Workload, critical_path, layer_time, pipeline_metrics
from dag.model import LLAMA2_7B, ModelSpec
from dag.tasks import Task, TaskKind, add_task, connect
from dag.validate import DagError, validate
from dag.wire import from_json, to_json

STAGES = [(0, 10), (10, 20), (20, 32)]
GPU = HardwareProfile("rtx3090", {"float16": 142e12}, 24e9, 936e9, 25e6, rtt=0.04)


@pytest.fixture(params=["inference", "generation", "finetune", "data_parallel"])
def graph(request: pytest.FixtureRequest) -> nx.DiGraph:
    m = LLAMA2_7B
    return {
        "inference": lambda: inference_pipeline(m, STAGES, batch=2, seq=128),
        "generation": lambda: generation(m, STAGES, batch=1, prompt=16, new_tokens=5),
        "finetune": lambda: finetune(
            m, STAGES, microbatches=3, batch=2, seq=64, adapter_bytes=[1e6] * 3
        ),
        "data_parallel": lambda: data_parallel_train(
            m, STAGES, replicas=2, microbatches=2, batch=2, seq=64, adapter_bytes=[1e6] * 3
        ),
    }[request.param]()


def test_builders_make_valid_graphs_that_round_trip_through_json_exactly(graph: nx.DiGraph) -> None:
    validate(graph)
    back = from_json(to_json(graph))
    assert to_json(back) == to_json(graph)
    assert dict(back.nodes(data="task")) == dict(graph.nodes(data="task"))
    assert sorted(back.edges(data=True)) == sorted(graph.edges(data=True))


def test_generation_sends_one_tokens_hidden_state_per_step_after_the_prompt() -> None:
    g = generation(LLAMA2_7B, STAGES, batch=1, prompt=16, new_tokens=3)
    hidden = LLAMA2_7B.hidden_bytes_per_token
    assert g.edges["prefill.fwd.s0", "prefill.fwd.s1"]["bytes"] == 16 * hidden
    assert g.edges["decode2.fwd.s0", "decode2.fwd.s1"]["bytes"] == hidden
    assert g.has_edge("decode1.fwd.s1", "decode2.fwd.s1")  # the KV cache stays with stage 1


def test_a_cycle_is_rejected_with_its_path() -> None:
    g = nx.DiGraph()
    a = add_task(g, Task("a", TaskKind.FORWARD, stage=0, inputs={"x": 1.0}, outputs={"x": 1.0}))
    b = add_task(g, Task("b", TaskKind.FORWARD, stage=1, inputs={"x": 1.0}, outputs={"x": 1.0}))
    connect(g, a, b, "x")
    connect(g, b, a, "x")
    with pytest.raises(DagError, match=r"cycle: (a -> b -> a|b -> a -> b)"):
        validate(g)


def test_a_missing_input_is_named() -> None:
    g = nx.DiGraph()
    add_task(g, Task("lonely", TaskKind.FORWARD, stage=0, inputs={"hidden": 8.0}))
    with pytest.raises(DagError, match="lonely needs 'hidden' but no task produces it"):
        validate(g)


def test_an_input_produced_twice_and_a_size_mismatch_are_named() -> None:
    g = nx.DiGraph()
    a = add_task(g, Task("a", TaskKind.EMBED, outputs={"hidden": 8.0}))
    b = add_task(g, Task("b", TaskKind.EMBED, outputs={"hidden": 8.0}))
    c = add_task(g, Task("c", TaskKind.FORWARD, stage=0, inputs={"hidden": 8.0}))
    connect(g, a, c, "hidden")
    connect(g, b, c, "hidden")
    with pytest.raises(DagError, match=r"c gets 'hidden' from several tasks: \['a', 'b'\]"):
        validate(g)
    g2 = nx.DiGraph()
    a = add_task(g2, Task("a", TaskKind.EMBED, outputs={"hidden": 8.0}))
    c = add_task(g2, Task("c", TaskKind.FORWARD, stage=0, inputs={"hidden": 16.0}))
    connect(g2, a, c, "hidden")
    with pytest.raises(DagError, match=r"'hidden' is 8\.0 bytes at a"):
        validate(g2)


def test_json_with_unknown_tasks_or_fields_is_rejected() -> None:
    g = inference_pipeline(LLAMA2_7B, STAGES, batch=1, seq=8)
    text = to_json(g).replace(b'"src":"embed"', b'"src":"ghost"')
    with pytest.raises(DagError, match="unknown task 'ghost'"):
        from_json(text)
    with pytest.raises(DagError, match="not a valid job graph"):
        from_json(b'{"format": "fusionai.dag"}')


def test_stages_must_cover_the_model() -> None:
    with pytest.raises(ValueError, match="cover 20 of 32 blocks"):
        inference_pipeline(LLAMA2_7B, [(0, 10), (10, 20)], batch=1, seq=8)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    m = ModelSpec.transformer("m", hidden=4096, layers=32, heads=32)
    decode = layer_time(m, GPU, Workload(tokens=1, sequences=1, context=512))
    prefill_work = Workload(tokens=2048, sequences=1, context=2048)
    prefill = layer_time(m, GPU, prefill_work)
    kv_read = 512 * m.layer_kv_bytes_per_token
    assert decode == pytest.approx((m.layer_param_bytes + kv_read) / GPU.mem_bandwidth)
    flops = 2048 * (m.layer_flops_per_token + m.layer_attn_flops_per_token_per_context * 2048)
    assert prefill == pytest.approx(flops / GPU.flops_for("float16"))
    # A whole pipeline adds sending hidden states on: 2048 tokens x 8 KB over 25 MB/s.
    metrics = pipeline_metrics(m, [(GPU, 32)], prefill_work)
    assert metrics.bottleneck == pytest.approx(32 * prefill + 2048 * 8192 / 25e6)


def test_critical_path_counts_transfers_between_machines() -> None:
    g = inference_pipeline(LLAMA2_7B, STAGES, batch=1, seq=128)
    machines = {0: "m0", 1: "m1", 2: "m2"}
    profiles = {name: GPU for name in machines.values()}
    split, path = critical_path(
        g, lambda t: machines.get(t.stage) if t.stage is not None else None, profiles
    )
    together, _ = critical_path(g, lambda t: "m0" if t.stage is not None else None, {"m0": GPU})
    assert path[0] == "load" and path[-1] == "head"
    assert split > together  # two extra hops over the network


def test_schedule_length_sees_pipeline_bubbles_and_one_task_per_gpu() -> None:
    from dag.builders import finetune
    from dag.cost import schedule_length

    m = ModelSpec.transformer("m", hidden=2048, layers=24, heads=16)
    fast_link = HardwareProfile("gpu", {"float16": 100e12}, 24e9, 1e12, 1e12, rtt=0.0)
    stages = [(0, 8), (8, 16), (16, 24)]
    micro, batch, seq = 6, 2, 256
    g = finetune(m, stages, microbatches=micro, batch=batch, seq=seq)
    where = {s: f"gpu{s}" for s in range(3)}
    profiles = {name: fast_link for name in where.values()}

    def place(t: Task) -> str | None:
        return where[t.stage] if t.stage is not None else None

    makespan = schedule_length(g, place, profiles)
    # One stage's forward and backward of one microbatch, from the shapes (backward = 2 x forward).
    tokens = batch * seq
    fwd = (
        8
        * tokens
        * (m.layer_flops_per_token + m.layer_attn_flops_per_token_per_context * seq)
        / 100e12
    )
    per_micro = fwd * 3
    assert makespan >= micro * per_micro  # each GPU does all its microbatches, one at a time
    assert makespan <= (micro + 2 * len(stages)) * per_micro  # plus fill and drain, not more
    assert (
        makespan > critical_path(g, place, profiles)[0]
    )  # the critical path ignores GPU contention
