"""The cost model: hardware profiles to task, transfer and pipeline times (roofline).

A task takes max(FLOPs / FLOP/s, bytes moved / memory bandwidth): compute-bound prefill and
training, memory-bound decoding. A transfer between two machines takes the one-way latency plus
bytes over the sender's upload bandwidth (home uplinks are far slower than downlinks, so the
sender's link bounds a hop), plus the software's time at each end (`call_s` and
`wire_s_per_byte`: framing, encryption, encoding). A task or a stage's run also pays one
executor call's fixed time (`stage_call_s`). `fusionai sim calibrate` measures these three,
and they are 0 unless given. In a pipeline with microbatches in flight, latency overlaps with
other work but a link's busy time does not: a stage's time per microbatch (what bounds
throughput) is its compute plus its send time; latency counts towards per-token latency only.
Observed times correct a profile through a per-machine factor.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from dag.model import ModelSpec
from dag.tasks import Task


@dataclass(frozen=True)
class HardwareProfile:
    """What a machine can do, measured (providers) or from a catalog (simulation)."""

    name: str
    flops: Mapping[str, float]  # dense FLOP/s per dtype ("float16", "bfloat16", "float32")
    memory_bytes: float  # device memory usable for stages; bytes
    mem_bandwidth: float  # device memory bandwidth; bytes/s
    net_bandwidth: float  # upload bandwidth; bytes/s
    rtt: float = 0.02  # round trip to the broker; seconds
    slowdown: float = 1.0  # correction from observed stage times (1 = as profiled)
    call_s: float = 0.0  # software time this machine spends on each hop it sends or receives
    wire_s_per_byte: float = 0.0  # and per byte of it (encode, encrypt, copy); seconds
    stage_call_s: float = 0.0  # fixed time of one executor call (a stage's run), beyond compute

    def flops_for(self, dtype: str) -> float:
        for name in (dtype, "float16", "bfloat16", "float32"):
            value = self.flops.get(name)
            if value:
                return value
        raise ValueError(f"profile {self.name} has no FLOP/s figure")


@dataclass(frozen=True)
class Correction:
    """Running ratio of observed to predicted stage times of one machine."""

    factor: float = 1.0
    samples: int = 0
    weight: float = 0.3  # weight of each new observation (exponential moving average)

    def observe(self, predicted: float, observed: float) -> Correction:
        if predicted <= 0 or observed <= 0:
            return self
        ratio = min(10.0, max(0.1, observed / predicted))
        factor = (
            ratio if self.samples == 0 else (1 - self.weight) * self.factor + self.weight * ratio
        )
        return replace(self, factor=factor, samples=self.samples + 1)

    def apply(self, profile: HardwareProfile) -> HardwareProfile:
        return replace(profile, slowdown=self.factor)


def compute_time(
    flops: float, mem_bytes: float, profile: HardwareProfile, dtype: str = "float16"
) -> float:
    """Roofline time of work of `flops` FLOPs touching `mem_bytes` bytes."""
    return profile.slowdown * max(
        flops / profile.flops_for(dtype), mem_bytes / profile.mem_bandwidth
    )


def task_time(task: Task, profile: HardwareProfile, dtype: str = "float16") -> float:
    """One task: one executor call."""
    return profile.stage_call_s + compute_time(task.flops, task.mem_bytes, profile, dtype)


def latency(src: HardwareProfile | None, dst: HardwareProfile | None) -> float:
    """One-way latency between two machines, each `rtt` away from the network's middle."""
    return sum(p.rtt for p in (src, dst) if p is not None) / 4


def end_time(nbytes: float, profile: HardwareProfile | None) -> float:
    """The software's time at one end of a hop of `nbytes` (0 for the client: `transfer_time`
    counts its end as its peer's)."""
    if profile is None or nbytes <= 0:
        return 0.0
    return profile.call_s + nbytes * profile.wire_s_per_byte


def send_time(nbytes: float, src: HardwareProfile | None) -> float:
    """Time `src` is busy sending `nbytes`: its uplink, and its end of the hop (the client's
    link is not modelled)."""
    if src is None or nbytes <= 0:
        return 0.0
    return nbytes / src.net_bandwidth + end_time(nbytes, src)


def transfer_time(nbytes: float, src: HardwareProfile | None, dst: HardwareProfile | None) -> float:
    """Time to send `nbytes` from `src` to `dst`, two different machines (None: the client,
    whose link is not the bottleneck and whose software costs as its peer's). Callers skip
    transfers within one machine."""
    if nbytes <= 0:
        return 0.0
    bandwidth = (
        src.net_bandwidth if src is not None else (dst.net_bandwidth if dst is not None else 0)
    )
    ends = end_time(nbytes, src or dst) + end_time(nbytes, dst or src)
    return latency(src, dst) + (nbytes / bandwidth if bandwidth else 0.0) + ends


def critical_path(
    graph: nx.DiGraph,
    where: Callable[[Task], Hashable | None],
    profiles: Mapping[Any, HardwareProfile],
    dtype: str = "float16",
) -> tuple[float, list[str]]:
    """Longest path through the job: task times on the machines `where` puts them (None: the
    client, whose compute is not modelled), plus transfers between different machines."""
    best: dict[str, tuple[float, str | None]] = {}
    for node in nx.topological_sort(graph):
        task: Task = graph.nodes[node]["task"]
        machine = where(task)
        profile = profiles.get(machine) if machine is not None else None
        start = 0.0
        parent = None
        for src, _, edge in graph.in_edges(node, data=True):
            src_machine = where(graph.nodes[src]["task"])
            src_profile = profiles.get(src_machine) if src_machine is not None else None
            same = src_machine == machine
            arrive = best[src][0] + (
                0.0 if same else transfer_time(edge["bytes"], src_profile, profile)
            )
            if arrive > start or parent is None:
                start, parent = max(start, arrive), src if arrive >= start else parent
        own = task_time(task, profile, dtype) if profile is not None else 0.0
        best[node] = (start + own, parent)
    if not best:
        return 0.0, []
    end = max(best, key=lambda n: best[n][0])
    path = [end]
    while (parent := best[path[-1]][1]) is not None:
        path.append(parent)
    return best[end][0], path[::-1]


@dataclass(frozen=True)
class Workload:
    """What one pipeline processes per microbatch."""

    tokens: int = 1  # tokens per microbatch through each stage (decode: batch x 1)
    sequences: int = 1  # sequences in the microbatch (whose KV caches are read)
    context: int = 512  # context length attended to; tokens
    dtype: str = "float16"
    kv_tokens: int = 2048  # tokens of KV cache a stage must hold per block (batch x max length)


def layer_time(model: ModelSpec, profile: HardwareProfile, work: Workload) -> float:
    """One block on one microbatch."""
    flops = work.tokens * (
        model.layer_flops_per_token + model.layer_attn_flops_per_token_per_context * work.context
    )
    moved = model.layer_param_bytes + work.sequences * work.context * model.layer_kv_bytes_per_token
    return compute_time(flops, moved, profile, work.dtype)


def layer_memory(model: ModelSpec, work: Workload) -> float:
    """Device memory one block needs: weights plus its KV cache."""
    return model.layer_param_bytes + work.kv_tokens * model.layer_kv_bytes_per_token


ACTIVATION_BUFFERS = 8  # hidden-state-sized buffers a stage keeps per microbatch (in, out, scratch)


def stage_workspace(model: ModelSpec, work: Workload) -> float:
    """Device memory a stage needs for activations, whatever its number of blocks."""
    return ACTIVATION_BUFFERS * model.hidden_bytes_per_token * work.tokens


def blocks_that_fit(
    model: ModelSpec, profile: HardwareProfile, work: Workload, fraction: float
) -> int:
    """How many blocks fit in `fraction` of `profile`'s memory, after the activation workspace."""
    room = profile.memory_bytes * fraction - stage_workspace(model, work)
    return max(0, min(model.n_layers, int(room // layer_memory(model, work))))


def stage_time(model: ModelSpec, profile: HardwareProfile, layers: int, work: Workload) -> float:
    """A stage's busy time per microbatch: receiving hidden states, its blocks, then sending
    them on."""
    if layers <= 0:
        return 0.0
    hidden = model.hidden_bytes_per_token * work.tokens
    send = send_time(hidden, profile)
    run = profile.stage_call_s + layers * layer_time(model, profile, work)
    return end_time(hidden, profile) + run + send


@dataclass(frozen=True)
class PipelineMetrics:
    bottleneck: float  # seconds per microbatch of the slowest stage
    throughput: float  # tokens per second
    latency: float  # seconds for one microbatch through every stage
    stage_times: list[float] = field(default_factory=list)


def pipeline_metrics(
    model: ModelSpec,
    stages: Sequence[tuple[HardwareProfile, int]],
    work: Workload,
    *,
    star: bool = False,
) -> PipelineMetrics:
    """Throughput and latency of one pipeline of (machine, number of blocks) stages. The
    hidden states go client -> stage 1 -> ... -> stage n -> client (chained: n + 1 legs), or
    with `star` from the client to each stage and back (2n legs)."""
    hidden = model.hidden_bytes_per_token * work.tokens
    times = [stage_time(model, profile, layers, work) for profile, layers in stages]
    path = 0.0
    previous: HardwareProfile | None = None  # the client sends the first hop
    for profile, layers in stages:
        run = profile.stage_call_s + layers * layer_time(model, profile, work)
        path += transfer_time(hidden, previous, profile) + run
        previous = None if star else profile  # (star: back to the client after each stage)
        if star:
            path += transfer_time(hidden, profile, None)
    if not star:
        path += transfer_time(hidden, previous, None)
    bottleneck = max(times) if times else float("inf")
    return PipelineMetrics(
        bottleneck=bottleneck,
        throughput=work.tokens / bottleneck if bottleneck > 0 else 0.0,
        latency=path,
        stage_times=times,
    )


def schedule_length(
    graph: nx.DiGraph,
    where: Callable[[Task], Hashable | None],
    profiles: Mapping[Any, HardwareProfile],
    dtype: str = "float16",
) -> float:
    """Makespan of the job when each machine runs one task at a time and its uplink sends one
    transfer at a time (list scheduling: the task ready first starts first). A transfer holds
    the sender's uplink for bytes / bandwidth, then arrives after the latency; client tasks
    (machine None) take no time and never wait. Unlike `critical_path`, this sees a pipeline's
    bubbles and a stage's forward and backward work competing for one GPU and one link."""
    import heapq

    remaining = {n: graph.in_degree(n) for n in graph.nodes}
    ready_at: dict[str, float] = dict.fromkeys(graph.nodes, 0.0)
    finish: dict[str, float] = {}
    free: dict[Hashable, float] = {}
    uplink_free: dict[Hashable, float] = {}
    heap = [(0.0, n) for n, d in remaining.items() if d == 0]
    heapq.heapify(heap)
    while heap:
        ready, node = heapq.heappop(heap)
        task: Task = graph.nodes[node]["task"]
        machine = where(task)
        if machine is None:
            end = ready
        else:
            start = max(ready, free.get(machine, 0.0))
            end = start + task_time(task, profiles[machine], dtype)
            free[machine] = end
        finish[node] = end
        for _, succ, edge in graph.out_edges(node, data=True):
            dst = where(graph.nodes[succ]["task"])
            arrive = end
            if dst != machine:
                src_profile = profiles[machine] if machine is not None else None
                dst_profile = profiles[dst] if dst is not None else None
                sending = send_time(edge["bytes"], src_profile)
                begin = max(end, uplink_free.get(machine, 0.0)) if machine is not None else end
                if machine is not None:
                    uplink_free[machine] = begin + sending
                arrive = begin + sending + latency(src_profile, dst_profile)
                if machine is None and dst_profile is not None:  # the client's link: not modelled
                    arrive = end + transfer_time(edge["bytes"], None, dst_profile)
            ready_at[succ] = max(ready_at[succ], arrive)
            remaining[succ] -= 1
            if remaining[succ] == 0:
                heapq.heappush(heap, (ready_at[succ], succ))
    return max(finish.values(), default=0.0)
