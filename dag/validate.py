"""Validation of job graphs: each failure is a `DagError` naming the tasks and tensors."""

from __future__ import annotations

import networkx as nx

from dag.tasks import Task


class DagError(ValueError):
    """The graph is not a valid job: a cycle, a missing or doubled input, or a size mismatch."""


def validate(graph: nx.DiGraph) -> None:
    """Acyclic; every declared input arrives on exactly one edge; edges carry only declared
    outputs into declared inputs; sizes agree at both ends."""
    for node, data in graph.nodes(data=True):
        if not isinstance(data.get("task"), Task):
            raise DagError(f"node {node!r} has no task")
        if data["task"].id != node:
            raise DagError(f"node {node!r} holds the task of {data['task'].id!r}")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        path = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
        raise DagError(f"the job has a cycle: {path}")
    for node in graph.nodes:
        consumer: Task = graph.nodes[node]["task"]
        arrivals: dict[str, list[str]] = {}
        for src, _, edge in graph.in_edges(node, data=True):
            producer: Task = graph.nodes[src]["task"]
            tensor, into, size = edge.get("tensor"), edge.get("into"), edge.get("bytes")
            if tensor not in producer.outputs:
                raise DagError(
                    f"edge {src} -> {node} carries {tensor!r}, which {src} does not produce"
                )
            if into not in consumer.inputs:
                raise DagError(
                    f"edge {src} -> {node} delivers {into!r}, which {node} does not take"
                )
            if not (producer.outputs[tensor] == size == consumer.inputs[into]):
                raise DagError(
                    f"edge {src} -> {node}: {tensor!r} is {producer.outputs[tensor]} bytes at "
                    f"{src}, {size} on the edge and {consumer.inputs[into]} at {node}"
                )
            arrivals.setdefault(into, []).append(src)
        for name in consumer.inputs:
            sources = arrivals.get(name, [])
            if not sources:
                raise DagError(f"task {node} needs {name!r} but no task produces it for {node}")
            if len(sources) > 1:
                raise DagError(f"task {node} gets {name!r} from several tasks: {sorted(sources)}")
