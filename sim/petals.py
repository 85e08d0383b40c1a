"""The Petals-style baseline the simulator compares against: no broker placement.

Servers pick their own spans (`broker.core.placement.petals_spans`) and requests route through
any chain of them, so the swarm serves at its weakest block's rate. No broker re-plans;
servers check every PETALS_BALANCE_CHECK_S whether one of them moving would raise the swarm's
throughput enough, and a block nobody serves halts everything until then. Optimistic for the
baseline: a quit costs no in-flight work (the replay is free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.core.placement import PlacementConfig, petals_block_rates, petals_spans
from dag.cost import pipeline_metrics
from sim.work import ReplicaRun

if TYPE_CHECKING:
    from sim.swarm import SwarmSim

PETALS_BALANCE_CHECK_S = 120.0  # Petals servers' mean balance check period (its default)
PETALS_BALANCE_QUALITY = 0.75  # a server moves if that raises swarm throughput by > 1/0.75


def start(sim: SwarmSim, now: float) -> None:
    for peer, span in petals_spans(sim.model, sim._online_profiles(), sim.config).items():
        load(sim, peer, span, now, startup=True)
    sim.runs = [ReplicaRun(sim.next_replica, now, 0.0, 0.0, 0.0, last=now)]
    sim.next_replica += 1
    refresh(sim)
    sim.engine.at(now + PETALS_BALANCE_CHECK_S, balance, sim)


def load(
    sim: SwarmSim, peer: str, span: tuple[int, int], now: float, startup: bool = False
) -> None:
    ready = now + sim._load_seconds(peer, span[1] - span[0])
    if startup:
        sim.startup = max(sim.startup, ready - now)
    sim.spans[peer] = span
    sim.span_ready[peer] = ready
    sim.engine.at(ready, refresh, sim)


def _chain(sim: SwarmSim, ready: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
    """A route through the model: from each block, the server that reaches furthest."""
    chain, block = [], 0
    while block < sim.model.n_layers:
        holders = [(end, p) for p, (first, end) in ready.items() if first <= block < end]
        if not holders:
            return []
        end, peer = max(holders)
        chain.append((peer, end - block))
        block = end
    return chain


def refresh(sim: SwarmSim) -> None:
    """Recompute the swarm's rate from the servers whose spans are loaded."""
    now = sim.engine.now
    sim._advance(now)
    if not sim.runs:
        return
    ready = {p: s for p, s in sim.spans.items() if sim.span_ready[p] <= now}
    profiles = {p: sim.profiles[p] for p in ready}
    chain = _chain(sim, ready)
    run = sim.runs[0]
    old = run.rate
    if not chain:
        run.rate = run.latency = run.ttft = 0.0
    else:
        decode = petals_block_rates(sim.model, profiles, ready, sim.config)
        prefill_config = PlacementConfig(work=sim.w.prefill_work)
        prefill = petals_block_rates(sim.model, profiles, ready, prefill_config)
        # Each block serves a job's prefill and its decode steps with the same servers.
        per_block = sim.w.job_tokens / decode + sim.w.prefill_work.tokens / prefill
        run.rate = sim.w.job_tokens / float(per_block.max())
        stages = [(sim.profiles[p], n) for p, n in chain]
        run.latency = pipeline_metrics(sim.model, stages, sim.w.work).latency
        run.ttft = pipeline_metrics(sim.model, stages, sim.w.prefill_work).latency + run.latency
    if run.rate == 0.0 and sim._idle_since is None and now >= sim.startup:
        sim._idle_since = now
    elif run.rate > 0.0 and sim._idle_since is not None:
        sim.downtime += now - sim._idle_since
        sim._idle_since = None
    if run.rate != old or run.job is None:
        sim._dispatch(run, now)


def balance(sim: SwarmSim) -> None:
    """Petals' rebalancing: the one server whose move helps most moves, if it helps
    by more than 1 / PETALS_BALANCE_QUALITY (or anything, while some block is unserved)."""
    now = sim.engine.now
    profiles = sim._online_profiles()
    if sim.spans:
        current = float(petals_block_rates(sim.model, profiles, sim.spans, sim.config).min())
        best: tuple[float, str, tuple[int, int]] | None = None
        for peer in sorted(sim.spans):
            others = {p: s for p, s in sim.spans.items() if p != peer}
            moved = petals_spans(sim.model, profiles, sim.config, existing=others)
            if moved.get(peer, sim.spans[peer]) == sim.spans[peer]:
                continue
            after = float(petals_block_rates(sim.model, profiles, moved, sim.config).min())
            if best is None or after > best[0]:
                best = (after, peer, moved[peer])
        if best is not None and best[0] > current / PETALS_BALANCE_QUALITY:
            sim.rebalances += 1
            sim.log.append({"t": now, "event": "rebalance", "peer": best[1], "span": list(best[2])})
            load(sim, best[1], best[2], now)
            refresh(sim)
    sim.engine.at(now + PETALS_BALANCE_CHECK_S, balance, sim)


def join(sim: SwarmSim, peer: str, now: float) -> None:
    """A server joining picks its blocks where the swarm is weakest."""
    spans = petals_spans(sim.model, sim._online_profiles(), sim.config, existing=sim.spans)
    if peer in spans:
        load(sim, peer, spans[peer], now)
