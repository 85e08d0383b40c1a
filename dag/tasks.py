"""Typed tasks and the job graph they form (a networkx DiGraph).

A node is a task id with the `Task` under the "task" attribute; an edge carries one tensor
from the task that produces it (its output "tensor") to one that consumes it (as its input
"into", the same name unless renamed), "bytes" in size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import networkx as nx


class TaskKind(StrEnum):
    DATA_LOAD = "data_load"  # read a batch (client)
    EMBED = "embed"  # tokenizer + embedding (client)
    FORWARD = "forward"  # a stage's blocks, forward (provider)
    HEAD = "head"  # final norm + output head (client)
    LOSS = "loss"  # head + loss and its gradient (client)
    BACKWARD = "backward"  # a stage's blocks, backward (provider)
    UPDATE = "update"  # optimizer step of a stage's trainable adapters (provider)
    ALLREDUCE = "allreduce"  # average one stage's gradients across replicas


@dataclass(frozen=True)
class Task:
    id: str
    kind: TaskKind
    stage: int | None = None  # provider stage index; None for client tasks
    replica: int = 0
    flops: float = 0.0  # FLOPs the task performs
    mem_bytes: float = 0.0  # bytes it moves through device memory (weights, KV cache)
    inputs: dict[str, float] = field(default_factory=dict)  # tensor -> bytes
    outputs: dict[str, float] = field(default_factory=dict)  # tensor -> bytes
    microbatch: int = 0  # which microbatch of its batch or optimizer step it works on


def add_task(graph: nx.DiGraph, task: Task) -> Task:
    if task.id in graph:
        raise ValueError(f"task id {task.id!r} is used twice")
    graph.add_node(task.id, task=task)
    return task


def connect(
    graph: nx.DiGraph, src: Task, dst: Task, tensor: str, *, into: str | None = None
) -> None:
    """Add the edge carrying `src`'s output `tensor` to `dst`'s input `into` (default: same)."""
    if graph.has_edge(src.id, dst.id):
        raise ValueError(f"{src.id} -> {dst.id} already carries a tensor; one per edge")
    graph.add_edge(src.id, dst.id, tensor=tensor, into=into or tensor, bytes=src.outputs[tensor])


def task(graph: nx.DiGraph, task_id: str) -> Task:
    value: Task = graph.nodes[task_id]["task"]
    return value
