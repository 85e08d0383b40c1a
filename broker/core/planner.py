"""Planning several models over one pool: placing, repairing and rebalancing.

Each model's provider stages are the placement's indivisible blocks; `broker.core.placement`
spreads them over the providers this model may use (`candidates`: alive, not draining, not
serving or backing up another model, able to load it), with their profiles corrected by the
stage times observed so far; a provider never seen running a stage gets the median correction
of its hardware twins (`_prior`). A model that fits nowhere else may take other models'
backups to serve (serving a model beats a standby), never to stand by.

A lost provider is repaired by `broker.core.replan.on_leave`, moving only its blocks; who takes
them over is ranked by `broker.core.pool.promotion_order` (warm first, flapping last), the one
take-over path: `PromoteBackup` when the successor has the stage loaded, else `Replan`. A
newcomer becomes a backup or spare (`on_join`); a full re-placement happens only when it pays
(`should_rebalance`, after rescoring the current placement with today's corrections) and the
model is idle; one put off while it was busy happens once it is idle. A re-placement moves
served blocks only onto providers already serving the model or whose stage times have been
seen (`CoreConfig.observe_before_moving`: as servers, or as backups giving spot checks' second
opinions): a newcomer's claimed profile never displaces a working placement, and so never
leaves a model unserved while it loads (or never loads: a fake). Newcomers stand by in it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from broker.core.actions import PlacementChanged, PromoteBackup, Replan
from broker.core.placement import Placement, PlacementError, placed
from broker.core.plans import Plan, placement_fields, range_key
from broker.core.pool import PoolState, Status, promotion_order
from broker.core.reconcile import Reconciler
from broker.core.replan import on_join, on_leave, rescored, should_rebalance
from dag.cost import Correction, HardwareProfile


class Candidates(Mapping[str, HardwareProfile]):
    """The providers a model may use (alive, not draining, not taken by another model, not
    known unable to load it), with their profiles corrected by observation; worked out per
    provider when asked (a repair looks at a few), iterated in peer id order."""

    def __init__(
        self,
        pool: PoolState,
        taken: set[str],
        cannot: Mapping[str, str],
        priors: Callable[[], Callable[[str], Correction]],
    ) -> None:
        self._pool, self._taken, self._cannot = pool, taken, cannot
        self._priors = priors
        self._prior: Callable[[str], Correction] | None = None
        self._known: dict[str, HardwareProfile] = {}

    def __contains__(self, peer: object) -> bool:
        if not isinstance(peer, str) or peer in self._taken or peer in self._cannot:
            return False
        p = self._pool.providers.get(peer)
        return p is not None and p.status not in (Status.DEAD, Status.DRAINING)

    def __getitem__(self, peer: str) -> HardwareProfile:
        known = self._known.get(peer)
        if known is not None:
            return known
        if peer not in self:
            raise KeyError(peer)
        p = self._pool.providers[peer]
        correction = p.correction
        if not correction.samples:
            if self._prior is None:
                self._prior = self._priors()
            correction = self._prior(p.profile.name)
        same = correction.factor == p.profile.slowdown
        known = self._known[peer] = p.profile if same else correction.apply(p.profile)
        return known

    def __iter__(self) -> Iterator[str]:
        return (peer for peer in sorted(self._pool.providers) if peer in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Planner(Reconciler):
    def _taken_elsewhere(self, plan: Plan | None, backups: bool = True) -> set[str]:
        """Providers serving (or, with `backups`, backing up) another model (any model, for
        None)."""
        taken: set[str] = set()
        for other in self.plans.values():
            if other is not plan and other.placement is not None:
                taken |= other.placement.providers()
                if backups:
                    taken |= set(other.placement.backups.values())
        return taken

    def candidates(self, plan: Plan, backups: bool = True, gone: str | None = None) -> Candidates:
        """Profiles (corrected by observed times) of the providers this model may use, but for
        `gone`; without `backups`, other models' backups count as free."""
        taken = self._taken_elsewhere(plan, backups)
        if gone is not None:
            taken.add(gone)
        return Candidates(self.pool, taken, plan.cannot, self._priors)

    def _priors(self) -> Callable[[str], Correction]:
        """The correction to assume for a provider not yet seen running a stage, by its
        hardware: the median of those seen on the same hardware, else of all seen (profiles
        measure peak FLOP/s, which real stages reach only a share of; an unseen provider
        rated as its peak would look faster than its measured twins), else none."""
        seen: dict[str, list[float]] = {}
        for p in self.pool.providers.values():
            if p.correction.samples:
                seen.setdefault(p.profile.name, []).append(p.correction.factor)
        every = [f for factors in seen.values() for f in factors]
        known: dict[str, Correction] = {}

        def prior(hardware: str) -> Correction:
            if hardware not in known:
                same = seen.get(hardware) or every
                known[hardware] = Correction(statistics.median(same)) if same else Correction()
            return known[hardware]

        return prior

    def _place(self, plan: Plan) -> None:
        """Place a model on free providers; if that fails, other models' warm backups may
        serve it, but not stand by for it."""
        config = self.config.placement
        try:
            placement = placed(plan.spec, self.candidates(plan), config)
        except PlacementError:
            try:
                placement = placed(plan.spec, self.candidates(plan, backups=False), config)
            except PlacementError as exc:
                reason = str(exc)
                if reason != plan.waiting_reason:
                    plan.waiting_reason = reason
                    self._note("model_waiting", model=plan.name, reason=reason)
                return
            standby = self._taken_elsewhere(plan) - self._taken_elsewhere(plan, backups=False)
            placement = Placement(
                placement.replicas,
                {k: p for k, p in placement.backups.items() if p not in standby},
                tuple(p for p in placement.spares if p not in standby),
                placement.tokens,
            )
        plan.waiting_reason = ""
        self._adopt(plan, placement, "placed")

    def _adopt(self, plan: Plan, placement: Placement, why: str = "", **extra: Any) -> None:
        plan.placement = placement
        self._routes_changed()
        used = plan.members()
        lost_backups: list[tuple[Plan, list[str]]] = []
        for other in self.plans.values():  # providers it takes are no one's spares or backups
            if other is not plan and other.placement is not None:
                spares = tuple(s for s in other.placement.spares if s not in used)
                kept = {k: p for k, p in other.placement.backups.items() if p not in used}
                if kept != other.placement.backups:
                    taken = sorted(set(other.placement.backups.values()) - set(kept.values()))
                    lost_backups.append((other, taken))
                if spares != other.placement.spares or kept != other.placement.backups:
                    other.placement = Placement(
                        other.placement.replicas, kept, spares, other.placement.tokens
                    )
        for other, taken in lost_backups:  # their standby stages are withdrawn
            self._note("backups_taken", model=other.name, by=plan.name, peers=taken)
            self._sync(other)
        if why:
            self._note(f"model_{why}", model=plan.name, **placement_fields(placement), **extra)
        self._sync(plan)

    def _drop(self, plan: Plan) -> None:
        plan.placement = None
        self._routes_changed()
        plan.persisted = None
        self._sync_removals(plan, {})
        self._emit(PlacementChanged(plan.name, None))

    def _repair(self, plan: Plan, gone: str, why: str) -> None:
        if plan.placement is None:
            self._place(plan)
            return
        if gone not in plan.members() and gone not in plan.placement.spares:
            return
        profiles = self.candidates(plan, gone=gone)

        def rank(first: int, end: int, among: list[str]) -> list[str]:
            return promotion_order(self.pool, range_key(plan.name, first, end), among)

        before = plan.placement
        fixed = on_leave(before, gone, plan.spec, profiles, self.config.placement, rank)
        self._take_over_decision(plan, before, gone, fixed.moves)
        moves = [[m.first, m.end, m.source, m.target] for m in fixed.moves]
        if not fixed.placement.replicas:
            self._note("model_unplaced", model=plan.name, lost=gone, reason=why)
            self._drop(plan)
            self._place(plan)
            return
        self._adopt(plan, fixed.placement, "repaired", lost=gone, reason=why, moves=moves)

    def _take_over_decision(self, plan: Plan, before: Placement, gone: str, moves: Any) -> None:
        """Say who took over what `gone` served: a warm successor (`PromoteBackup`) or not
        (`Replan`: a cold load, a merge into its neighbours, or a dissolved replica)."""
        served = [st for rep in before.replicas for st in rep.stages if st.provider == gone]
        if not served:
            return  # it only stood by, or was a spare
        st = served[0]
        stage = range_key(plan.name, st.first, st.end)
        whole = [m for m in moves if (m.first, m.end) == (st.first, st.end)]
        if whole:
            target = self.pool.providers.get(whole[0].target)
            if target is not None and stage in target.ready:
                self._emit(PromoteBackup(plan.name, whole[0].target, stage, gone))
                return
            reason = f"{gone} served {stage}; {whole[0].target} loads it (none had it loaded)"
        elif moves:
            reason = f"{gone} served {stage}; its neighbours take its blocks"
        else:
            reason = f"{gone} served {stage}; no provider can take it: its replica is dissolved"
        self._emit(Replan(plan.name, gone, reason))

    def _maybe_rebalance(self, plan: Plan) -> None:
        if plan.placement is None or plan.restored_until is not None:
            return
        if self.busy(plan.name):
            plan.rebalance_due = True  # not under a running job: once it is idle (`_idle`)
            return
        plan.rebalance_due = False
        profiles = self.candidates(plan)
        try:
            candidate = self._rebalanced(plan, profiles)
        except PlacementError:
            return
        current = rescored(plan.placement, plan.spec, profiles, self.config.placement)
        if should_rebalance(current, candidate, self.config.rebalance_threshold):
            before = round(current.throughput, 1)
            self._adopt(plan, candidate, "rebalanced", before_tokens_s=before)

    def observed(self, plan: Plan, peer: str) -> bool:
        """Whether a re-placement of `plan` may move served blocks onto `peer`: it serves the
        model already, or it has been seen taking `observe_before_moving` stage times."""
        need = self.config.observe_before_moving
        if need <= 0 or (plan.placement is not None and peer in plan.placement.providers()):
            return True
        p = self.pool.providers.get(peer)
        return p is not None and p.correction.samples >= need

    def _rebalanced(self, plan: Plan, profiles: Candidates) -> Placement:
        """A fresh placement over the providers whose speed is known (`observed`); the others
        stand by in it as newcomers do (`on_join`: a backup where a stage has none, else a
        spare). Raises `PlacementError` when they cannot hold the model."""
        config = self.config.placement
        if self.config.observe_before_moving <= 0:
            return placed(plan.spec, profiles, config)
        seen = {peer: profiles[peer] for peer in profiles if self.observed(plan, peer)}
        candidate = placed(plan.spec, seen, config)
        for peer in profiles:
            if peer not in seen:
                candidate = on_join(candidate, peer, plan.spec, profiles, config)
        return candidate

    def _idle(self, model: str) -> None:
        """Something stopped using `model`: a rebalance put off while it was busy happens now
        if nothing else uses it."""
        plan = self.plans.get(model)
        if plan is not None and plan.rebalance_due and not self.busy(model):
            self._maybe_rebalance(plan)
