"""A model's plan: its placement (who serves and who backs up which blocks) and what the
planner knows about it; placements to and from their JSON form (persisted, and carried by
`ModelAdded` after a restart)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from broker.core.placement import Placement, Replica, Stage
from dag.model import ModelSpec


class Want(NamedTuple):
    """What a provider should hold of one model: blocks first..end in `role`."""

    stage: str  # the range key (`range_key`)
    role: str  # "active" or "backup"
    first: int
    end: int


@dataclass
class Plan:
    name: str
    spec: ModelSpec
    keys: tuple[str, ...]  # unit keys of its provider stages, in pipeline order
    placement: Placement | None = None
    restored_until: float | None = None  # after a restart: members have until then to re-join
    cannot: dict[str, str] = field(default_factory=dict)  # peer -> why it cannot host this model
    waiting_reason: str = ""  # why the model is not placed yet
    rebalance_due: bool = False  # a provider joined while the model was busy: look once idle
    synced: dict[str, Want] = field(default_factory=dict)  # what each member was sent in full
    persisted: Placement | None = None  # the placement last handed out to be stored
    _desired_of: Placement | None = None  # the placement `_desired` was worked out for
    _desired: dict[str, Want] = field(default_factory=dict)
    _replica_wants: dict[int, tuple[Replica, dict[str, Want]]] = field(default_factory=dict)
    _wants: dict[tuple[int, int, str], Want] = field(default_factory=dict)  # by range and role

    def members(self) -> set[str]:
        if self.placement is None:
            return set()
        return self.placement.providers() | set(self.placement.backups.values())

    def desired(self) -> dict[str, Want]:
        """peer -> the stage it serves or backs up (worked out once per placement; replicas
        a new placement kept as they were are not worked out again). Shared: do not modify."""
        if self.placement is self._desired_of and self.placement is not None:
            return self._desired
        out: dict[str, Want] = {}
        self._desired_of, self._desired = self.placement, out
        if self.placement is None:
            self._replica_wants = {}
            return out
        for (r, s), peer in self.placement.backups.items():
            out[peer] = self._want(self.placement.replicas[r].stages[s], "backup")
        wants: dict[int, tuple[Replica, dict[str, Want]]] = {}
        for rep in self.placement.replicas:
            known = self._replica_wants.get(id(rep))  # (the replica is kept: its id is its own)
            if known is None or known[0] is not rep:
                known = (rep, {st.provider: self._want(st, "active") for st in rep.stages})
            wants[id(rep)] = known
            out.update(known[1])
        self._replica_wants = wants
        return out

    def _want(self, st: Stage, role: str) -> Want:
        known = self._wants.get((st.first, st.end, role))
        if known is None:
            known = Want(range_key(self.name, st.first, st.end), role, st.first, st.end)
            self._wants[(st.first, st.end, role)] = known
        return known


def range_key(model: str, first: int, end: int) -> str:
    return f"{model}@{first}-{end}"


def placement_to_json(p: Placement) -> dict[str, Any]:
    return {
        "replicas": [[[s.provider, s.first, s.end, s.time] for s in r.stages] for r in p.replicas],
        "backups": [[r, s, peer] for (r, s), peer in sorted(p.backups.items())],
        "spares": list(p.spares),
        "tokens": p.tokens,
    }


def placement_from_json(d: dict[str, Any]) -> Placement:
    replicas = tuple(
        Replica(tuple(Stage(str(a), int(b), int(c), float(t)) for a, b, c, t in rep))
        for rep in d["replicas"]
    )
    backups = {(int(r), int(s)): str(peer) for r, s, peer in d["backups"]}
    return Placement(replicas, backups, tuple(str(p) for p in d["spares"]), int(d["tokens"]))


def checked_placement(data: dict[str, Any], units: int) -> Placement | None:
    """A stored placement, if it still fits a model of `units` provider stages."""
    try:
        placement = placement_from_json(data)
    except (KeyError, TypeError, ValueError):
        return None
    for rep in placement.replicas:
        ends = [(s.first, s.end) for s in rep.stages]
        if [e for _, e in ends][-1:] != [units] or any(
            a != (ends[i - 1][1] if i else 0) or b <= a for i, (a, b) in enumerate(ends)
        ):
            return None
    if any(
        not 0 <= r < len(placement.replicas) or not 0 <= s < len(placement.replicas[r].stages)
        for r, s in placement.backups
    ):
        return None
    members = [st.provider for rep in placement.replicas for st in rep.stages]
    if len(set(members)) != len(members):
        return None  # a provider holds one stage
    return placement


def placement_fields(placement: Placement) -> dict[str, Any]:
    """A placement as the event log shows it."""
    return {
        "replicas": [[[s.provider, s.first, s.end] for s in r.stages] for r in placement.replicas],
        "backups": {f"{r}.{s}": p for (r, s), p in placement.backups.items()},
        "throughput_tokens_s": round(placement.throughput, 1),
    }
