"""Re-planning when providers come and go: move as little as possible.

When a provider leaves, only its blocks move: to its stage's backup or a spare that can hold
them (the backup first, then spares by their stage time, reordered by `rank`: the planner puts
warm and steady providers first, `broker.core.pool.promotion_order`), else to its neighbours
in the same pipeline if they have memory; only when none of that works is the replica
dissolved (its providers become spares).
Healthy stages are never reshuffled here. A full re-placement is a separate decision, taken
when it would pay: `should_rebalance` (as Petals does, at a bottleneck gain of about 1/0.75).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from broker.core.placement import Placement, PlacementConfig, Replica, Stage
from dag.cost import HardwareProfile, blocks_that_fit, layer_time, send_time
from dag.model import ModelSpec

REBALANCE_THRESHOLD = 0.75  # rebalance when current throughput < this x the candidate's


@dataclass(frozen=True)
class Move:
    replica: int
    first: int
    end: int
    source: str  # the provider that held the blocks
    target: str  # the provider that holds them now


@dataclass(frozen=True)
class Repair:
    placement: Placement
    moves: tuple[Move, ...]
    dissolved: int  # replicas that could not be repaired


class _Cost:
    def __init__(
        self, model: ModelSpec, providers: Mapping[str, HardwareProfile], config: PlacementConfig
    ) -> None:
        self.model, self.providers, self.config = model, providers, config
        self.hidden = model.hidden_bytes_per_token * config.work.tokens

    def cap(self, peer: str) -> int:
        return blocks_that_fit(
            self.model, self.providers[peer], self.config.work, self.config.memory_fraction
        )

    def stage(self, peer: str, first: int, end: int) -> Stage:
        p = self.providers[peer]
        time = (end - first) * layer_time(self.model, p, self.config.work) + send_time(
            self.hidden, p
        )
        return Stage(peer, first, end, time)


def _fitting(cost: _Cost, spares: list[str], layers: int) -> list[str]:
    """Spares that can hold `layers` blocks, fastest stage first."""
    fitting = [p for p in spares if p in cost.providers and cost.cap(p) >= layers]
    return sorted(fitting, key=lambda p: (cost.stage(p, 0, layers).time, p))


def _best_spare(cost: _Cost, spares: list[str], layers: int) -> str | None:
    fitting = [p for p in spares if p in cost.providers and cost.cap(p) >= layers]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (cost.stage(p, 0, layers).time, p))


def on_leave(
    placement: Placement,
    gone: str,
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
    rank: Callable[[int, int, list[str]], list[str]] | None = None,
) -> Repair:
    """The placement after `gone` left; `providers` are the profiles of those still here.
    `rank(first, end, candidates)` may reorder who takes over blocks first..end (the
    candidates come in the default order: the stage's backup, then spares by stage time)."""
    cost = _Cost(model, providers, config or PlacementConfig())
    replicas = list(placement.replicas)
    # Only providers still here can take over (a backup may have vanished unnoticed so far).
    backups = {k: v for k, v in placement.backups.items() if v != gone and v in providers}
    spares = [p for p in placement.spares if p != gone and p in providers]
    moves: list[Move] = []
    dissolved = 0
    where = next(
        (
            (r, s)
            for r, rep in enumerate(replicas)
            for s, st in enumerate(rep.stages)
            if st.provider == gone
        ),
        None,
    )
    if where is not None:
        r, s = where
        old = replicas[r].stages[s]
        backup = backups.pop((r, s), None)
        if backup is not None and cost.cap(backup) < old.layers:
            spares.append(backup)  # too small for this stage now: back to the spares
            backup = None
        if rank is None:  # the stage's backup, else the best spare
            target = backup or _best_spare(cost, spares, old.layers)
        else:
            ahead = [backup] if backup is not None else []
            ranked = rank(old.first, old.end, ahead + _fitting(cost, spares, old.layers))
            target = ranked[0] if ranked else None
        if backup is not None and target != backup:
            spares.append(backup)  # passed over: it stands by for whatever needs it next
        if target is not None:
            if target in spares:
                spares.remove(target)
            stages = list(replicas[r].stages)
            stages[s] = cost.stage(target, old.first, old.end)
            replicas[r] = Replica(tuple(stages))
            moves.append(Move(r, old.first, old.end, gone, target))
        else:
            merged = _merge_into_neighbours(cost, replicas[r], s)
            if merged is not None:
                replicas[r], extra = merged
                moves += [replace(m, replica=r) for m in extra]
                # Replica r lost stage s: later stages' backups move down one index, and a
                # backup whose stage grew beyond its memory goes back to the spares.
                shifted = {}
                for (rr, ss), v in backups.items():
                    if rr == r and ss == s:
                        continue
                    key = (rr, ss - (rr == r and ss > s))
                    if rr == r and cost.cap(v) < replicas[r].stages[key[1]].layers:
                        spares.append(v)
                        continue
                    shifted[key] = v
                backups = shifted
            else:
                dissolved = 1
                for st in replicas[r].stages:
                    if st.provider != gone:
                        spares.append(st.provider)
                spares += [v for (rr, _), v in backups.items() if rr == r]
                replicas.pop(r)
                backups = {(rr - (rr > r), ss): v for (rr, ss), v in backups.items() if rr != r}
    # Stages without a backup get one from the spares (pre-loading moves no served blocks).
    for rr, rep in enumerate(replicas):
        for ss, st in enumerate(rep.stages):
            if (rr, ss) not in backups:
                spare = _best_spare(cost, spares, st.layers)
                if spare is not None:
                    backups[(rr, ss)] = spare
                    spares.remove(spare)
    new = Placement(tuple(replicas), backups, tuple(spares), placement.tokens)
    return Repair(new, tuple(moves), dissolved)


def _merge_into_neighbours(
    cost: _Cost, replica: Replica, s: int
) -> tuple[Replica, list[Move]] | None:
    """Give stage `s`'s blocks to the stages before and after it, within their memory."""
    stages = list(replica.stages)
    old = stages[s]
    before = stages[s - 1] if s > 0 else None
    after = stages[s + 1] if s + 1 < len(stages) else None
    # A neighbour that has itself vanished (not yet noticed) takes nothing.
    if before is not None and before.provider not in cost.providers:
        before = None
    if after is not None and after.provider not in cost.providers:
        after = None
    room_before = cost.cap(before.provider) - before.layers if before else 0
    room_after = cost.cap(after.provider) - after.layers if after else 0
    if room_before + room_after < old.layers:
        return None
    to_before = min(room_before, old.layers)
    if before is not None and after is not None:  # split in proportion to speed
        t_b = layer_time(cost.model, cost.providers[before.provider], cost.config.work)
        t_a = layer_time(cost.model, cost.providers[after.provider], cost.config.work)
        share = round(old.layers * t_a / (t_a + t_b))
        to_before = max(old.layers - room_after, min(room_before, share))
    to_after = old.layers - to_before
    moves: list[Move] = []
    new_stages = stages[:s] + stages[s + 1 :]
    if before is not None and to_before:
        new_stages[s - 1] = cost.stage(before.provider, before.first, before.end + to_before)
        moves.append(Move(0, old.first, old.first + to_before, old.provider, before.provider))
    if after is not None and to_after:
        # With stage s removed, the stage after it now sits at index s.
        new_stages[s] = cost.stage(after.provider, after.first - to_after, after.end)
        moves.append(Move(0, old.end - to_after, old.end, old.provider, after.provider))
    return Replica(tuple(new_stages)), moves


def on_join(
    placement: Placement,
    peer: str,
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> Placement:
    """A new provider becomes a backup for a stage that has none, else a spare."""
    cost = _Cost(model, providers, config or PlacementConfig())
    if (
        peer in placement.providers()
        or peer in placement.backups.values()
        or peer in placement.spares
    ):
        return placement  # already placed (a restart the broker has not noticed as a loss)
    backups = dict(placement.backups)
    for r, rep in enumerate(placement.replicas):
        for s, st in enumerate(rep.stages):
            if (r, s) not in backups and cost.cap(peer) >= st.layers:
                backups[(r, s)] = peer
                return replace(placement, backups=backups)
    return replace(placement, spares=(*placement.spares, peer))


def rescored(
    placement: Placement,
    model: ModelSpec,
    providers: Mapping[str, HardwareProfile],
    config: PlacementConfig | None = None,
) -> Placement:
    """`placement` with its stage times worked out again from `providers`' profiles as they
    are now (corrected by observed times), so it can be compared with a fresh placement made
    from the same profiles. A stage whose provider is not among them keeps its old time."""
    cost = _Cost(model, providers, config or PlacementConfig())
    replicas = tuple(
        Replica(
            tuple(
                cost.stage(st.provider, st.first, st.end) if st.provider in providers else st
                for st in rep.stages
            )
        )
        for rep in placement.replicas
    )
    return replace(placement, replicas=replicas)


def should_rebalance(
    current: Placement, candidate: Placement, threshold: float = REBALANCE_THRESHOLD
) -> bool:
    """Re-place from scratch only if that raises throughput by more than 1 / threshold."""
    return current.throughput < threshold * candidate.throughput
