"""The simulation's side of the broker's decision core: events in, actions carried out.

`tell` hands an event to the core (`sim.driver.Driver`) and carries out what it decides, and
what that leads to, in order: an assignment becomes a load that ends, after the provider's
download and load time, in a `StageReported`; a promotion ends after `failover_s` in an
`AssignAnswered`; a started job waits for a serving replica. `refresh` then follows the core's
placement and marks replicas serving once the core has every one of their stages confirmed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from broker.core.actions import (
    Action,
    AssignStage,
    Notice,
    PromoteBackup,
    PromoteStage,
    ProviderLost,
    Replan,
    StartJob,
    UnassignStage,
)
from broker.core.events import AssignAnswered, Input, StageReported
from sim.work import ReplicaRun

if TYPE_CHECKING:
    from sim.swarm import SwarmSim


def tell(sim: SwarmSim, event: Input) -> None:
    """Hand `event` to the core and carry out what it decides, and what that leads to."""
    sim._inbox.append(event)
    if sim._handling:
        return
    sim._handling = True
    try:
        while sim._inbox:
            next_event = sim._inbox.popleft()
            carry(sim, next_event, sim.driver.handle(next_event))
        refresh(sim)
    finally:
        sim._handling = False


def carry(sim: SwarmSim, event: Input, actions: list[Action]) -> None:
    now = sim.engine.now
    loads: dict[str, list[str]] = {}
    core = sim.driver.core
    for a in actions:
        if isinstance(a, AssignStage):
            if (a.peer_id, a.key) in sim.loading:
                continue  # already on its way (now for another role)
            if a.key in core.confirmed.get(a.peer_id, {}):  # loaded: a new role only
                sim.engine.at(now, loaded, sim, a.peer_id, [a.key], None)
            else:
                loads.setdefault(a.peer_id, []).append(a.key)
        elif isinstance(a, PromoteStage):
            token = sim.session.get(a.peer_id, 0)
            sim.engine.at(now + sim.s.failover_s, promoted, sim, a.peer_id, a.key, token)
        elif isinstance(a, UnassignStage):
            sim.loading.pop((a.peer_id, a.key), None)
        elif isinstance(a, StartJob):
            sim.waiting.append(sim.jobs[a.job])
            sim._queue_job()
        elif isinstance(a, PromoteBackup | Replan):
            sim.replans += 1
        elif isinstance(a, Notice):
            notice(sim, a, now)
    for peer, keys in loads.items():
        token = sim.next_token
        sim.next_token += 1
        for key in keys:
            sim.loading[(peer, key)] = token
        at = now + sim._load_seconds(peer, len(keys))
        sim.engine.at(at, loaded, sim, peer, keys, token)
    lost = [a for a in actions if isinstance(a, ProviderLost)]
    if lost:
        names = [type(a).__name__ for a in actions]
        repaired = {
            a.data["lost"]: a.data
            for a in actions
            if isinstance(a, Notice) and a.kind == "model_repaired"
        }
        for a in lost:
            sim.log.append(
                {
                    "t": now,
                    "event": "replan",
                    "peer": a.peer_id,
                    "crash": not a.graceful,
                    "pool_actions": names,
                    "moves": [tuple(m) for m in repaired.get(a.peer_id, {}).get("moves", [])],
                }
            )


def notice(sim: SwarmSim, notice: Notice, now: float) -> None:
    data = notice.data
    if notice.kind in ("model_placed", "model_rebalanced"):
        sim.rebalances += notice.kind == "model_rebalanced"
        event = "placed" if notice.kind == "model_placed" else "rebalance"
        replicas, throughput = len(data["replicas"]), data["throughput_tokens_s"]
        sim.log.append({"t": now, "event": event, "replicas": replicas, "throughput": throughput})
    elif notice.kind == "model_waiting":
        sim.log.append({"t": now, "event": "unplaceable", "reason": data["reason"]})


def loaded(sim: SwarmSim, peer: str, keys: list[str], token: int | None) -> None:
    """`peer` finished loading `keys` (token None: it had them loaded already)."""
    if peer not in sim.online:
        return
    now = sim.engine.now
    sent = sim.driver.core.sent.get(peer, {})
    by_role: dict[str, list[str]] = {}
    for key in keys:
        if token is not None:
            if sim.loading.get((peer, key)) != token:
                continue  # withdrawn, or loaded again since
            del sim.loading[(peer, key)]
        if key in sent:
            by_role.setdefault(sent[key], []).append(key)
    for role, loaded in sorted(by_role.items()):
        sim._touched.add(peer)
        tell(sim, StageReported(peer, tuple(loaded), role, True, now))


def promoted(sim: SwarmSim, peer: str, key: str, token: int) -> None:
    if peer in sim.online and sim.session.get(peer) == token:
        sim._touched.add(peer)
        tell(sim, AssignAnswered(peer, key, "promote", True, sim.engine.now))


def refresh(sim: SwarmSim) -> None:
    """Follow the core's placement; replicas whose stages are all confirmed serve."""
    plan = sim.driver.core.plans.get(sim.model.name)
    placement = plan.placement if plan is not None else None
    now = sim.engine.now
    if placement is not sim.placement:
        sim._set_placement(placement, now, None)
    touched, sim._touched = sim._touched, set()
    for peer in sorted(touched):
        for run in sim.runs_of.get(peer, []):
            if math.isinf(run.ready_at) and confirmed(sim, run):
                sim._ready(run, now)
    for run in sim.runs if sim.waiting else ():  # jobs the core started meanwhile
        if run.job is None and run.ready_at <= now:
            sim._dispatch(run, now)


def confirmed(sim: SwarmSim, run: ReplicaRun) -> bool:
    confirmed = sim.driver.core.confirmed
    for peer, first, end in run.layout:
        if peer not in sim.online:
            return False
        mine = confirmed.get(peer, {})
        if any(mine.get(sim.keys[pos]) != "active" for pos in range(first, end)):
            return False
    return True
