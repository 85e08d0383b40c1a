"""The decision core: `Core.handle(event) -> actions`, the broker's every decision in one place.

Sans-IO, as dask's worker state machine: the broker service turns what it hears into events
and carries out the actions; the simulator feeds events from its virtual world and models the
actions' effects. Nothing here reads a clock, draws a random number or does I/O, so the same
events give the same actions in any process (`broker.core.trace` checks it on recorded runs).

After each event, queued jobs that can start now are started (`StartJob`): the queue policy
chooses among a model's jobs when its route has free replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.core.actions import Action, ProviderLost, StartJob, UnassignStage
from broker.core.events import (
    AssignAnswered,
    ClockTicked,
    DrainStarted,
    HeartbeatReceived,
    HeartbeatsMissed,
    Input,
    JobEnded,
    JobProgressed,
    JobQueued,
    ModelAdded,
    ModelUsed,
    ProviderJoined,
    ProviderLeft,
    RebalanceCheck,
    StageReported,
    StageTimed,
    StageTimeObserved,
)
from broker.core.planner import Planner
from broker.core.plans import Plan, checked_placement
from broker.core.pool import Action as PoolAction
from broker.core.pool import Status
from broker.core.replan import on_join
from broker.core.state import CoreConfig
from dag.cost import layer_time


class Core(Planner):
    def __init__(self, config: CoreConfig | None = None) -> None:
        super().__init__(config or CoreConfig())

    def handle(self, event: Input) -> list[Action]:
        """The actions `event` calls for, in the order they are to be carried out."""
        self.now = max(self.now, event.at)
        try:
            _HANDLERS[type(event)](self, event)
            self._start_jobs()
        except BaseException:
            self._out = []  # a bug: this event's actions must not ride on the next one
            raise
        out, self._out = self._out, []
        return out

    # ---- providers --------------------------------------------------------------------------

    def _joined(self, event: ProviderJoined) -> None:
        peer = event.peer_id
        known = self.pool.providers.get(peer)
        again = known is not None and known.rejoins(event)
        self._losses(self._pool(event), "ProviderJoined")  # restarted without us noticing
        self.loaded[peer] = set(event.loaded)
        seen: dict[str, Any] = {
            "hardware": event.profile.name,
            "executor": event.executor,
            "memory_bytes": event.memory_bytes,
            "loaded": sorted(event.loaded),
        }
        if again:
            seen["again"] = True
        self._note("provider_joined", peer=peer, **seen)
        if again:  # the same process, alive all along: what it has loaded still counts
            self._confirm_loaded(peer)
            return
        for plan in self.plans.values():
            plan.cannot.pop(peer, None)  # a fresh start: let it try again
        member = [p for p in self.plans.values() if peer in p.members()]
        for plan in member:
            self._sync(plan)  # a member re-joined (after a broker restart): re-send its stages
        for plan in self.plans.values() if not member else []:
            if plan.placement is None:
                self._place(plan)
                continue
            profiles = self.candidates(plan)
            if peer in self._taken_elsewhere(None) or peer not in profiles:
                continue
            updated = on_join(plan.placement, peer, plan.spec, profiles, self.config.placement)
            if updated != plan.placement:
                self._adopt(plan, updated)
            self._maybe_rebalance(plan)
        # Stages it still holds that no placement wants (it was repaired away while cut off,
        # or a model changed) are dropped, so their memory is free for new ones.
        sent = self.sent.get(peer, {})
        for key in sorted(self.loaded[peer]):
            if key not in sent:
                self._emit(UnassignStage(peer, key))

    def _heartbeat(self, event: HeartbeatReceived) -> None:
        peer = event.peer_id
        if not self.pool.alive(peer):
            self._out += self._pool(event)  # AskToRejoin
            return
        self._pool(event)
        if event.draining and self.pool.providers[peer].status is not Status.DRAINING:
            self._note("provider_draining", peer=peer)
            self._pool(DrainStarted(peer, event.at))
            for plan in list(self.plans.values()):  # its backup takes over now
                if peer in plan.members():
                    self._repair(plan, peer, "draining")
        if event.loaded is not None:
            self.loaded[peer] = set(event.loaded)
            self._confirm_loaded(peer)

    def _confirm_loaded(self, peer: str) -> None:
        """A heartbeat lists what is loaded: a stage whose ready report was lost counts."""
        sent = self.sent.get(peer, {})
        confirmed = self.confirmed.setdefault(peer, {})
        changed = False
        for key in sorted(self.loaded[peer]):
            role = sent.get(key)
            if role is not None and key not in confirmed:
                confirmed[key] = role
                changed = True
                self._touch(peer)
        if changed:
            for plan in self.plans.values():
                self._check_ready(plan, peer)

    def _gone(self, event: HeartbeatsMissed | ProviderLeft | ClockTicked) -> None:
        self._losses(self._pool(event), type(event).__name__)
        if isinstance(event, ClockTicked):
            self._check_restored()

    def _losses(self, actions: list[PoolAction], cause: str) -> None:
        """Providers the pool declared lost: forget what they were sent, then repair every
        model they served or backed up."""
        lost = [a for a in actions if isinstance(a, ProviderLost)]
        for a in lost:
            self._note(
                "provider_lost", peer=a.peer_id, stage=a.stage, graceful=a.graceful, cause=cause
            )
            self._emit(a)
            self._forget(a.peer_id)
        self._out += [a for a in actions if not isinstance(a, ProviderLost)]
        for a in lost:
            for plan in list(self.plans.values()):
                self._repair(plan, a.peer_id, "left" if a.graceful else "lost")

    def _check_restored(self) -> None:
        """Members of restored placements that did not re-join in time are lost."""
        for plan in list(self.plans.values()):
            if plan.restored_until is None or self.now < plan.restored_until:
                continue
            plan.restored_until = None
            for peer in sorted(plan.members()):
                if not self.pool.alive(peer):
                    self._note("provider_missing", peer=peer, model=plan.name)
                    self._repair(plan, peer, "did not re-join after the broker restarted")

    def _timed(self, event: StageTimed) -> None:
        """Correct the provider's profile towards the stage times we see."""
        plan = self.plans.get(event.model)
        p = self.pool.providers.get(event.peer_id)
        if plan is None or p is None or event.seconds <= 0:
            return
        predicted = layer_time(plan.spec, p.profile, event.work)
        self._pool(StageTimeObserved(event.peer_id, predicted, event.seconds, event.at))

    # ---- models and stages ------------------------------------------------------------------

    def _model(self, event: ModelAdded) -> None:
        plan = Plan(event.model, event.spec, event.keys)
        self._coverage.pop(event.model, None)  # its unit keys may differ from an earlier version's
        old = self.plans.get(event.model)
        if old is not None and old.placement is not None:
            self._drop(old)  # a new version replaces the old one's assignments
        if old is not None:
            for key in old.keys:
                self.model_of.pop(key, None)
        if event.restored is not None:
            placement = checked_placement(event.restored, len(event.keys))
            if placement is None:
                self._note("placement_discarded", model=event.model)
            else:
                plan.placement = placement
                self._routes_changed()
                plan.restored_until = event.at + self.config.restart_grace_s
        self.plans[event.model] = plan
        self.model_of.update((key, event.model) for key in event.keys)
        if plan.placement is None:
            self._place(plan)
        else:
            self._sync(plan)

    def _reported(self, event: StageReported) -> None:
        peer = event.peer_id
        for key in event.keys:
            sent = self.sent.get(peer, {})
            if key not in sent:
                continue  # an assignment since withdrawn
            if not event.ready:
                self._failed(peer, key, event.reason or "failed")
                continue
            confirmed = self.confirmed.setdefault(peer, {})
            if sent[key] != event.role and confirmed.get(key):
                continue  # a late report from before a role change
            confirmed[key] = event.role
            self._touch(peer)
            self.loaded.setdefault(peer, set()).add(key)
            self._note("stage_ready", peer=peer, key=key, role=event.role, load_s=event.load_s)
        for model in sorted({self.model_of[k] for k in event.keys if k in self.model_of}):
            self._check_ready(self.plans[model], peer)

    def _answered(self, event: AssignAnswered) -> None:
        # An answer to a message since overtaken (the key withdrawn, its role changed, the
        # provider lost) decides nothing.
        sent = self.sent.get(event.peer_id, {}).get(event.key)
        if not event.accepted and event.kind != "unassign":
            if sent is not None:
                self._failed(event.peer_id, event.key, event.reason or "refused")
        elif event.accepted and event.kind == "promote" and sent == "active":
            self.confirmed.setdefault(event.peer_id, {})[event.key] = "active"
            self._touch(event.peer_id)
            self._note("stage_promoted", peer=event.peer_id, key=event.key)

    def _failed(self, peer: str, key: str, reason: str) -> None:
        self._note("stage_failed", peer=peer, key=key, reason=reason)
        plan = self.plans.get(self.model_of.get(key, ""))
        if plan is not None:
            plan.cannot[peer] = reason
            self._repair(plan, peer, f"could not load {key}: {reason}")

    def _rebalance_check(self, event: RebalanceCheck) -> None:
        for plan in list(self.plans.values()):
            self._maybe_rebalance(plan)

    # ---- work -------------------------------------------------------------------------------

    def _used(self, event: ModelUsed) -> None:
        self.interactive[event.model] = max(0, self.interactive.get(event.model, 0) + event.delta)
        if event.delta < 0:
            self._idle(event.model)

    def _queued(self, event: JobQueued) -> None:
        self.queue.add(event.job, event.model, event.created, event.estimate_s)

    def _progressed(self, event: JobProgressed) -> None:
        self.queue.progress(event.job, event.done)

    def _ended(self, event: JobEnded) -> None:
        model = self.queue.end(event.job)
        if model is not None:
            self._idle(model)

    def _start_jobs(self) -> None:
        if not self.queue.queued:
            return

        def slots(model: str) -> int:
            plan = self.plans.get(model)
            if plan is None or plan.placement is None:
                return 0
            held = self.queue.held(model)
            if held >= len(plan.placement.replicas):
                return held  # no route has more stages than replicas: nothing is free
            return self.slots(model)

        for job, model, shares in self.queue.decide(self.now, slots):
            self._emit(StartJob(job, model, shares))


_HANDLERS: dict[type, Callable[[Core, Any], None]] = {
    ProviderJoined: Core._joined,
    HeartbeatReceived: Core._heartbeat,
    HeartbeatsMissed: Core._gone,
    ProviderLeft: Core._gone,
    ClockTicked: Core._gone,
    StageTimed: Core._timed,
    ModelAdded: Core._model,
    StageReported: Core._reported,
    AssignAnswered: Core._answered,
    RebalanceCheck: Core._rebalance_check,
    ModelUsed: Core._used,
    JobQueued: Core._queued,
    JobProgressed: Core._progressed,
    JobEnded: Core._ended,
}
