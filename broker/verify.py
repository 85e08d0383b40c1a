"""Spot checks of providers' answers, reputation, and quarantine.

Strangers compute our users' jobs, so the broker checks them. A fraction `verify_fraction` of
the FORWARD tasks of batch jobs and embedding requests is run again for a second opinion:
on another provider that holds the same stage (a backup standing by with it first: it is
idle), or, when none does, by the broker itself, which keeps every stage's validated ONNX
file. Answers are compared within a tolerance (`agree`). When they differ, the broker runs
the stage itself as the referee, and every provider whose answer differs from the referee's
is quarantined: it leaves the pool (its backup takes over), its joins are refused from then
on, and the results it computed in the last `verify_redo_s` seconds are redone.

Which tasks are checked: of each provider's tasks of each stage, one in every 1/fraction,
from a random phase. A provider cannot tell which of its answers are checked, and one that
answers wrongly is caught within ceil(1/fraction) of its tasks of a stage.

Reputation (checks, agreements, disagreements, quarantine and its reason) is kept in SQLite
and shown in `GET /v1/providers` and the dashboard.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from broker.config import BrokerConfig
from broker.core.pool import Status
from broker.events import EventLog
from broker.models import ModelStore
from broker.registry import Registry
from broker.store import Store
from ir.checks import agree, empty_cache, probe_feeds
from ir.executors.ort import OrtExecutor
from ir.pipeline import key_mask, zero_adapters
from p2p import P2PError, RemoteError, RequestTimeout, Tensor
from p2p.codec import Message, ProtocolSpec
from proto.api import swarm as api
from proto.forward import FORWARD, Forward, ForwardResult
from proto.session import SESSION, SessionClose, SessionOpen, SessionStep

log = logging.getLogger("fusionai.broker")
Array = np.ndarray[Any, Any]

PROBE_EVERY_S = 10.0  # at most one probe of a provider this often (reports can be spam)
BROKER = "broker"  # the second opinion or referee computed by the broker itself
LOCAL_STAGES = 4  # stages the broker keeps loaded for checks (least recently used dropped)


@dataclass
class Reputation:
    checks: int = 0  # answers of this provider that were checked
    agreed: int = 0
    disagreed: int = 0
    quarantined: float | None = None  # Unix time it was quarantined
    reason: str = ""

    def view(self) -> api.Reputation:
        return api.Reputation(
            checks=self.checks,
            agreed=self.agreed,
            disagreed=self.disagreed,
            quarantined=self.quarantined is not None,
            quarantined_at=self.quarantined,
            reason=self.reason,
        )


class Verifier:
    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        events: EventLog,
        registry: Registry,
        models: ModelStore,
        request: Callable[[str, ProtocolSpec, Message], Awaitable[asyncio.Future[Any] | None]],
        rng: random.Random,
        clock: Callable[[], float],
        on_quarantine: Callable[[str, dict[str, int]], None] = lambda peer, redo: None,
    ) -> None:
        """`request`: a request to a peer unless it is declared lost (`StageCalls.check`);
        `on_quarantine(peer, dropped)`: a quarantined peer's results were dropped (job id ->
        microbatches), so the jobs can run again for them."""
        self.config = config
        self.rng = rng  # unpredictable in service (which tasks are checked, by whom)
        self.clock = clock
        self.store = store
        self.events = events
        self.registry = registry
        self.models = models
        self.request = request  # send a request to a peer, unless it is declared lost
        self.reputation: dict[str, Reputation] = {
            peer: Reputation(
                r["checks"], r["agreed"], r["disagreed"], r["quarantined"], r["reason"]
            )
            for peer, r in store.reputations().items()
        }
        registry.quarantined = {
            p: r.reason for p, r in self.reputation.items() if r.quarantined is not None
        }
        self.phase: dict[tuple[str, str], float] = {}  # (stage key, peer) -> checks owed, in [0, 1)
        self.answered: dict[
            str, int
        ] = {}  # peer -> FORWARD tasks answered since this broker started
        self.answered_stage: dict[tuple[str, str], int] = {}  # (peer, stage key) -> the same
        self.on_quarantine = on_quarantine
        self._local: OrderedDict[str, OrtExecutor] = OrderedDict()
        self._local_lock = asyncio.Lock()
        self._probed: dict[str, tuple[float, bool | None]] = {}  # peer -> (when, verdict)

    def quarantined(self, peer: str) -> bool:
        return peer in self.registry.quarantined

    def count(self, peer: str, key: str) -> int:
        """One more task of stage `key` answered by `peer`; its number among that stage's tasks
        it answered (`caught_at` counts in these: the spot checks' schedule is per stage)."""
        self.answered[peer] = self.answered.get(peer, 0) + 1
        self.answered_stage[(peer, key)] = n = self.answered_stage.get((peer, key), 0) + 1
        return n

    def due(self, key: str, peer: str) -> bool:
        """Whether this task of stage `key` on `peer` is checked: one in every 1/fraction of
        each provider's tasks of each stage (a provider serving a stage beside replicas is
        checked as often as one serving it alone)."""
        fraction = self.config.verify_fraction
        if fraction <= 0:
            return False
        owed = self.phase.get((key, peer), self.rng.random()) + fraction
        self.phase[(key, peer)] = owed % 1.0 if owed >= 1.0 else owed
        return owed >= 1.0

    def owe(self, key: str, peer: str) -> None:
        """A task of stage `key` on `peer` due a check got no answer: its next task of the
        stage is due instead (a failed call never costs a check)."""
        fraction = self.config.verify_fraction
        if fraction > 0:
            owed = self.phase.get((key, peer), 0.0)
            self.phase[(key, peer)] = max(owed, 1.0 - fraction + 1e-9)
            self.events.emit("check_owed", peer=peer, stage=key)

    async def check(
        self, model: str, pos: int, key: str, peer: str, msg: Forward, out: Array, nth_task: int
    ) -> tuple[Array, str]:
        """Check `peer`'s answer `out` to `msg`, the `nth_task` task it was given: (the answer
        to use, who computed it). A peer found wrong is quarantined before this returns (the
        referee's answer is used)."""
        started = time.perf_counter()
        nth = {peer: nth_task}  # which of its tasks each one checked is
        try:
            second, who = await self.second_opinion(model, pos, key, peer, msg)
        except Exception as exc:  # e.g. the broker cannot load the stage: the task goes on
            log.warning("cannot check %s on %s: %s", key, peer, exc)
            self.events.emit("check_skipped", peer=peer, stage=key, reason=str(exc))
            return out, peer
        nth[who] = self.answered_stage.get((who, key), 0)
        ok, diff = agree(out, second, self.config.verify_rtol, self.config.verify_atol)
        if ok:
            self.record(peer, True)
            if who != BROKER:
                self.record(who, True)
            self.events.emit(
                "result_checked",
                peer=peer,
                stage=key,
                against=who,
                diff=diff,
                seconds=round(time.perf_counter() - started, 4),
            )
            return out, peer
        referee = second if who == BROKER else await self.run_local(model, pos, _arrays(msg))
        verdicts = [(peer, out)] + ([(who, second)] if who != BROKER else [])
        for p, answer in verdicts:
            good, d = agree(answer, referee, self.config.verify_rtol, self.config.verify_atol)
            self.record(p, good)
            if not good:
                self.quarantine(
                    p,
                    f"its answer for {key} differs from the broker's by {d:.3g} (tolerance "
                    f"{self.config.verify_atol:g} + {self.config.verify_rtol:g} x scale)",
                    nth[p],
                )
        if self.quarantined(peer):
            return referee, BROKER
        return out, peer

    async def second_opinion(
        self, model: str, pos: int, key: str, peer: str, msg: Forward
    ) -> tuple[Array, str]:
        """Another provider's answer (backups standing by with the stage first), else the
        broker's own."""
        state = self.registry.core.pool.providers
        holders = self.registry.holders(key, {peer})
        holders.sort(key=lambda p: (state[p].status is not Status.BACKUP, self.rng.random()))
        check = msgspec.structs.replace(msg, check=True)
        for other in holders[:2]:
            started = time.perf_counter()
            try:
                answer: ForwardResult = await self._ask(other, FORWARD, check)
            except (RemoteError, RequestTimeout, P2PError) as exc:
                log.info("a spot check on %s failed (%s); trying elsewhere", other, exc)
                continue
            self.count(other, key)
            second = answer.outputs.get("hidden_states_out")
            if second is not None:
                try:
                    hidden = second.to_numpy()
                except ValueError:
                    pass
                else:  # its speed is seen (a backup's, too), as timed here
                    self.registry.timed(other, model, hidden.shape, time.perf_counter() - started)
                    return hidden, other
            self.record(other, False)  # an answer that is no answer counts against it
        return await self.run_local(model, pos, _arrays(msg)), BROKER

    async def run_local(self, model: str, pos: int, feeds: dict[str, Array]) -> Array:
        """Run provider stage `pos` of `model` here (no adapter, no tokens cached)."""
        stored = self.models.models[model]
        info = stored.manifest.stages[stored.units[pos]]
        async with self._local_lock:  # one stage loads at a time (memory)
            executor = self._local.get(info.sha256)
            if executor is None:
                path = stored.directory / info.file
                # (checks come now and then: idle threads sleep, not spin)
                executor = await asyncio.to_thread(
                    OrtExecutor, path, inputs=info.inputs, spinning=False
                )
                self._local[info.sha256] = executor
                while len(self._local) > LOCAL_STAGES:
                    self._local.popitem(last=False)
            self._local.move_to_end(info.sha256)
        seq = int(feeds["hidden_states"].shape[1]) if "hidden_states" in feeds else 0
        feeds = {**zero_adapters(info), **empty_cache(info), **key_mask(info, 1, seq), **feeds}
        out = await asyncio.to_thread(executor.run, feeds)
        return np.asarray(out["hidden_states_out"])

    async def probe(self, peer: str, model: str, pos: int) -> bool | None:
        """Run made-up inputs through `peer`'s stage `pos` of `model` and compare with the
        broker's own run (someone says its answers are wrong). A wrong answer quarantines
        it. Returns whether it agreed (None: it could not be asked). One probe per provider
        per `PROBE_EVERY_S`; a repeated report gets the last verdict."""
        if self.quarantined(peer):
            return False
        last = self._probed.get(peer)
        if last is not None and self.clock() - last[0] < PROBE_EVERY_S:
            return last[1]
        self._probed[peer] = (self.clock(), None)
        stored = self.models.models[model]
        info = stored.manifest.stages[stored.units[pos]]
        key = stored.unit_key(info.index)
        feeds, cached = probe_feeds(info, seed=self.rng.randrange(1 << 30))
        inputs = {k: Tensor.from_numpy(v) for k, v in feeds.items()}
        answer: Any = None
        try:
            if cached:
                sid = f"probe-{self.rng.randrange(1 << 62):x}"
                await self._ask(peer, SESSION, SessionOpen(session=sid, stage=key, check=True))
                answer = await self._ask(
                    peer, SESSION, SessionStep(session=sid, stage=key, inputs=inputs)
                )
                try:
                    await self._ask(peer, SESSION, SessionClose(session=sid, stage=key))
                except (RemoteError, RequestTimeout, P2PError):
                    pass
            else:
                answer = await self._ask(
                    peer, FORWARD, Forward(stage=key, inputs=inputs, check=True)
                )
        except (RemoteError, RequestTimeout, P2PError) as exc:
            log.info("probe of %s on %s failed: %s", key, peer, exc)
            return None
        self.count(peer, key)
        tensor = answer.outputs.get("hidden_states_out") if answer is not None else None
        try:
            theirs: Array | None = tensor.to_numpy() if tensor is not None else None
        except ValueError:
            theirs = None
        ours = await self.run_local(model, pos, feeds)
        good, diff = (
            agree(theirs, ours, self.config.verify_rtol, self.config.verify_atol)
            if theirs is not None
            else (False, float("inf"))
        )
        self.record(peer, good)
        self._probed[peer] = (self.clock(), good)
        self.events.emit("provider_probed", peer=peer, stage=key, agreed=good, diff=diff)
        if not good:
            self.quarantine(
                peer,
                f"its answer for {key} to the broker's probe differs from the broker's by "
                f"{diff:.3g}",
                self.answered_stage[(peer, key)],
            )
        return good

    async def report(
        self, peer: str, model: str, pos: int, reason: str
    ) -> tuple[bool | None, bool]:
        """A client's shadow step disagreed with `peer`'s answer: probe it. Returns (the
        probe's verdict, as `probe`; whether `peer` is quarantined now)."""
        stored = self.models.models[model]
        key = stored.unit_key(stored.units[pos])
        self.events.emit("provider_reported", peer=peer, stage=key, reason=reason)
        agreed = await self.probe(peer, model, pos)
        return agreed, self.quarantined(peer)

    async def _ask(self, peer: str, spec: ProtocolSpec, msg: Message) -> Any:
        call = await self.request(peer, spec, msg)
        if call is None:
            raise P2PError(f"{peer} was declared lost")
        return call.result()

    def record(self, peer: str, agreed: bool) -> None:
        """One more check of `peer`'s answers, agreed or not (its reputation)."""
        r = self.reputation.setdefault(peer, Reputation())
        r.checks += 1
        if agreed:
            r.agreed += 1
        else:
            r.disagreed += 1
        self._save(peer, r)

    def _save(self, peer: str, r: Reputation) -> None:
        self.store.put_reputation(peer, r.checks, r.agreed, r.disagreed, r.quarantined, r.reason)

    def quarantine(self, peer: str, reason: str, caught_at: int | None = None) -> None:
        """Take `peer` out of the pool for good and redo its recent work (`caught_at`: which
        of its answers for the stage found wrong, since this broker started, it was)."""
        if self.quarantined(peer):
            return
        r = self.reputation.setdefault(peer, Reputation())
        r.quarantined, r.reason = time.time(), reason
        self._save(peer, r)
        redo = self.store.forget_work(peer, time.time() - self.config.verify_redo_s)
        self.events.emit(
            "provider_quarantined",
            peer=peer,
            reason=reason,
            caught_at=caught_at,
            answered=self.answered.get(peer, 0),
            redo=redo,
        )
        log.warning("quarantined %s: %s", peer, reason)
        self.registry.quarantine(peer, reason)
        self.on_quarantine(peer, redo)

    def summary(self, peer: str) -> api.Reputation:
        return self.reputation.get(peer, Reputation()).view()

    def quarantined_list(self) -> list[api.Quarantined]:
        return [
            api.Quarantined(peer_id=p, **msgspec.structs.asdict(r.view()))
            for p, r in sorted(self.reputation.items())
            if r.quarantined is not None
        ]


def _arrays(msg: Forward) -> dict[str, Array]:
    return {k: t.to_numpy() for k, t in msg.inputs.items()}
