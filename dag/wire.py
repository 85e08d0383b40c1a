"""The versioned JSON form of a job graph, for the wire and for storage. No pickle."""

from __future__ import annotations

import msgspec
import networkx as nx

from dag.tasks import Task, TaskKind
from dag.validate import DagError, validate

FORMAT = "fusionai.dag"
VERSION = 1


class _Task(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    kind: TaskKind
    stage: int | None = None
    replica: int = 0
    flops: float = 0.0
    mem_bytes: float = 0.0
    inputs: dict[str, float] = {}
    outputs: dict[str, float] = {}


class _Edge(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    src: str
    dst: str
    tensor: str
    into: str
    bytes: float


class _Dag(msgspec.Struct, frozen=True):
    format: str
    version: int
    name: str
    kind: str
    tasks: list[_Task]
    edges: list[_Edge]


def to_json(graph: nx.DiGraph) -> bytes:
    tasks = [
        _Task(
            t.id, t.kind, t.stage, t.replica, t.flops, t.mem_bytes, dict(t.inputs), dict(t.outputs)
        )
        for t in (graph.nodes[n]["task"] for n in graph.nodes)
    ]
    edges = [_Edge(u, v, e["tensor"], e["into"], e["bytes"]) for u, v, e in graph.edges(data=True)]
    doc = _Dag(
        FORMAT, VERSION, graph.graph.get("name", ""), graph.graph.get("kind", ""), tasks, edges
    )
    return msgspec.json.encode(doc)


def from_json(data: bytes) -> nx.DiGraph:
    """Parse and validate; raises `DagError` with what is wrong."""
    try:
        doc = msgspec.json.decode(data, type=_Dag)
    except msgspec.DecodeError as exc:
        raise DagError(f"not a valid job graph: {exc}") from None
    if doc.format != FORMAT:
        raise DagError(f"not a job graph (format {doc.format!r})")
    if doc.version > VERSION:
        raise DagError(f"job graph version {doc.version} is newer than this FusionAI ({VERSION})")
    graph = nx.DiGraph(name=doc.name, kind=doc.kind)
    for t in doc.tasks:
        if t.id in graph:
            raise DagError(f"task id {t.id!r} appears twice")
        graph.add_node(
            t.id,
            task=Task(
                t.id,
                t.kind,
                t.stage,
                t.replica,
                t.flops,
                t.mem_bytes,
                dict(t.inputs),
                dict(t.outputs),
            ),
        )
    for e in doc.edges:
        for end in (e.src, e.dst):
            if end not in graph:
                raise DagError(f"edge {e.src} -> {e.dst} names unknown task {end!r}")
        if graph.has_edge(e.src, e.dst):
            raise DagError(f"edge {e.src} -> {e.dst} appears twice")
        graph.add_edge(e.src, e.dst, tensor=e.tensor, into=e.into, bytes=e.bytes)
    validate(graph)
    return graph
