"""Placement: contiguous block ranges of a model on providers, maximizing throughput.

Pure: profiles and the model in, a `Placement` out. A stage's time per microbatch is its
blocks' compute plus its uplink's send time (`dag.cost.stage_time`); a pipeline's throughput is
bounded by its slowest stage. Memory bounds how many blocks a provider can hold (weights plus
KV cache, within `memory_fraction` of its memory).

- One pipeline: blocks go one at a time to the provider whose stage would then be fastest.
  Stage times `x + n*t` grow with `n`, so this greedy reaches the optimal bottleneck (the
  L-th smallest candidate time), checked against an exact MILP in the tests.
- Several replicas: for a target bottleneck T each provider can take k(T) blocks; providers
  are grouped into as many pipelines as can each cover the model ("largest first, then
  smallest to fill"), and T is searched to maximize replicas / T. Each group is then
  re-placed with the one-pipeline greedy. The best single pipeline over everyone is a
  candidate too, so the result is never worse than any single-pipeline split.
- Providers left over are spares; each stage gets the best spare that can hold it as its
  backup (it pre-loads that stage).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dag.cost import (
    HardwareProfile,
    Workload,
    blocks_that_fit,
    layer_memory,
    layer_time,
    send_time,
    stage_workspace,
)
from dag.model import ModelSpec


class PlacementError(ValueError):
    """The model cannot be placed on these providers; the message says why."""


STRATEGIES = ("ours", "even")


@dataclass(frozen=True)
class PlacementConfig:
    work: Workload = field(default_factory=Workload)
    memory_fraction: float = 0.9  # share of a provider's memory stages may use
    max_replicas: int | None = None  # None: as many as improve throughput
    backup_fraction: float = 0.1  # share of providers kept out of pipelines as backups, if possible
    search_points: int = 64  # target bottlenecks tried in the replica search
    strategy: str = "ours"  # "ours" (`place`) or "even" (`equal_split`: the baseline ours is
    # measured against, e.g. in the lab; one pipeline over every provider, no backups)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown placement {self.strategy!r}; use one of {list(STRATEGIES)}")


@dataclass(frozen=True)
class Stage:
    provider: str
    first: int  # first block
    end: int  # one past the last block
    time: float  # seconds per microbatch

    @property
    def layers(self) -> int:
        return self.end - self.first


@dataclass(frozen=True)
class Replica:
    stages: tuple[Stage, ...]

    @property
    def bottleneck(self) -> float:
        return max(s.time for s in self.stages)


@dataclass(frozen=True)
class Placement:
    replicas: tuple[Replica, ...]
    backups: dict[tuple[int, int], str]  # (replica, stage index) -> backup provider
    spares: tuple[str, ...]  # providers in no pipeline and backing up nothing
    tokens: int  # tokens per microbatch (for throughput)

    @property
    def throughput(self) -> float:
        """Tokens per second over all replicas."""
        return sum(self.tokens / r.bottleneck for r in self.replicas)

    def providers(self) -> set[str]:
        return {s.provider for r in self.replicas for s in r.stages}


@dataclass(frozen=True)
class _Costs:
    ids: list[str]
    t: np.ndarray  # seconds per block on each provider
    x: np.ndarray  # send seconds per microbatch
    cap: np.ndarray  # blocks each provider can hold


def provider_costs(
    model: ModelSpec, providers: Mapping[str, HardwareProfile], config: PlacementConfig
) -> _Costs:
    ids = list(providers)
    t = np.array([layer_time(model, providers[p], config.work) for p in ids], dtype=float)
    hidden = model.hidden_bytes_per_token * config.work.tokens
    x = np.array([send_time(hidden, providers[p]) for p in ids], dtype=float)
    cap = np.array(
        [blocks_that_fit(model, providers[p], config.work, config.memory_fraction) for p in ids],
        dtype=np.int64,
    )
    return _Costs(ids, t, x, cap)


def _one_pipeline(
    costs: _Costs, members: Sequence[int], n_layers: int
) -> list[tuple[int, int]] | None:
    """Optimal (provider index, blocks) for one pipeline over `members`; None if it can't fit."""
    heap = [(costs.x[i] + costs.t[i], i) for i in members if costs.cap[i] > 0]
    heapq.heapify(heap)
    count: dict[int, int] = {}
    for _ in range(n_layers):
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        count[i] = count.get(i, 0) + 1
        if count[i] < costs.cap[i]:
            heapq.heappush(heap, (costs.x[i] + (count[i] + 1) * costs.t[i], i))
    return sorted(count.items(), key=lambda item: (costs.t[item[0]], costs.ids[item[0]]))


def _replica(costs: _Costs, counts: list[tuple[int, int]]) -> Replica:
    stages, first = [], 0
    for i, n in counts:
        stages.append(Stage(costs.ids[i], first, first + n, float(costs.x[i] + n * costs.t[i])))
        first += n
    return Replica(tuple(stages))


def _cover(k: np.ndarray, n_layers: int) -> list[list[int]]:
    """Group providers (capacities k) into as many groups as reach `n_layers` each: the largest
    remaining first, then the smallest that complete it."""
    caps: list[int] = k.tolist()  # plain ints: indexing a small array is the slow part
    order = [i for i in np.argsort(-k, kind="stable").tolist() if caps[i] > 0]
    groups: list[list[int]] = []
    lo, hi = 0, len(order) - 1
    while lo <= hi:
        group, total = [order[lo]], caps[order[lo]]
        lo += 1
        while total < n_layers and lo <= hi:
            group.append(order[hi])
            total += caps[order[hi]]
            hi -= 1
        if total < n_layers:
            break
        groups.append(group)
    return groups


def _capacity(costs: _Costs, bottleneck: float) -> np.ndarray:
    fits = np.floor((bottleneck - costs.x) / costs.t + 1e-9)
    return np.minimum(costs.cap, np.maximum(fits, 0)).astype(np.int64)


def _shortfall(
    model: ModelSpec, providers: Mapping[str, HardwareProfile], config: PlacementConfig
) -> str:
    need = model.n_layers * layer_memory(model, config.work) + stage_workspace(model, config.work)
    have = sum(p.memory_bytes for p in providers.values()) * config.memory_fraction
    return (
        f"{model.name} needs {need / 1e9:.1f} GB for its {model.n_layers} blocks (weights and KV "
        f"cache for {config.work.kv_tokens} tokens) but the {len(providers)} providers offer "
        f"{have / 1e9:.1f} GB usable: short by {max(0.0, need - have) / 1e9:.1f} GB"
    )


MAX_ROUNDS = 12  # tiers of providers (by speed and uplink) that form replicas of their own


def _search_groups(
    costs: _Costs, members: list[int], n_layers: int, keep: int, limit: int | None, points_n: int
) -> list[list[int]]:
    """Groups of `members` that each hold the model, maximizing groups / common bottleneck,
    leaving at least `keep` members out. Empty if no group can be formed."""
    single = _one_pipeline(costs, members, n_layers)
    if single is None:
        return []
    idx = np.array(members)
    sub = _Costs([costs.ids[i] for i in members], costs.t[idx], costs.x[idx], costs.cap[idx])
    low = _replica(costs, single).bottleneck
    # A geometric grid, plus the bottlenecks at which providers are full (x + cap * t): where
    # grouping changes most, and exactly where identical machines each hold the whole model.
    full = (sub.x + sub.cap * sub.t)[sub.cap > 0]
    points = np.unique(
        np.concatenate(
            [np.geomspace(low, low * n_layers, points_n), np.quantile(full, np.linspace(0, 1, 17))]
        )
    )
    points = points[points >= low]
    best: list[list[int]] = []
    best_value = 0.0
    for refine in range(2):
        values = []
        for bottleneck in points:
            groups = _cover(_capacity(sub, float(bottleneck)), n_layers)
            if limit is not None:
                groups = groups[:limit]
            while groups and len(members) - sum(map(len, groups)) < keep:
                groups.pop()  # keep some providers out as backups
            value = len(groups) / float(bottleneck)
            values.append(value)
            # On a tie, prefer more replicas: shorter pipelines have fewer bubbles in
            # training, lower latency, and a failure stops less of the swarm.
            better = value > best_value * (1 + 1e-9)
            tie = value >= best_value * (1 - 1e-9) and len(groups) > len(best)
            if better or tie:
                best_value, best = value, [[members[i] for i in g] for g in groups]
        if refine == 0:
            j = int(np.argmax(values))
            points = np.linspace(
                points[max(0, j - 1)], points[min(len(points) - 1, j + 1)], points_n
            )
    return best


def place(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> Placement:
    """The best placement found; raises `PlacementError` saying why when nothing fits.

    Replicas are formed in rounds: the first round groups the providers that reach the best
    common bottleneck; later rounds form further replicas, at their own bottlenecks, from the
    providers left over (slower machines, thinner uplinks), as long as `backup_fraction` of
    the providers stays out as backups.
    """
    config = config or PlacementConfig()
    if not providers:
        raise PlacementError(f"no providers to place {model.name} on")
    costs = provider_costs(model, providers, config)
    everyone = list(range(len(costs.ids)))
    single = _one_pipeline(costs, everyone, model.n_layers)
    if single is None:
        raise PlacementError(_shortfall(model, providers, config))
    reserve = int(config.backup_fraction * len(everyone))
    groups: list[list[int]] = []
    remaining = everyone
    for _ in range(MAX_ROUNDS):
        limit = None if config.max_replicas is None else config.max_replicas - len(groups)
        if limit is not None and limit <= 0:
            break
        found = _search_groups(
            costs, remaining, model.n_layers, reserve, limit, config.search_points
        )
        if not found:
            break
        groups += found
        used = {i for g in found for i in g}
        remaining = [i for i in remaining if i not in used]
    replicas = []
    for group in groups:
        counts = _one_pipeline(costs, group, model.n_layers)
        if counts is not None:
            replicas.append(_replica(costs, counts))
    single_replica = _replica(costs, single)
    if sum(1 / r.bottleneck for r in replicas) < (1 - 1e-9) / single_replica.bottleneck:
        replicas = [single_replica]
    return _with_backups(tuple(replicas), costs, config.work.tokens)


def _with_backups(replicas: tuple[Replica, ...], costs: _Costs, tokens: int) -> Placement:
    used = {s.provider for r in replicas for s in r.stages}
    spares = [i for i, p in enumerate(costs.ids) if p not in used]
    backups: dict[tuple[int, int], str] = {}
    slots = sorted(
        ((r, s) for r, rep in enumerate(replicas) for s in range(len(rep.stages))),
        key=lambda rs: -replicas[rs[0]].stages[rs[1]].time,
    )
    for r, s in slots:
        stage = replicas[r].stages[s]
        fitting = [i for i in spares if costs.cap[i] >= stage.layers]
        if not fitting:
            continue
        chosen = min(fitting, key=lambda i: (costs.x[i] + stage.layers * costs.t[i], costs.ids[i]))
        backups[(r, s)] = costs.ids[chosen]
        spares.remove(chosen)
    return Placement(replicas, backups, tuple(costs.ids[i] for i in spares), tokens)


def placed(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> Placement:
    """The placement `config.strategy` chooses; raises `PlacementError` when nothing fits."""
    config = config or PlacementConfig()
    if config.strategy == "ours":
        return place(model, providers, config)
    split = equal_split(model, providers, config)
    if split is None:
        raise PlacementError(
            f"{model.name} does not fit an even split over {len(providers)} providers"
        )
    return split


# ---- baselines, for tests and benchmarks ----------------------------------------------------


def equal_split(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> Placement | None:
    """One pipeline over every provider in join order, blocks split evenly (None: won't fit)."""
    config = config or PlacementConfig()
    if not providers:
        raise PlacementError(f"no providers to place {model.name} on")
    costs = provider_costs(model, providers, config)
    n = min(len(costs.ids), model.n_layers)
    base, extra = divmod(model.n_layers, n)
    counts = [(i, base + (1 if i < extra else 0)) for i in range(n)]
    if any(c > costs.cap[i] for i, c in counts):
        return None
    return Placement((_replica(costs, counts),), {}, (), config.work.tokens)


def round_robin_throughput(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> float | None:
    """Block b on provider b mod N: every block is a hop. Tokens/s, or None if it won't fit."""
    config = config or PlacementConfig()
    costs = provider_costs(model, providers, config)
    n = len(costs.ids)
    counts = np.bincount(np.arange(model.n_layers) % n, minlength=n)
    if np.any(counts > costs.cap):
        return None
    busy = counts * (costs.t + costs.x)
    return config.work.tokens / float(busy.max())


def petals_spans(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
    existing: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, tuple[int, int]]:
    """A Petals-style baseline's block choice: providers not in `existing`, in join order,
    each serve as many consecutive blocks as fit in memory, starting where the blocks served
    so far are weakest (lowest total throughput). Spans overlap; requests route through any
    chain. Returns every provider's (first, end) block span, `existing` ones included; a
    provider that can hold no block gets none."""
    config = config or PlacementConfig()
    costs = provider_costs(model, providers, config)
    spans = dict(existing or {})
    per_block = _petals_per_block(costs, model.n_layers, config, spans)
    n = model.n_layers
    for i, peer in enumerate(costs.ids):
        span = int(costs.cap[i])
        if peer in spans or span <= 0:
            continue
        windows = [tuple(sorted(per_block[s : s + span])) for s in range(n - span + 1)]
        start = min(range(len(windows)), key=lambda s: windows[s])
        spans[peer] = (start, start + span)
        per_block[start : start + span] += config.work.tokens / (costs.x[i] + span * costs.t[i])
    return spans


def _petals_per_block(
    costs: _Costs, n_layers: int, config: PlacementConfig, spans: Mapping[str, tuple[int, int]]
) -> np.ndarray:
    """Tokens/s available for each block: each server's throughput over its span, summed."""
    per_block = np.zeros(n_layers)
    for i, peer in enumerate(costs.ids):
        if peer in spans:
            first, end = spans[peer]
            per_block[first:end] += config.work.tokens / (costs.x[i] + (end - first) * costs.t[i])
    return per_block


def petals_block_rates(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    spans: Mapping[str, tuple[int, int]],
    config: PlacementConfig | None = None,
) -> np.ndarray:
    """Tokens/s available for each block from the `providers` serving a span; the swarm's
    capacity is the weakest block's."""
    config = config or PlacementConfig()
    costs = provider_costs(model, providers, config)
    return _petals_per_block(costs, model.n_layers, config, spans)


def petals_greedy_throughput(
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> float | None:
    """The Petals-style baseline's capacity on these providers, all joining in order
    (`petals_spans`): tokens/s of its weakest block, or None if some block is served by
    nobody."""
    config = config or PlacementConfig()
    spans = petals_spans(model, providers, config)
    rates = petals_block_rates(model, providers, spans, config)
    return float(rates.min()) if rates.min() > 0 else None
