"""Run a job graph: the one interpreter of `dag` graphs that every job kind's runner uses.

    outputs = await execute(graph, {TaskKind.EMBED: embed, TaskKind.FORWARD: forward, ...})

Each task gets the tensors its in-edges carry (`into` name -> value, from the producer's
outputs under the edge's `tensor` name) and returns its own outputs. A kind listed in `fuse`
runs as one call for a run of such tasks where each feeds only the next (a chain of forward
stages the providers relay among themselves); the handler receives the whole `Unit` and
returns the last task's outputs.

`concurrent=False` runs units one after another in topological order (a pipeline for one
microbatch: nothing to overlap), and a handler's exception propagates as it is.
`concurrent=True` starts every unit as soon as its inputs are ready, in one task group: the
first failure cancels the rest and the caller gets an `ExceptionGroup` (as from
`asyncio.TaskGroup`). A kind with no handler fails the run before any task starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from dag.tasks import Task, TaskKind, task
from dag.validate import DagError


@dataclass(frozen=True)
class Unit:
    """What one handler call runs: one task, or a fused chain of tasks of one kind."""

    nodes: tuple[str, ...]
    tasks: tuple[Task, ...]

    @property
    def kind(self) -> TaskKind:
        return self.tasks[0].kind

    @property
    def task(self) -> Task:
        """The first task (the only one unless fused)."""
        return self.tasks[0]

    @property
    def stages(self) -> list[int]:
        """The provider stages the unit runs, in order."""
        return [t.stage for t in self.tasks if t.stage is not None]

    @property
    def microbatch(self) -> int:
        return self.tasks[0].microbatch


Handler = Callable[[Unit, dict[str, Any]], Awaitable[dict[str, Any]]]


def units(graph: nx.DiGraph, fuse: frozenset[TaskKind] = frozenset()) -> list[Unit]:
    """The graph's units in topological order."""
    order = list(nx.topological_sort(graph))
    taken: set[str] = set()
    out: list[Unit] = []
    for node in order:
        if node in taken:
            continue
        chain = [node]
        kind = task(graph, node).kind
        while kind in fuse and graph.out_degree(chain[-1]) == 1:
            (nxt,) = graph.successors(chain[-1])
            if task(graph, nxt).kind is not kind or graph.in_degree(nxt) != 1:
                break
            chain.append(nxt)
        taken.update(chain)
        out.append(Unit(tuple(chain), tuple(task(graph, n) for n in chain)))
    return out


async def execute(
    graph: nx.DiGraph,
    handlers: Mapping[TaskKind, Handler],
    *,
    fuse: frozenset[TaskKind] = frozenset(),
    concurrent: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run every task of `graph` by its kind's handler; returns each unit's last node's
    outputs by node id."""
    plan = units(graph, fuse)
    missing = sorted({u.kind for u in plan} - set(handlers))
    if missing:
        raise DagError(f"this job cannot run tasks of kind {', '.join(missing)}")
    first = {u.nodes[0]: u for u in plan}
    if not concurrent:
        values: dict[str, dict[str, Any]] = {}
        for unit in plan:
            values[unit.nodes[-1]] = await handlers[unit.kind](unit, _inputs(graph, unit, values))
        return values
    loop = asyncio.get_running_loop()
    done: dict[str, asyncio.Future[dict[str, Any]]] = {
        u.nodes[-1]: loop.create_future() for u in plan
    }

    async def run(unit: Unit) -> None:
        ready = {src: await done[src] for src in graph.predecessors(unit.nodes[0])}
        done[unit.nodes[-1]].set_result(
            await handlers[unit.kind](unit, _inputs(graph, unit, ready))
        )

    async with asyncio.TaskGroup() as group:
        for unit in first.values():
            group.create_task(run(unit))
    return {n: f.result() for n, f in done.items()}


def _inputs(graph: nx.DiGraph, unit: Unit, values: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        e["into"]: values[src][e["tensor"]]
        for src, _, e in graph.in_edges(unit.nodes[0], data=True)
    }
