"""The versioned JSON form of a job graph, for the wire and for storage. No pickle.

Version 2 adds each task's `microbatch`. A version-1 graph (stored by an earlier broker) has
none; its fine-tune tasks carried the microbatch in their ids ("mb3.fwd.s0", "r1.mb3.loss"),
which is read once here, on decoding, and nowhere else.
"""

from __future__ import annotations

import re

import msgspec
import networkx as nx

from dag.tasks import Task, TaskKind
from dag.validate import DagError, validate

FORMAT = "fusionai.dag"
VERSION = 2
_V1_MICROBATCH = re.compile(r"(?:^|\.)mb(\d+)\.")


class _Task(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    kind: TaskKind
    stage: int | None = None
    replica: int = 0
    flops: float = 0.0
    mem_bytes: float = 0.0
    inputs: dict[str, float] = {}
    outputs: dict[str, float] = {}
    microbatch: int | None = None  # absent in version 1


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
            t.id,
            t.kind,
            t.stage,
            t.replica,
            t.flops,
            t.mem_bytes,
            dict(t.inputs),
            dict(t.outputs),
            t.microbatch,
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
                _microbatch(t, doc.version),
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


def _microbatch(t: _Task, version: int) -> int:
    if t.microbatch is not None:
        if t.microbatch < 0:
            raise DagError(f"task {t.id!r}: negative microbatch {t.microbatch}")
        return t.microbatch
    if version >= 2:
        raise DagError(f"task {t.id!r} has no microbatch")
    found = _V1_MICROBATCH.search(t.id)
    return int(found.group(1)) if found else 0
