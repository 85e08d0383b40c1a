"""Desired placement against what providers were told and have confirmed, as messages.

A plan's desired state (who serves which blocks, who stands by) is compared with what each
provider was sent; the difference becomes `AssignStage`, `PromoteStage` (a backup that has the
stage loaded now serves it) and `UnassignStage`, in order, per provider. A provider whose
whole stage is confirmed loaded is `StageReady` in the pool (it is warm). Only members whose
wanted stage changed are looked at again (`Plan.synced`), so a swarm of a thousand costs no
more per change than one of ten.
"""

from __future__ import annotations

from broker.core.actions import AssignStage, PlacementChanged, PromoteStage, UnassignStage
from broker.core.events import StageAssigned, StageReady
from broker.core.plans import Plan, Want, placement_to_json
from broker.core.pool import Status
from broker.core.state import CoreState

GONE = (Status.DEAD, Status.DRAINING)


class Reconciler(CoreState):
    def _sync(self, plan: Plan) -> None:
        desired = plan.desired()
        self._sync_removals(plan, desired)
        synced = plan.synced
        changed = [peer for peer, want in desired.items() if synced.get(peer) != want]
        for peer in sorted(changed):  # the others were sent all of their stage in their role
            want = desired[peer]
            p = self.pool.providers.get(peer)
            if p is None or p.status in GONE:
                continue
            if p.stage != want.stage or (p.status is Status.ACTIVE) != (want.role == "active"):
                self._pool(StageAssigned(peer, want.stage, want.role == "active", self.now))
            sent = self.sent.setdefault(peer, {})
            confirmed = self.confirmed.get(peer, {})
            for pos in range(want.first, want.end):
                key = plan.keys[pos]
                before = sent.get(key)
                if before == want.role:
                    continue
                if want.role == "active" and before == "backup" and key in confirmed:
                    self._emit(PromoteStage(peer, key))
                else:
                    self._emit(AssignStage(peer, plan.name, key, pos, want.role))
                sent[key] = want.role
            plan.synced[peer] = want
            self._check_ready(plan, peer)
        if plan.placement is not None and plan.placement is not plan.persisted:
            plan.persisted = plan.placement
            self._emit(PlacementChanged(plan.name, placement_to_json(plan.placement)))

    def _sync_removals(self, plan: Plan, desired: dict[str, Want]) -> None:
        """Units members were sent that they should no longer hold are unassigned."""
        for peer in sorted(plan.synced):
            old = plan.synced[peer]
            want = desired.get(peer)
            if want == old:
                continue
            sent = self.sent.get(peer, {})
            confirmed = self.confirmed.get(peer, {})
            p = self.pool.providers.get(peer)
            for pos in range(old.first, old.end):
                if want is not None and want.first <= pos < want.end:
                    continue
                key = plan.keys[pos]
                if sent.pop(key, None) is None:
                    continue
                confirmed.pop(key, None)
                self._touch(peer)
                if p is not None and p.status not in GONE:  # gone or leaving: nothing to tell
                    self._emit(UnassignStage(peer, key))
            if want is None:
                del plan.synced[peer]
                if p is not None and p.status not in GONE and p.stage == old.stage:
                    self._pool(StageAssigned(peer, None, False, self.now))

    def _check_ready(self, plan: Plan, peer: str) -> None:
        """A member with every unit of its stage confirmed is warm for that stage."""
        want = plan.synced.get(peer)
        if want is None:
            return
        confirmed = self.confirmed.get(peer, {})
        if all(k in confirmed for k in plan.keys[want.first : want.end]):
            p = self.pool.providers.get(peer)
            if p is not None and want.stage not in p.ready:
                self._pool(StageReady(peer, want.stage, self.now))

    def _forget(self, peer: str) -> None:
        """`peer` is lost: whatever it was sent or confirmed is void."""
        self.sent.pop(peer, None)
        self.confirmed.pop(peer, None)
        self._touch(peer)
        self.loaded.pop(peer, None)
        for plan in self.plans.values():
            plan.synced.pop(peer, None)
