"""The decision core in-process: what the broker decides when providers come and go, models
share a pool and jobs queue, each step an event in and actions out, on a virtual clock."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core import Core, CoreConfig
from broker.core.actions import (
    Action,
    AssignStage,
    Notice,
    PlacementChanged,
    PromoteBackup,
    PromoteStage,
    ProviderLost,
    Replan,
    StartJob,
    UnassignStage,
)
from broker.core.events import (
    AssignAnswered,
    ClockTicked,
    HeartbeatReceived,
    HeartbeatsMissed,
    Input,
    JobEnded,
    JobQueued,
    ModelAdded,
    ModelUsed,
    ProviderJoined,
    ProviderLeft,
    RebalanceCheck,
    StageReported,
    StageTimed,
)
from broker.core.placement import PlacementConfig
from broker.core.pool import PoolConfig
from dag.cost import HardwareProfile, Workload
from dag.model import ModelSpec

WORK = Workload(tokens=256, sequences=8, context=128)
CONFIG = CoreConfig(
    pool=PoolConfig(heartbeat_interval=1.0, missed_heartbeats=3, flap_threshold=3),
    placement=PlacementConfig(work=WORK, max_replicas=1),
    restart_grace_s=5.0,
)


def spec(name: str = "m", blocks: int = 4) -> ModelSpec:
    return ModelSpec(
        name,
        n_layers=blocks,
        layer_flops_per_token=1e9,
        layer_attn_flops_per_token_per_context=0.0,
        layer_param_bytes=1e9,
        layer_kv_bytes_per_token=0.0,
        hidden_bytes_per_token=1e3,
    )


def gpu(tflops: float = 10.0, memory: float = 2.5e9, name: str = "gpu") -> HardwareProfile:
    """2.5 GB holds two blocks of `spec`, 5 GB four."""
    return HardwareProfile(name, {"float16": tflops * 1e12}, memory, 500e9, 100e6)


class Swarm:
    """A core, a virtual clock, and providers that load what they are told."""

    def __init__(self, config: CoreConfig = CONFIG) -> None:
        self.core = Core(config)
        self.t = 0.0
        self.actions: list[Action] = []
        self.todo: list[AssignStage | PromoteStage] = []

    def send(self, event: Input) -> list[Action]:
        out = self.core.handle(event)
        self.actions += out
        self.todo += [a for a in out if isinstance(a, AssignStage | PromoteStage)]
        return out

    def tick(self, seconds: float) -> list[Action]:
        """Time passes; every live provider sent its heartbeats meanwhile."""
        self.t += seconds
        out = []
        for peer in sorted(self.core.pool.providers):
            if self.core.alive(peer):
                out += self.send(HeartbeatReceived(peer, self.t))
        return out + self.send(ClockTicked(self.t))

    def join(self, *peers: str, profile: HardwareProfile | None = None) -> None:
        for peer in peers:
            self.send(ProviderJoined(peer, profile or gpu(), self.t))

    def add(self, model: str = "m", blocks: int = 4, restored: Any = None) -> list[Action]:
        keys = tuple(f"{model}/{i}" for i in range(blocks))
        return self.send(ModelAdded(model, spec(model, blocks), keys, self.t, restored))

    def settle(self) -> None:
        """Providers still alive load what they were assigned and take what they were
        promoted to."""
        while self.todo:
            a = self.todo.pop(0)
            if not self.core.alive(a.peer_id):
                continue
            if isinstance(a, AssignStage):
                self.send(StageReported(a.peer_id, (a.key,), a.role, True, self.t))
            else:
                self.send(AssignAnswered(a.peer_id, a.key, "promote", True, self.t))

    def route(self, model: str = "m") -> list[list[str]]:
        route = self.core.route(model)
        assert route is not None
        return route

    def placed(self, model: str = "m") -> list[list[str]]:
        placement = self.core.plans[model].placement
        assert placement is not None
        return [[st.provider for st in rep.stages] for rep in placement.replicas]

    def notices(self, kind: str) -> list[dict[str, Any]]:
        return [a.data for a in self.actions if isinstance(a, Notice) and a.kind == kind]


def restored(replicas: list[list[tuple[str, int, int]]], backups: dict[tuple[int, int], str],
             spares: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    return {
        "replicas": [[[p, a, b, 0.01] for p, a, b in rep] for rep in replicas],
        "backups": [[r, s, p] for (r, s), p in backups.items()],
        "spares": list(spares),
        "tokens": WORK.tokens,
    }


def test_a_model_is_placed_loaded_and_routed_and_a_crash_goes_to_its_warm_backup() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d", "e", "f")
    out = s.add()
    placed = s.placed()
    assert len(placed[0]) >= 2 and sum(isinstance(a, AssignStage) for a in out) == 6
    assert isinstance(out[-1], PlacementChanged)  # persisted as placed
    assert s.core.route("m") == [[], [], [], []]  # nothing confirmed yet
    s.settle()
    route = s.route()
    assert all(len(peers) == 1 for peers in route)
    plan = s.core.plans["m"]
    assert plan.placement is not None and plan.placement.backups
    (r, i), backup = sorted(plan.placement.backups.items())[0]
    victim = plan.placement.replicas[r].stages[i].provider
    out = s.send(HeartbeatsMissed(victim, 1.0))
    assert isinstance(out[0], Notice) and out[0].kind == "provider_lost"
    assert ProviderLost(victim, f"m@{i}-{i + 1}", graceful=False) in out
    assert PromoteBackup("m", backup, f"m@{i}-{i + 1}", victim) in out
    assert PromoteStage(backup, f"m/{i}") in out  # it has the stage loaded: promote, no load
    assert all(victim not in peers for peers in s.route())
    s.settle()
    assert s.route()[i] == [backup]
    assert s.notices("model_repaired")[-1]["moves"] == [[i, i + 1, victim, backup]]


def test_a_crash_with_no_warm_backup_is_a_replan_found_by_missed_heartbeats() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d", profile=gpu(memory=5e9))
    s.add(restored=restored([[("a", 0, 1), ("b", 1, 2), ("c", 2, 4)]], {}, ("d",)))
    s.settle()
    assert [len(p) for p in s.route()] == [1, 1, 1, 1]
    s.tick(1.0)
    s.t += 3.5  # "b" says nothing for 3.5 heartbeat intervals; the others do
    for peer in ("a", "c", "d"):
        s.send(HeartbeatReceived(peer, s.t))
    out = s.send(ClockTicked(s.t))
    assert ProviderLost("b", "m@1-2", graceful=False) in out
    replan = [a for a in out if isinstance(a, Replan)]
    assert replan and "none had it loaded" in replan[0].reason
    assert AssignStage("d", "m", "m/1", 1, "active") in out  # the spare loads it cold
    assert s.route()[1] == []
    s.settle()
    assert s.route()[1] == ["d"]


def test_a_flapping_backup_is_passed_over_for_a_steady_spare() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d", "e")
    for _ in range(3):  # "e" comes and goes
        s.send(ProviderLeft("e", s.t))
        s.t += 1.0
        s.join("e")
    assert s.core.pool.providers["e"].flapping(s.t, s.core.pool.config)
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {(0, 1): "e"}, ("c", "d")))
    out = s.send(HeartbeatsMissed("b", s.t))  # before anyone loaded anything: all are cold
    repaired = s.notices("model_repaired")[-1]
    assert repaired["moves"] == [[2, 4, "b", "c"]], repaired  # not its backup "e": flapping
    assert any(isinstance(a, Replan) for a in out)


def test_a_steady_backup_goes_before_spares_even_when_cold() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d", "e")
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {(0, 1): "e"}, ("c", "d")))
    s.send(HeartbeatsMissed("b", s.t))
    assert s.notices("model_repaired")[-1]["moves"] == [[2, 4, "b", "e"]]


def test_a_warm_flapping_backup_still_goes_before_a_cold_spare() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d", "e")
    for _ in range(3):
        s.send(ProviderLeft("e", s.t))
        s.t += 1.0
        s.join("e")
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {(0, 1): "e"}, ("c", "d")))
    s.settle()
    out = s.send(HeartbeatsMissed("b", s.t))
    assert PromoteBackup("m", "e", "m@2-4", "b") in out


def test_two_models_share_the_pool_and_the_second_may_take_the_first_ones_backups() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d")
    s.add("m1", blocks=2)
    s.settle()
    first = s.core.plans["m1"].placement
    assert first is not None and first.backups and not first.spares
    serving = first.providers()
    # m2 fits only on m1's backups and spares: it takes them to serve (not to stand by)
    out = s.add("m2", blocks=2)
    second = s.core.plans["m2"].placement
    assert second is not None and not second.providers() & serving
    taken = s.notices("backups_taken")
    assert taken and taken[0]["model"] == "m1" and taken[0]["by"] == "m2"
    assert not set(taken[0]["peers"]) & serving
    unassigned = {a.peer_id for a in out if isinstance(a, UnassignStage)}
    assert unassigned == set(taken[0]["peers"]) & set(first.backups.values())
    s.settle()
    assert all(s.route("m1")) and all(s.route("m2"))
    assert not s.core.plans["m1"].placement.backups  # type: ignore[union-attr]


def test_a_join_during_a_job_is_rebalanced_once_the_model_is_idle() -> None:
    s = Swarm()
    s.join("a", "b", profile=gpu(tflops=1.0, memory=5e9))
    s.add(blocks=4)
    s.settle()
    s.send(JobQueued("j1", "m", created=0.0, estimate_s=10.0, at=s.t))
    assert StartJob("j1", "m", None) in s.actions
    s.join("x", "y", "z", profile=gpu(tflops=20.0, memory=5e9))
    assert not s.notices("model_rebalanced")  # put off: a job runs on the model
    assert s.core.plans["m"].rebalance_due
    s.send(ModelUsed("m", 1, s.t))  # a generation session too
    s.send(JobEnded("j1", s.t))
    assert not s.notices("model_rebalanced")  # the session still uses it
    s.send(ModelUsed("m", -1, s.t))
    rebalanced = s.notices("model_rebalanced")
    assert rebalanced and rebalanced[0]["throughput_tokens_s"] > rebalanced[0]["before_tokens_s"]
    assert {"x", "y", "z"} & {peer for rep in s.placed() for peer in rep}


def test_a_newcomer_moves_no_served_block_before_its_stage_times_are_seen() -> None:
    """With `observe_before_moving` (the broker's default), a newcomer claiming to be 20x
    faster stands by: the model stays served where it is, at the join and at later checks.
    Once one of its stage times has been seen (a spot check's second opinion, as a backup),
    a rebalance may move blocks onto it."""
    from dataclasses import replace

    from dag.cost import layer_time

    s = Swarm(replace(CONFIG, observe_before_moving=1))
    s.join("a", "b", profile=gpu(tflops=1.0, memory=5e9))
    s.add(blocks=4)
    s.settle()
    before, route = s.placed(), s.route()
    fast = gpu(tflops=20.0, memory=5e9)
    s.join("x", profile=fast)
    s.settle()
    s.send(RebalanceCheck(s.t))
    assert not s.notices("model_rebalanced")
    assert s.placed() == before and s.route() == route and all(route)
    plan = s.core.plans["m"]
    assert plan.placement is not None and "x" in plan.members() | set(plan.placement.spares)
    seconds = layer_time(plan.spec, fast, WORK)  # as fast as it claims
    s.send(StageTimed("x", "m", WORK, seconds, s.t))
    s.send(RebalanceCheck(s.t))
    assert s.notices("model_rebalanced")
    assert "x" in {peer for rep in s.placed() for peer in rep}


@pytest.mark.parametrize("observe", [1, 0])
def test_a_newcomer_that_comes_and_goes_leaves_a_served_model_served(observe: int) -> None:
    """Two models, one served by a and b, one waiting for room. A newcomer claiming 20x their
    speed joins, then leaves. Trusting its claim (0), the broker moves the first model onto
    it, gives a and b to the second, and when it leaves the first is left unplaced. Waiting to
    see its speed (1), the first stays where it is; the newcomer serves the waiting one."""
    from dataclasses import replace

    s = Swarm(replace(CONFIG, observe_before_moving=observe))
    s.join("a", "b", profile=gpu(tflops=1.0, memory=5e9))
    s.add("m", blocks=8)  # needs both
    s.add("m2", blocks=4)  # no room: waits
    s.settle()
    route = s.route("m")
    assert all(route) and s.core.plans["m2"].placement is None
    s.join("x", profile=gpu(tflops=20.0, memory=10e9))
    s.settle()
    s.send(ProviderLeft("x", s.t))
    s.settle()
    if observe:
        assert s.route("m") == route and not s.notices("model_rebalanced")
        assert s.notices("model_placed")[-1]["model"] == "m2"  # x served it while it was here
    else:
        assert s.notices("model_rebalanced") and s.core.plans["m"].placement is None


def test_the_current_placement_is_rescored_with_observed_times_and_unseen_twins_get_the_prior(
) -> None:  # fmt: skip
    s = Swarm()
    s.join("a", "b", profile=gpu(name="rtx"))
    s.add(blocks=4)
    s.settle()
    work = Workload(tokens=256, sequences=8, context=128, dtype="float16")
    plan = s.core.plans["m"]
    first = plan.placement
    assert first is not None
    slow = first.replicas[0].stages[0].provider
    predicted = s.core.candidates(plan)[slow]
    for _ in range(5):  # it runs three times slower than its profile says
        from dag.cost import layer_time

        s.send(StageTimed(slow, "m", work, 3 * layer_time(plan.spec, predicted, work), s.t))
    assert s.core.pool.providers[slow].correction.factor == pytest.approx(3.0)
    s.join("twin", profile=gpu(name="rtx"))  # same hardware, never seen running a stage
    assert s.core.candidates(plan)["twin"].slowdown == pytest.approx(3.0)  # the median prior
    s.join("fresh", profile=gpu(name="other"))  # other hardware: the median of all seen
    assert s.core.candidates(plan)["fresh"].slowdown == pytest.approx(3.0)
    s.send(RebalanceCheck(s.t))
    for event in s.notices("model_rebalanced"):
        # the placement it replaced was rated with today's corrections, not its old figure
        assert event["before_tokens_s"] < round(first.throughput, 1)


def test_sjf_bsbf_lets_a_short_job_share_a_long_ones_route_and_it_keeps_it_after() -> None:
    s = Swarm(CoreConfig(pool=CONFIG.pool, placement=CONFIG.placement, queue_policy="sjf-bsbf"))
    s.join("a", "b")
    s.add(blocks=2)
    s.settle()
    s.send(JobQueued("long", "m", created=0.0, estimate_s=1000.0, at=s.t))
    s.send(JobQueued("next", "m", created=1.0, estimate_s=900.0, at=s.t))
    s.send(JobQueued("short", "m", created=2.0, estimate_s=10.0, at=s.t))
    starts = [a for a in s.actions if isinstance(a, StartJob)]
    assert starts[0] == StartJob("long", "m", None)
    # "short" shares the one route with "long" (waiting would cost it ~1000 s); "next" would
    # not gain enough and waits
    assert StartJob("short", "m", "long") in starts
    assert "next" in s.core.queue.queued
    assert s.core.queue.running["long"].partner == "short"
    s.send(JobEnded("long", s.t))  # the guest carries on, holding the route now
    assert s.core.queue.running["short"].held == 1 and s.core.queue.running["short"].partner is None
    assert "next" in s.core.queue.queued
    s.send(JobEnded("short", s.t))
    assert StartJob("next", "m", None) in s.actions


def test_fifo_starts_jobs_in_arrival_order_as_routes_free_up() -> None:
    s = Swarm()
    s.join("a", "b")
    s.send(JobQueued("j1", "m", created=0.0, estimate_s=5.0, at=s.t))  # before the model
    s.add(blocks=2)
    assert not any(isinstance(a, StartJob) for a in s.actions)  # no route yet
    s.send(JobQueued("j2", "m", created=1.0, estimate_s=1.0, at=s.t))
    s.settle()
    starts = [a.job for a in s.actions if isinstance(a, StartJob)]
    assert starts == ["j1"]
    s.send(JobEnded("j1", s.t))
    assert [a.job for a in s.actions if isinstance(a, StartJob)] == ["j1", "j2"]


def test_a_draining_provider_hands_its_stage_to_its_backup_at_once() -> None:
    s = Swarm()
    s.join("a", "b", "c")
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {(0, 1): "c"}))
    s.settle()
    out = s.send(HeartbeatReceived("b", s.t, draining=True))
    assert s.notices("provider_draining")
    assert PromoteBackup("m", "c", "m@2-4", "b") in out
    assert s.core.pool.providers["b"].status == "draining"


def test_an_answer_to_an_overtaken_assignment_decides_nothing() -> None:
    s = Swarm()
    s.join("a", "b", "c", "d")
    s.add()
    s.settle()
    peer = s.placed()[0][0]
    s.send(ProviderLeft(peer, s.t))  # what it was sent is void now
    before = len(s.actions)
    s.send(AssignAnswered(peer, "m/0", "assign", False, s.t, "late refusal"))
    s.send(AssignAnswered(peer, "m/0", "promote", True, s.t))
    assert s.actions[before:] == []
    assert peer not in s.core.plans["m"].cannot and peer not in s.core.confirmed


def test_the_driver_carries_out_every_decision_when_a_carrier_fails_and_none_once_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from broker.driver import CoreDriver

    driver = CoreDriver(Core(CONFIG))
    carried: list[Action] = []
    woken: list[float] = []

    def broken(action: Action) -> None:
        raise OSError("disk full")

    driver.carry(Notice, broken)
    driver.carry(Notice, carried.append)
    driver.after(lambda: woken.append(driver.core.now))
    out = driver.handle(ProviderJoined("a", gpu(), 1.0))
    assert carried == [a for a in out if isinstance(a, Notice)] and len(carried) == 1
    assert woken == [1.0]
    assert "carrying out Notice failed" in caplog.text
    driver.stop()  # the broker is shutting down
    assert driver.handle(ProviderJoined("b", gpu(), 2.0)) == []
    assert "b" not in driver.core.pool.providers and len(carried) == 1


@pytest.mark.parametrize(
    "stored",
    [
        restored([[("a", 0, 2), ("b", 2, 4)]], {(0, -1): "e"}),  # a backup of no stage
        restored([[("a", 0, 2), ("b", 2, 4)]], {(1, 0): "e"}),
        restored([[("a", 0, 2), ("a", 2, 4)]], {}),  # one provider in two stages
        restored([[("a", 0, 2), ("b", 2, 3)]], {}),  # short of the model's 4 units
        {"replicas": "not a list"},
    ],
)
def test_a_stored_placement_that_does_not_fit_is_placed_afresh(stored: dict[str, Any]) -> None:
    from broker.core.plans import checked_placement

    assert checked_placement(stored, 4) is None
    assert checked_placement(restored([[("a", 0, 2), ("b", 2, 4)]], {(0, 1): "e"}), 4)


def test_a_restored_placements_member_that_does_not_rejoin_in_time_is_repaired() -> None:
    s = Swarm()
    s.join("a", "c")  # "b" was placed before the restart but does not come back
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {}, ("c",)))
    s.settle()
    assert s.route()[2:] == [[], []]
    s.tick(4.0)
    assert not s.notices("provider_missing")  # still within the grace period
    s.tick(2.0)
    assert s.notices("provider_missing") == [{"model": "m"}]
    s.settle()
    assert s.route()[2:] == [["c"], ["c"]]


def test_a_stage_that_fails_to_load_is_placed_elsewhere_and_not_offered_again() -> None:
    s = Swarm()
    s.join("a", "b", "c")
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {}, ("c",)))
    out = s.send(StageReported("b", ("m/2",), "active", False, s.t, reason="out of memory"))
    assert s.notices("stage_failed")[0]["reason"] == "out of memory"
    assert "b" in s.core.plans["m"].cannot
    assert AssignStage("c", "m", "m/2", 2, "active") in out
    s.join("b")  # a fresh start: it may try again
    assert "b" not in s.core.plans["m"].cannot


def test_a_lost_ready_report_is_made_up_by_the_heartbeat_and_late_reports_are_ignored() -> None:
    s = Swarm()
    s.join("a", "b")
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {}))
    s.todo.clear()  # every report is lost
    s.send(HeartbeatReceived("a", s.t, loaded=frozenset({"m/0", "m/1"})))
    assert s.route()[:2] == [["a"], ["a"]]
    s.send(StageReported("a", ("m/3",), "active", True, s.t))  # never sent to it: ignored
    assert s.route()[3] == []
    out = s.send(HeartbeatReceived("zzz", s.t))  # never met: join again
    assert [type(a).__name__ for a in out] == ["AskToRejoin"]


def test_same_events_same_decisions() -> None:
    def run() -> list[Action]:
        s = Swarm()
        s.join("a", "b", "c", "d", "e", "f", "g")
        s.add()
        s.settle()
        s.send(HeartbeatsMissed("b", 1.0))
        s.settle()
        s.join("h")
        s.send(ProviderLeft("d", 2.0))
        s.settle()
        return s.actions

    assert run() == run()


def test_a_provider_joining_again_from_the_same_process_keeps_its_place() -> None:
    """A missed heartbeat makes a provider join again: the same process (`boot`) keeps what it
    serves; a restart (another boot, or none) is a loss, repaired."""
    s = Swarm()
    for peer in ("a", "b", "c"):
        s.send(ProviderJoined(peer, gpu(), s.t, boot=f"boot-{peer}"))
    s.add(restored=restored([[("a", 0, 2), ("b", 2, 4)]], {(0, 1): "c"}))
    s.settle()
    before = list(s.actions)
    out = s.send(ProviderJoined("b", gpu(), s.t, loaded=frozenset({"m/2", "m/3"}), boot="boot-b"))
    assert not any(isinstance(a, ProviderLost | PromoteBackup | Replan) for a in out)
    assert s.notices("provider_joined")[-1]["again"] is True
    assert s.route()[2:] == [["b"], ["b"]] and s.actions[: len(before)] == before
    out = s.send(ProviderJoined("b", gpu(), s.t, boot="boot-b2"))  # it restarted
    assert ProviderLost("b", "m@2-4", graceful=False) in out
    assert PromoteBackup("m", "c", "m@2-4", "b") in out
