"""The decision core's configuration and state, shared by its parts (reconcile, planner, core).

`CoreConfig` gathers every setting a decision depends on; the broker builds it from its own
configuration (`BrokerConfig.core`), the simulator from its scenario, and a trace file starts
with it, so a replay decides with the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker.core.actions import Action, Notice, ProviderLost
from broker.core.events import ProviderJoined
from broker.core.placement import Placement, PlacementConfig
from broker.core.plans import Plan, Want
from broker.core.pool import Action as PoolAction
from broker.core.pool import Event as PoolEvent
from broker.core.pool import PoolConfig, PoolState
from broker.core.pool import apply as pool_apply
from broker.core.queue import JobQueue, policy_named
from broker.core.replan import REBALANCE_THRESHOLD


@dataclass(frozen=True)
class CoreConfig:
    pool: PoolConfig = field(default_factory=PoolConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    queue_policy: str = "fifo"  # "fifo" or "sjf-bsbf" (`broker.core.queue`)
    restart_grace_s: float = 20.0  # after a restart, seconds a restored placement's members
    # have to re-join before they count as lost
    rebalance_every_s: float = 600.0  # seconds between checks whether placing idle models
    # afresh pays (the service and the simulator send `RebalanceCheck` this often)
    rebalance_threshold: float = REBALANCE_THRESHOLD  # re-place when current throughput is
    # below this share of a fresh placement's
    observe_before_moving: int = 0  # stage times a provider must have been seen taking before
    # a rebalance moves served blocks onto it (0: its profile is trusted at once, as the
    # simulator's catalog machines are; the broker asks 1 unless told to trust claims)

    def __post_init__(self) -> None:
        policy_named(self.queue_policy)  # raises on an unknown policy


@dataclass
class _Coverage:
    """How many providers serve each unit of one placement (a difference array over the
    units), and which units each provider counts for."""

    placement: Placement
    diff: list[int]
    wants: dict[str, Want]  # the placement's active stages
    served: dict[str, tuple[int, ...]]  # peer -> the units of its stage it serves (ascending)
    dirty: set[str]  # providers to look at again

    def count(self, units: tuple[int, ...], sign: int) -> None:
        if units and units[-1] - units[0] + 1 == len(units):  # one run of units
            self.diff[units[0]] += sign
            self.diff[units[-1] + 1] -= sign
        else:
            for pos in units:
                self.diff[pos] += sign
                self.diff[pos + 1] -= sign


class CoreState:
    """Everything the core knows. Mutable, but changed only by `Core.handle`."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.pool = PoolState(config=config.pool)
        self.plans: dict[str, Plan] = {}
        self.model_of: dict[str, str] = {}  # unit key -> its model
        self.sent: dict[str, dict[str, str]] = {}  # peer -> unit key -> role it was sent
        self.confirmed: dict[str, dict[str, str]] = {}  # peer -> unit key -> role it is ready in
        self.loaded: dict[str, set[str]] = {}  # peer -> unit keys it reports loaded
        self.queue = JobQueue(policy_named(config.queue_policy))
        self.interactive: dict[str, int] = {}  # model -> requests and sessions using it
        self.now = 0.0
        self._out: list[Action] = []
        # caches: `route` per model, cleared wherever a placement, a confirmation or liveness
        # changes; per model, who serves which units, updated per provider (`_touch`)
        self._routes: dict[str, list[list[str]] | None] = {}
        self._coverage: dict[str, _Coverage] = {}  # per model: who serves which units

    # ---- what the shell may ask ----------------------------------------------------------

    def alive(self, peer: str) -> bool:
        return self.pool.alive(peer)

    def busy(self, model: str) -> bool:
        """A job, an interactive request or a generation session uses the model (so its
        placement is not rebalanced now)."""
        return self.queue.busy(model) or self.interactive.get(model, 0) > 0

    def route(self, model: str) -> list[list[str]] | None:
        """Per provider stage (pipeline order), the live providers serving it and confirmed
        so; None if the model is unknown or not placed. (Shared: do not modify it.)"""
        if model in self._routes:
            return self._routes[model]
        route = self._route(model)
        self._routes[model] = route
        return route

    def _route(self, model: str) -> list[list[str]] | None:
        plan = self.plans.get(model)
        if plan is None or plan.placement is None:
            return None
        served = self._coverage_of(plan).served
        out: list[list[str]] = [[] for _ in plan.keys]
        for rep in plan.placement.replicas:
            for st in rep.stages:
                for pos in served.get(st.provider, ()):
                    out[pos].append(st.provider)
        return out

    def slots(self, model: str) -> int:
        """How many requests at once the route serves: of every unit, the number of
        providers serving it, at the least (0: some unit has none)."""
        plan = self.plans.get(model)
        if plan is None or plan.placement is None:
            return 0
        diff = self._coverage_of(plan).diff
        least, count = len(plan.placement.replicas), 0
        for pos in range(len(plan.keys)):
            count += diff[pos]
            least = min(least, count)
        return least

    def _coverage_of(self, plan: Plan) -> _Coverage:
        """Who serves which units of `plan` now, brought up to date for the providers whose
        confirmations or liveness changed since, or whose stage a new placement changed."""
        assert plan.placement is not None
        desired = plan.desired()
        cov = self._coverage.get(plan.name)
        if cov is None or cov.placement is not plan.placement:
            old = cov
            cov = _Coverage(plan.placement, [0] * (len(plan.keys) + 1), {}, {}, set())
            for peer, want in desired.items():
                if want.role != "active":
                    continue
                cov.wants[peer] = want
                if old is not None and peer not in old.dirty and old.wants.get(peer) == want:
                    cov.served[peer] = units = old.served.get(peer, ())
                    cov.count(units, 1)
                else:
                    cov.dirty.add(peer)
            self._coverage[plan.name] = cov
        keys = plan.keys
        for peer in cov.dirty:
            cov.count(cov.served.pop(peer, ()), -1)
            active = cov.wants.get(peer)
            confirmed = self.confirmed.get(peer)
            if active is None or not confirmed or not self.alive(peer):
                continue
            span = range(active.first, active.end)
            units = tuple(p for p in span if confirmed.get(keys[p]) == "active")
            if units:
                cov.served[peer] = units
                cov.count(units, 1)
        cov.dirty.clear()
        return cov

    def backups(self, model: str) -> dict[int, list[str]]:
        """Per provider stage, the backups that have it loaded."""
        plan = self.plans.get(model)
        out: dict[int, list[str]] = {}
        if plan is None or plan.placement is None:
            return out
        for (r, s), peer in plan.placement.backups.items():
            st = plan.placement.replicas[r].stages[s]
            confirmed = self.confirmed.get(peer, {})
            for pos in range(st.first, st.end):
                if plan.keys[pos] in confirmed:
                    out.setdefault(pos, []).append(peer)
        return out

    # ---- helpers of the parts --------------------------------------------------------------

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    def _note(
        self, kind: str, *, peer: str | None = None, job: str | None = None, **data: Any
    ) -> None:
        self._out.append(Notice(kind, data, peer, job))

    def _pool(self, event: PoolEvent) -> list[PoolAction]:
        self.pool, actions = pool_apply(self.pool, event)
        if isinstance(event, ProviderJoined):  # alive again
            self._touch(event.peer_id)
        for action in actions:
            if isinstance(action, ProviderLost):
                self._touch(action.peer_id)
        return actions

    def _touch(self, peer: str) -> None:
        """What `peer` serves may have changed (its confirmations, or whether it is alive)."""
        self._routes_changed()
        for cov in self._coverage.values():
            cov.dirty.add(peer)

    def _routes_changed(self) -> None:
        """A placement, a confirmation or liveness changed: routes are worked out anew."""
        self._routes.clear()


def least_loaded(peers: list[str], avoid: set[str], load: dict[str, int]) -> str | None:
    """Which of `peers` serving a stage gets the next request: the least loaded, preferring
    those not in `avoid` (they just failed); ties by peer id."""
    if not peers:
        return None
    fresh = [p for p in peers if p not in avoid] or peers
    return min(fresh, key=lambda p: (load.get(p, 0), p))
