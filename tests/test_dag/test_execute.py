"""The one graph executor: inputs by edge, fused forward chains, concurrency, failures; and
the microbatch a task carries (typed, and read from a version-1 graph's ids once)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dag.builders import finetune, inference_pipeline
from dag.execute import Unit, execute, units
from dag.model import LLAMA2_7B
from dag.tasks import TaskKind
from dag.validate import DagError
from dag.wire import from_json, to_json

STAGES = [(0, 10), (10, 20), (20, 32)]


def test_a_pipeline_runs_in_order_with_its_forward_stages_as_one_chain() -> None:
    graph = inference_pipeline(LLAMA2_7B, STAGES, batch=2, seq=8)
    calls: list[tuple[str, list[int], dict[str, Any]]] = []

    def handler(out: dict[str, Any]) -> Any:
        async def run(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
            calls.append((unit.kind, unit.stages, inputs))
            return out

        return run

    handlers = {
        TaskKind.DATA_LOAD: handler({"ids": "ids"}),
        TaskKind.EMBED: handler({"hidden": "h0"}),
        TaskKind.FORWARD: handler({"hidden": "h3"}),
        TaskKind.HEAD: handler({"out": "embeddings"}),
    }
    values = asyncio.run(execute(graph, handlers, fuse=frozenset({TaskKind.FORWARD})))
    assert [(k, s) for k, s, _ in calls] == [
        ("data_load", []),
        ("embed", []),
        ("forward", [0, 1, 2]),  # one call: the providers relay among themselves
        ("head", []),
    ]
    assert [i for _, _, i in calls] == [{}, {"ids": "ids"}, {"hidden": "h0"}, {"hidden": "h3"}]
    assert values["head"] == {"out": "embeddings"}
    unfused = asyncio.run(execute(graph, handlers))  # each stage its own call
    assert len(calls) == 4 + 6 and unfused["head"] == {"out": "embeddings"}


def test_a_step_runs_each_task_once_its_inputs_are_ready_and_a_failure_cancels_the_rest() -> None:
    graph = finetune(LLAMA2_7B, STAGES, microbatches=2, batch=2, seq=8)
    ran: list[tuple[str, int, list[int]]] = []
    both_loading = asyncio.Event()
    loading = 0

    async def run(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        nonlocal loading
        ran.append((unit.kind, unit.microbatch, unit.stages))
        if unit.kind is TaskKind.DATA_LOAD:  # the two microbatches start together
            loading += 1
            if loading == 2:
                both_loading.set()
            await asyncio.wait_for(both_loading.wait(), 5)
        return dict.fromkeys(unit.tasks[-1].outputs)

    handlers = dict.fromkeys(
        (TaskKind.DATA_LOAD, TaskKind.EMBED, TaskKind.FORWARD, TaskKind.LOSS, TaskKind.BACKWARD),
        run,
    )
    with pytest.raises(DagError, match="update"):  # no handler: nothing starts
        asyncio.run(execute(graph, handlers, concurrent=True))
    assert ran == []
    handlers[TaskKind.UPDATE] = run
    asyncio.run(execute(graph, handlers, concurrent=True))
    assert len(ran) == graph.number_of_nodes()
    assert sorted(m for k, m, _ in ran if k == "loss") == [0, 1]
    assert sorted(s for k, _, s in ran if k == "update") == [[0], [1], [2]]

    async def broken(unit: Unit, inputs: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError(f"stage {unit.stages} lost")

    ran.clear()
    handlers[TaskKind.BACKWARD] = broken
    with pytest.raises(ExceptionGroup) as caught:
        asyncio.run(execute(graph, handlers, concurrent=True))
    assert "lost" in str(caught.value.exceptions[0])
    assert not any(k == "update" for k, _, _ in ran)  # nothing after the failure ran


def test_microbatches_are_typed_and_a_version_1_graph_gets_them_from_its_ids() -> None:
    graph = finetune(LLAMA2_7B, STAGES, microbatches=3, batch=2, seq=8)
    assert {graph.nodes[n]["task"].microbatch for n in graph if n.startswith("mb2.")} == {2}
    doc = json.loads(to_json(graph))
    assert doc["version"] == 2
    doc["version"] = 1  # as an earlier broker stored it
    for t in doc["tasks"]:
        del t["microbatch"]
    old = from_json(json.dumps(doc).encode())
    assert to_json(old) == to_json(graph)
    doc["version"] = 2
    with pytest.raises(DagError, match="no microbatch"):
        from_json(json.dumps(doc).encode())
    forwards = sorted(u.stages for u in units(graph) if u.kind is TaskKind.FORWARD)
    assert forwards == [[0]] * 3 + [[1]] * 3 + [[2]] * 3  # not fused: nothing asked it
