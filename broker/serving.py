"""Serving models: their stages placed on providers, warm backups, and the route table.

Each model's provider stages are the placement's indivisible blocks (`models.model_spec`); the
pure placement core (`broker.placement.place`) spreads them over the providers in the pool and
names a backup per placed stage, which pre-loads it and stands by. The desired state (who
serves which stages, who stands by) is a `Placement`; `sync` turns the difference between it
and what was sent into assign, promote and unassign messages, in order, per provider. A lost
provider is repaired with `broker.replan.on_leave` (its warm backup is promoted; nothing
healthy moves), a newcomer with `on_join`; a full re-placement happens only when it pays
(`should_rebalance`) and the model has no job running. Placements are persisted, so a
restarted broker restores them and providers re-announce what they have loaded.

The route of a stage is the providers that serve it and have confirmed so.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.config import BrokerConfig
from broker.events import EventLog
from broker.models import StoredModel, model_spec
from broker.placement import (
    Placement,
    PlacementConfig,
    PlacementError,
    Replica,
    place,
)
from broker.placement import Stage as PlacedStage
from broker.pool import (
    Action,
    ProviderLost,
    StageAssigned,
    StageReady,
    StageTimeObserved,
    Status,
)
from broker.registry import Registry
from broker.replan import on_join, on_leave, rescored, should_rebalance
from broker.store import Store
from dag.cost import Correction, HardwareProfile, Workload, layer_time
from dag.model import ModelSpec
from p2p import Host, P2PError
from proto.assign import ASSIGN, Assign, AssignAck, Promote, StageStatus, StatusAck, Unassign
from proto.ping import PING, Ping

log = logging.getLogger("fusionai.broker")

LOAD_OVERHEAD = 1.2  # providers need this times a stage's weights (executor arenas)
PLACEMENT_WORK = Workload(tokens=32 * 128, sequences=32, context=128, dtype="float32")


@dataclass
class Plan:
    model: StoredModel
    spec: ModelSpec
    placement: Placement | None = None
    restored_until: float | None = None  # after a restart: members have until then to re-join
    cannot: dict[str, str] = field(default_factory=dict)  # peer -> why it cannot host this model
    waiting_reason: str = ""  # why the model is not placed yet
    rebalance_due: bool = False  # a provider joined while the model was busy: look once idle


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
        Replica(tuple(PlacedStage(str(a), int(b), int(c), float(t)) for a, b, c, t in rep))
        for rep in d["replicas"]
    )
    backups = {(int(r), int(s)): str(peer) for r, s, peer in d["backups"]}
    return Placement(replicas, backups, tuple(d["spares"]), int(d["tokens"]))


def _checked(data: dict[str, Any], units: int) -> Placement | None:
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
        r >= len(placement.replicas) or s >= len(placement.replicas[r].stages)
        for r, s in placement.backups
    ):
        return None
    return placement


class Serving:
    def __init__(
        self,
        config: BrokerConfig,
        registry: Registry,
        store: Store,
        events: EventLog,
        host: Host,
        artifact_base: str,
    ) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.events = events
        self.host = host
        self.artifact_base = artifact_base
        self.artifact_token: Callable[[str], str] = lambda sha: ""  # set when keys are needed
        self.tls_sha256 = ""  # the HTTP server's certificate, when it serves TLS
        self.plans: dict[str, Plan] = {}
        self.sent: dict[tuple[str, str], str] = {}  # (peer, unit key) -> role sent
        self.confirmed: dict[tuple[str, str], str] = {}  # role the provider reported ready in
        self.busy: Callable[[str], bool] = lambda model: False  # a job runs on the model
        self.closing = False  # the broker is stopping: placements are left as they are
        self._outbox: dict[str, asyncio.Queue[Assign | Unassign | Promote]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self._suspecting: dict[str, asyncio.Future[None]] = {}  # peer -> its ping check
        self.pcfg = PlacementConfig(
            work=PLACEMENT_WORK, memory_fraction=1 / LOAD_OVERHEAD, max_replicas=config.replicas
        )
        registry.on_actions = self.on_actions
        registry.on_joined = self.on_joined
        registry.on_draining = self.on_draining
        registry.on_loaded = self.on_loaded

    # ---- models ----------------------------------------------------------------------------

    def add_model(self, model: StoredModel, restored: dict[str, Any] | None = None) -> None:
        plan = Plan(model, model_spec(model.manifest))
        old = self.plans.get(model.name)
        if old is not None and old.placement is not None:
            self._drop(old)  # a new version replaces the old one's assignments
        if restored is not None:
            placement = _checked(restored, len(model.units))
            if placement is None:
                self.events.emit("placement_discarded", model=model.name)
            else:
                plan.placement = placement
                plan.restored_until = time.monotonic() + self.config.grace_s
        self.plans[model.name] = plan
        if plan.placement is None:
            self._place(plan)
        else:
            self._sync(plan)

    def _drop(self, plan: Plan) -> None:
        plan.placement = None
        self._sync_removals(plan, {})
        self.store.delete_placement(plan.model.name)

    def unit_keys(self, plan: Plan) -> list[str]:
        return [plan.model.unit_key(i) for i in plan.model.units]

    # ---- placing ---------------------------------------------------------------------------

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

    def candidates(self, plan: Plan, backups: bool = True) -> dict[str, HardwareProfile]:
        """Profiles (corrected by observed times) of the providers this model may use; without
        `backups`, other models' backups count as free (serving a model beats a warm spare)."""
        taken = self._taken_elsewhere(plan, backups)
        out = {}
        for peer, p in sorted(self.registry.state.providers.items()):
            if p.status in (Status.DEAD, Status.DRAINING) or peer in taken or peer in plan.cannot:
                continue
            hw = self.registry.hardware.get(peer)
            if hw is not None:
                correction = p.correction if p.correction.samples else self._prior(hw.name)
                out[peer] = correction.apply(hw)
        return out

    def _prior(self, hardware: str) -> Correction:
        """The correction to assume for a provider not yet seen running a stage: the median of
        those seen on the same hardware, else of all seen (profiles measure peak FLOP/s,
        which real stages reach only a share of; an unseen provider rated as its peak would
        look faster than its measured twins), else none."""
        seen = [
            (self.registry.hardware[peer].name == hardware, p.correction.factor)
            for peer, p in self.registry.state.providers.items()
            if p.correction.samples and peer in self.registry.hardware
        ]
        same = [f for alike, f in seen if alike] or [f for _, f in seen]
        return Correction(factor=statistics.median(same)) if same else Correction()

    def _place(self, plan: Plan) -> None:
        """Place a model on free providers; if that fails, other models' warm backups may
        serve it (serving a model beats a standby), but not stand by for it."""
        try:
            placement = place(plan.spec, self.candidates(plan), self.pcfg)
        except PlacementError:
            try:
                placement = place(plan.spec, self.candidates(plan, backups=False), self.pcfg)
            except PlacementError as exc:
                reason = str(exc)
                if reason != plan.waiting_reason:
                    plan.waiting_reason = reason
                    self.events.emit("model_waiting", model=plan.model.name, reason=reason)
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
        used = self._members(plan)
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
            self.events.emit(
                "backups_taken", model=other.model.name, by=plan.model.name, peers=taken
            )
            self._sync(other)
        if not why:
            self._sync(plan)
            return
        self.events.emit(
            f"model_{why}",
            model=plan.model.name,
            replicas=[[[s.provider, s.first, s.end] for s in r.stages] for r in placement.replicas],
            backups={f"{r}.{s}": p for (r, s), p in placement.backups.items()},
            throughput_tokens_s=round(placement.throughput, 1),
            **extra,
        )
        self._sync(plan)

    def repair(self, plan: Plan, gone: str, why: str) -> None:
        if plan.placement is None:
            self._place(plan)
            return
        if gone not in self._members(plan) and gone not in plan.placement.spares:
            return
        profiles = {k: v for k, v in self.candidates(plan).items() if k != gone}
        fixed = on_leave(plan.placement, gone, plan.spec, profiles, self.pcfg)
        moves = [[m.first, m.end, m.source, m.target] for m in fixed.moves]
        if not fixed.placement.replicas:
            self.events.emit("model_unplaced", model=plan.model.name, lost=gone, reason=why)
            self._drop(plan)
            self._place(plan)
            return
        self._adopt(plan, fixed.placement, "repaired", lost=gone, reason=why, moves=moves)

    def _maybe_rebalance(self, plan: Plan) -> None:
        if plan.placement is None or plan.restored_until is not None:
            return
        if self.busy(plan.model.name):
            plan.rebalance_due = True  # not under a running job: once it is idle (`idle`)
            return
        plan.rebalance_due = False
        profiles = self.candidates(plan)
        try:
            candidate = place(plan.spec, profiles, self.pcfg)
        except PlacementError:
            return
        current = rescored(plan.placement, plan.spec, profiles, self.pcfg)  # as now measured
        if should_rebalance(current, candidate):
            self._adopt(
                plan,
                candidate,
                "rebalanced",
                before_tokens_s=round(current.throughput, 1),
            )

    def idle(self, model: str) -> None:
        """Nothing uses `model` any more: a rebalance put off while it was busy happens now."""
        plan = self.plans.get(model)
        if plan is not None and plan.rebalance_due and not self.busy(model) and not self.closing:
            self._maybe_rebalance(plan)

    # ---- desired state -> messages ---------------------------------------------------------

    def _desired(self, plan: Plan) -> dict[str, tuple[str, str, int, int]]:
        """peer -> (range key, role, first, end) of the stages it serves or backs up."""
        out: dict[str, tuple[str, str, int, int]] = {}
        if plan.placement is None:
            return out
        name = plan.model.name
        for (r, s), peer in plan.placement.backups.items():
            st = plan.placement.replicas[r].stages[s]
            out[peer] = (range_key(name, st.first, st.end), "backup", st.first, st.end)
        for rep in plan.placement.replicas:
            for st in rep.stages:
                out[st.provider] = (range_key(name, st.first, st.end), "active", st.first, st.end)
        return out

    def _sync_removals(self, plan: Plan, desired: dict[str, tuple[str, str, int, int]]) -> None:
        keys = self.unit_keys(plan)
        prefix = f"{plan.model.name}@"
        for (peer, key), _ in list(self.sent.items()):
            if key not in keys:
                continue
            want = desired.get(peer)
            if want is not None and keys.index(key) in range(want[2], want[3]):
                continue
            del self.sent[(peer, key)]
            self.confirmed.pop((peer, key), None)
            p = self.registry.state.providers.get(peer)
            if p is None or p.status in (Status.DEAD, Status.DRAINING):
                continue  # gone or leaving: nothing to tell it
            self._send(peer, Unassign(key=key))
            if want is None and p.stage is not None and p.stage.startswith(prefix):
                self.registry.apply(StageAssigned(peer, None, False, time.monotonic()))

    def _sync(self, plan: Plan) -> None:
        desired = self._desired(plan)
        self._sync_removals(plan, desired)
        keys = self.unit_keys(plan)
        now = time.monotonic()
        for peer, (rk, role, first, end) in sorted(desired.items()):
            p = self.registry.state.providers.get(peer)
            if p is None or p.status in (Status.DEAD, Status.DRAINING):
                continue
            if p.stage != rk or (p.status is Status.ACTIVE) != (role == "active"):
                self.registry.apply(StageAssigned(peer, rk, role == "active", now))
            for pos in range(first, end):
                key = keys[pos]
                before = self.sent.get((peer, key))
                if before == role:
                    continue
                ready = self.confirmed.get((peer, key)) is not None
                if role == "active" and before == "backup" and ready:
                    self._send(peer, Promote(key=key))
                else:
                    index = plan.model.units[pos]
                    sha = plan.model.manifest.stages[index].sha256
                    self._send(
                        peer,
                        Assign(
                            key=key,
                            manifest=plan.model.manifest_bytes,
                            stage=index,
                            url=self.artifact_url(sha),
                            role=role,
                            tls_sha256=self.tls_sha256,
                        ),
                    )
                self.sent[(peer, key)] = role
            self._check_ready(plan, peer)
        if plan.placement is not None:
            self.store.put_placement(plan.model.name, placement_to_json(plan.placement))
        self.notify()

    def artifact_url(self, sha: str) -> str:
        token = self.artifact_token(sha)
        return f"{self.artifact_base}/v1/artifacts/{sha}" + (f"?token={token}" if token else "")

    def _send(self, peer: str, msg: Assign | Unassign | Promote) -> None:
        """Queue `msg` for `peer`; one sender per provider keeps the order."""
        box = self._outbox.get(peer)
        if box is None:
            box = self._outbox[peer] = asyncio.Queue()
            self._senders[peer] = asyncio.create_task(self._sender(peer, box))
        box.put_nowait(msg)

    async def _sender(self, peer: str, box: asyncio.Queue[Assign | Unassign | Promote]) -> None:
        while True:
            msg = await box.get()
            try:
                ack: AssignAck = await self.host.request(peer, ASSIGN, msg, timeout=10.0)
            except P2PError as exc:
                if isinstance(msg, Unassign):
                    continue
                self.events.emit("assign_undelivered", peer=peer, key=msg.key, error=str(exc))
                self.registry.mark_dead(peer, f"could not deliver an assignment: {exc}")
                continue
            if not ack.accepted and not isinstance(msg, Unassign):
                self._failed(peer, msg.key, ack.reason or "refused")
            elif isinstance(msg, Promote):
                self.confirmed[(peer, msg.key)] = "active"
                self.events.emit("stage_promoted", peer=peer, key=msg.key)
                self.notify()

    def _forget(self, peer: str) -> None:
        task = self._senders.pop(peer, None)
        if task is not None:
            task.cancel()
        self._outbox.pop(peer, None)
        for key in [k for k in self.sent if k[0] == peer]:
            del self.sent[key]
        for key in [k for k in self.confirmed if k[0] == peer]:
            del self.confirmed[key]

    # ---- what providers tell us ------------------------------------------------------------

    def on_actions(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, ProviderLost):
                self._forget(action.peer_id)
                cause = "left" if action.graceful else "lost"
                for plan in list(self.plans.values()):
                    self.repair(plan, action.peer_id, cause)
        self.notify()

    def on_joined(self, peer: str) -> None:
        for plan in self.plans.values():
            plan.cannot.pop(peer, None)  # a fresh start: let it try again
        member = [p for p in self.plans.values() if peer in self._members(p)]
        for plan in member:
            self._sync(plan)  # a member re-joined (after a restart): re-send its stages
        for plan in self.plans.values() if not member else []:
            if plan.placement is None:
                self._place(plan)
                continue
            if peer in self._taken_elsewhere(None) or peer not in self.candidates(plan):
                continue
            updated = on_join(plan.placement, peer, plan.spec, self.candidates(plan), self.pcfg)
            if updated != plan.placement:
                self._adopt(plan, updated)
            self._maybe_rebalance(plan)
        # Stages it still holds that no placement wants (it was repaired away while cut
        # off, or a model changed) are dropped, so their memory is free for new ones.
        for key in sorted(self.registry.loaded.get(peer, set())):
            if (peer, key) not in self.sent:
                self._send(peer, Unassign(key=key))

    def on_draining(self, peer: str) -> None:
        """A provider is leaving: its backup takes over now, while it finishes what it has."""
        for plan in list(self.plans.values()):
            if peer in self._members(plan):
                self.repair(plan, peer, "draining")

    def on_loaded(self, peer: str, keys: set[str]) -> None:
        """A heartbeat lists what is loaded: a stage whose ready report was lost counts."""
        changed = False
        for key in keys:
            role = self.sent.get((peer, key))
            if role is not None and (peer, key) not in self.confirmed:
                self.confirmed[(peer, key)] = role
                changed = True
        if changed:
            for plan in self.plans.values():
                self._check_ready(plan, peer)
            self.notify()

    @staticmethod
    def _members(plan: Plan) -> set[str]:
        if plan.placement is None:
            return set()
        return plan.placement.providers() | set(plan.placement.backups.values())

    async def on_status(self, peer: str, msg: StageStatus) -> StatusAck:
        if (peer, msg.key) not in self.sent:
            return StatusAck()  # an assignment since withdrawn
        if msg.state == "ready":
            if self.sent[(peer, msg.key)] != msg.role and self.confirmed.get((peer, msg.key)):
                return StatusAck()  # a late report from before a role change
            self.confirmed[(peer, msg.key)] = msg.role
            self.registry.loaded.setdefault(peer, set()).add(msg.key)
            self.events.emit(
                "stage_ready", peer=peer, key=msg.key, role=msg.role, load_s=round(msg.load_s, 3)
            )
            for plan in self.plans.values():
                if msg.key in self.unit_keys(plan):
                    self._check_ready(plan, peer)
            self.notify()
        else:
            self._failed(peer, msg.key, msg.reason or "failed")
        return StatusAck()

    def _failed(self, peer: str, key: str, reason: str) -> None:
        self.events.emit("stage_failed", peer=peer, key=key, reason=reason)
        for plan in self.plans.values():
            if key in self.unit_keys(plan):
                plan.cannot[peer] = reason
                self.repair(plan, peer, f"could not load {key}: {reason}")

    def _check_ready(self, plan: Plan, peer: str) -> None:
        want = self._desired(plan).get(peer)
        if want is None:
            return
        keys = self.unit_keys(plan)[want[2] : want[3]]
        if all((peer, k) in self.confirmed for k in keys):
            p = self.registry.state.providers.get(peer)
            if p is not None and want[0] not in p.ready:
                self.registry.apply(StageReady(peer, want[0], time.monotonic()))

    def observe(self, peer: str, model: str, work: Workload, seconds: float) -> None:
        """A stage took `seconds` on `peer`: correct its profile towards what we see."""
        plan = self.plans.get(model)
        hw = self.registry.hardware.get(peer)
        if plan is None or hw is None or seconds <= 0:
            return
        predicted = layer_time(plan.spec, hw, work)
        self.registry.apply(StageTimeObserved(peer, predicted, seconds, time.monotonic()))

    # ---- restarts and suspicion ------------------------------------------------------------

    def check_restored(self) -> None:
        """Members of restored placements that did not re-join in time are lost."""
        now = time.monotonic()
        for plan in list(self.plans.values()):
            if plan.restored_until is None or now < plan.restored_until:
                continue
            plan.restored_until = None
            if plan.placement is None:
                continue
            for peer in sorted(self._members(plan)):
                if not self.registry.alive(peer):
                    self.events.emit("provider_missing", peer=peer, model=plan.model.name)
                    self.repair(plan, peer, "did not re-join after the broker restarted")

    async def suspect(self, peer: str, why: str) -> None:
        """A request to `peer` failed: if it does not answer a ping at once, it is lost.
        Reports about a peer already being checked join that check (one ping at a time)."""
        if not self.registry.alive(peer):
            return
        check = self._suspecting.get(peer)
        if check is None:
            check = asyncio.ensure_future(self._ping_or_lose(peer, why))
            self._suspecting[peer] = check
            check.add_done_callback(lambda _: self._suspecting.pop(peer, None))
        await asyncio.shield(check)

    async def _ping_or_lose(self, peer: str, why: str) -> None:
        try:
            await self.host.request(peer, PING, Ping(nonce=0), timeout=1.0)
        except P2PError as exc:
            self.registry.mark_dead(peer, f"{why}; ping failed: {exc}")

    # ---- routes ----------------------------------------------------------------------------

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    async def pick(
        self, model: str, pos: int, avoid: set[str], load: Mapping[str, int], timeout: float
    ) -> str | None:
        """The least loaded provider serving stage `pos` of `model`, preferring those not in
        `avoid`; waits up to `timeout` seconds for one (None if none comes)."""
        deadline = time.monotonic() + timeout
        while True:
            route = self.route(model)
            peers = route[pos] if route is not None and pos < len(route) else []
            if peers:
                fresh = [p for p in peers if p not in avoid] or peers
                return min(fresh, key=lambda p: (load.get(p, 0), p))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self.changed(min(left, 1.0))

    def route(self, model: str) -> list[list[str]] | None:
        """Per provider stage (pipeline order), the providers serving it now; None if the
        model is unknown or not placed."""
        plan = self.plans.get(model)
        if plan is None or plan.placement is None:
            return None
        keys = self.unit_keys(plan)
        out: list[list[str]] = [[] for _ in keys]
        for rep in plan.placement.replicas:
            for st in rep.stages:
                if not self.registry.alive(st.provider):
                    continue
                for pos in range(st.first, st.end):
                    if self.confirmed.get((st.provider, keys[pos])) == "active":
                        out[pos].append(st.provider)
        return out

    def describe(self, model: str) -> dict[str, Any]:
        plan = self.plans[model]
        keys = self.unit_keys(plan)
        route = self.route(model) or [[] for _ in keys]
        backups: dict[int, list[str]] = {}
        if plan.placement is not None:
            for (r, s), peer in plan.placement.backups.items():
                st = plan.placement.replicas[r].stages[s]
                for pos in range(st.first, st.end):
                    if self.confirmed.get((peer, keys[pos])) is not None:
                        backups.setdefault(pos, []).append(peer)
        stages = []
        for pos, key in enumerate(keys):
            info = plan.model.manifest.stages[plan.model.units[pos]]
            stages.append(
                {
                    "key": key,
                    "index": info.index,
                    "name": info.name,
                    "providers": [self.peer_info(p) for p in route[pos]],
                    "backups": backups.get(pos, []),
                }
            )
        return {
            "model": model,
            "placed": plan.placement is not None,
            "ready": all(route) and bool(route),
            "waiting": plan.waiting_reason,
            "throughput_tokens_s": round(plan.placement.throughput, 1) if plan.placement else 0,
            "stages": stages,
        }

    def peer_info(self, peer: str) -> dict[str, Any]:
        profile = self.registry.profiles.get(peer)
        return {"peer_id": peer, "addrs": list(profile.addrs) if profile else []}

    async def close(self) -> None:
        for task in self._senders.values():
            task.cancel()
        await asyncio.gather(*self._senders.values(), return_exceptions=True)
        self._senders.clear()
