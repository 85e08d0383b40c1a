"""Trust measured hardware, not claimed: the hardware check at join, in one process with real
provider daemons (their executors run the check) on an in-memory network.

A provider claiming an H100 on this CPU is capped to what its check showed, as the API says,
and a model served by an honest provider stays where it is; answers that are wrong, or differ
from what was committed, refuse the join."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from broker.core.events import RebalanceCheck
from broker.core.placement import place
from ir.challenge import Work, reference
from p2p import Identity
from proto.challenge import CHALLENGE, Challenge, Committed, Reveal, Revealed
from proto.join import ExecutorInfo
from proto.ping import PING, Ping, Pong
from provider.profile import ExecutorProfile, MachineProfile
from tests.test_broker.inproc import PROFILE, crafted_profile, host_of, signed_join, swarm

pytestmark = pytest.mark.timeout(60)

H100 = MachineProfile(
    key="fake",
    cpu="in-process test CPU",
    cpu_cores=2,
    gpu="NVIDIA H100 80GB HBM3",
    gpu_driver="550.54",
    executors=[
        ExecutorProfile(
            "ort",
            "CUDAExecutionProvider",
            {"float32": 6.7e13, "float16": 9.9e14},
            3.35e12,
            80 << 30,
            80 << 30,
        )
    ],
    measured_at=0.0,
    seconds=0.0,
)


def claiming(flops: float) -> MachineProfile:
    ort = PROFILE.executors[0]
    return msgspec.structs.replace(
        PROFILE, executors=[msgspec.structs.replace(ort, flops={"float32": flops})]
    )


async def test_a_fake_h100_is_capped_and_does_not_move_a_served_model(
    tmp_path: Path, minilm_package: Path
) -> None:
    s = await swarm(tmp_path, trust_claims=False)
    try:
        honest = host_of(await s.provider(profile=claiming(1e10))).peer_id
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        route = s.broker.serving.route(model)
        liar = await s.provider(profile=H100, max_memory_bytes=64 << 30)
        fake = host_of(liar).peer_id
        checks = {e["peer"]: e for e in s.events("provider_checked")}
        assert not checks[honest]["capped"]  # a claim this machine bears out
        assert checks[fake]["capped"] and checks[fake]["claimed_flops"] == 6.7e13
        shown = checks[fake]["shown_flops"]
        assert 0 < shown < 6.7e13 / 10  # a CPU
        url = f"{s.broker.http_url}/v1/providers"
        async with aiohttp.ClientSession() as http, http.get(url) as answer:
            listed = {p["peer_id"]: p for p in (await answer.json())["providers"]}
        seen = listed[fake]
        assert seen["checked_flops"] == pytest.approx(shown, rel=1e-3)
        factor = s.broker.config.claim_factor
        assert seen["flops"]["float32"] == pytest.approx(factor * shown, rel=1e-3)
        # every figure scaled alike: its fp16 claim keeps its ratio to fp32
        assert seen["flops"]["float16"] / seen["flops"]["float32"] == pytest.approx(9.9e14 / 6.7e13)
        # Capped, it still looks faster than the honest provider: a fresh placement would take
        # the model onto it. Its speed has not been seen, so the broker moves nothing.
        core = s.broker.registry.core
        plan = core.plans[model]
        assert fake in place(plan.spec, core.candidates(plan), core.config.placement).providers()
        s.broker.registry.driver.handle(RebalanceCheck(s.clock()))
        assert not s.events("model_rebalanced")
        assert s.broker.serving.route(model) == route and all(route or [[]])
        assert {p for peers in route or [] for p in peers} == {honest}
        # the same process joining again (a missed heartbeat) with the same claim: not checked
        # again, and still capped
        await liar.join()
        assert [e["peer"] for e in s.events("provider_checked")].count(fake) == 1
        profile = core.pool.providers[fake].profile
        assert profile.flops["float32"] == pytest.approx(factor * shown, rel=1e-3)
    finally:
        await s.close()


async def _pong(peer: str, msg: Ping) -> Pong:
    return Pong(nonce=msg.nonce)


def _liar(kind: str) -> Any:
    """A hardware check's handler that lies as `kind` says."""
    kept: dict[bytes, bytes] = {}

    def answer(peer: str, msg: Challenge | Reveal) -> Committed | Revealed:
        if isinstance(msg, Reveal):
            out = kept[msg.seed]
            return Revealed(answer=b"\0" * len(out) if kind == "swapped" else out)
        work = Work(msg.seed, msg.rows, msg.rounds, msg.width)
        if kind == "no work":
            rounds, out = msg.rounds, b"\0" * (2 * msg.rows)
        else:  # "more rounds than done": right for one round, claimed as two
            rounds, out = 2, reference(work, range(msg.rows), 1).astype("<i2").tobytes()
        kept[msg.seed] = out
        return Committed(rounds=rounds, digest=hashlib.sha256(out).digest())

    return answer


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("no work", "answer is wrong"),
        ("more rounds than done", "answer is wrong"),
        ("swapped", "differs from what it committed to"),
        ("no handler", "did not take the broker's hardware check"),
    ],
)
async def test_a_wrong_answer_to_the_check_refuses_the_join(
    tmp_path: Path, kind: str, why: str
) -> None:
    s = await swarm(tmp_path, trust_claims=False)
    try:
        identity = Identity.ephemeral()
        host = s.net.host(identity)
        await host.start()
        host.add_control_handler(PING, _pong)
        if kind != "no handler":
            host.add_compute_handler(CHALLENGE, _liar(kind))
        slow = [ExecutorInfo("ort", "cpu", {"float32": 1e8}, 1e9, 8 << 30, 8 << 30)]
        join = signed_join(identity, s.broker.peer_id, crafted_profile(executors=slow))
        reply = await s.broker.registry.on_join(identity.peer_id, join)
        assert not reply.accepted
        assert reply.reason.startswith("the hardware check failed:") and why in reply.reason
        assert identity.peer_id not in s.broker.registry.core.pool.providers
        assert [e["peer"] for e in s.events("join_refused")] == [identity.peer_id]
    finally:
        await s.close()


async def test_a_provider_that_does_not_finish_the_check_in_time_is_refused(
    tmp_path: Path,
) -> None:
    """The window and its slack bound the broker's wait (here about 12 s)."""
    import time

    from broker.challenge import SLACK_S

    s = await swarm(tmp_path, trust_claims=False)
    try:
        identity = Identity.ephemeral()
        host = s.net.host(identity)
        await host.start()
        host.add_control_handler(PING, _pong)
        limit = s.broker.registry.checks.window_s + SLACK_S  # type: ignore[union-attr]

        def stall(peer: str, msg: Challenge | Reveal) -> Committed:
            time.sleep(limit + 0.5)
            return Committed(rounds=1, digest=b"")

        host.add_compute_handler(CHALLENGE, stall)
        join = signed_join(identity, s.broker.peer_id, crafted_profile())
        began = time.monotonic()
        reply = await s.broker.registry.on_join(identity.peer_id, join)
        assert not reply.accepted and "took longer than" in reply.reason
        assert time.monotonic() - began < limit + 5
    finally:
        await s.close()


async def test_a_backup_giving_second_opinions_has_its_speed_seen(
    tmp_path: Path, minilm_package: Path
) -> None:
    """Spot checks ask backups first; the broker times their answers, so a newcomer standing
    by becomes a provider whose speed is seen, which a rebalance may then use."""
    s = await swarm(tmp_path, trust_claims=False, verify_fraction=1.0)
    try:
        for _ in range(3):
            await s.provider()
        model = await s.add_model(minilm_package)
        core = s.broker.registry.core
        plan = core.plans[model]
        await s.until("warm backups", lambda: core.backups(model))
        assert plan.placement is not None
        backups = set(plan.placement.backups.values()) - plan.placement.providers()
        assert backups and not any(core.observed(plan, b) for b in backups)
        texts = [f"text {i} about gaming PCs" for i in range(8)]
        job = await s.broker.jobs.submit({"model": model, "texts": texts, "microbatch": 4})
        await s.until(
            "the job's end", lambda: s.broker.store.job(job.id, full=False).state == "succeeded"
        )
        assert any(core.observed(plan, b) for b in backups)
    finally:
        await s.close()
