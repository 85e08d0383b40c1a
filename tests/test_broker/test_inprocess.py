"""The broker's registry, serving and job runner in one process with real provider daemons, on
an in-memory network and a clock the test moves (`inproc.py`): joins and silence, placement,
failover mid-job, a restart that restores placements, in well under a second each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from p2p import Identity
from proto.heartbeat import HEARTBEAT, Heartbeat
from proto.join import JOIN, JOIN_DOMAIN, Join, signed_join_bytes
from provider.faults import Fault
from tests.test_broker.conftest import local_embeddings
from tests.test_broker.inproc import Swarm, host_of, swarm

pytestmark = pytest.mark.timeout(60)
TEXTS = [f"in-process text {i} about gaming PCs" for i in range(24)]


async def test_joins_are_checked_and_silence_loses_a_provider_on_the_brokers_clock(
    tmp_path: Path,
) -> None:
    s = await swarm(tmp_path, join_token="sesame")
    try:
        with pytest.raises(Exception, match="join token"):
            await s.provider()
        s.providers.clear()
        a = await s.provider(join_token="sesame")
        b = await s.provider(join_token="sesame")
        peer_b = host_of(b).peer_id
        # a join signed by another key is refused, whatever it claims
        forger = s.net.host()
        await forger.start()
        stranger = Identity.ephemeral()
        body, stamp = b"{}", 1.0e9
        signed = signed_join_bytes(body, s.broker.peer_id, stamp)
        signature = stranger.sign(signed, domain=JOIN_DOMAIN)
        reply = await forger.request(
            s.broker.peer_id,
            JOIN,
            Join(profile=body, signature=signature, broker=s.broker.peer_id, timestamp=stamp),
        )
        assert not reply.accepted
        ack = await forger.request(s.broker.peer_id, HEARTBEAT, Heartbeat(seq=1))
        assert not ack.known  # never met: join first
        # 5 s heartbeats, 3 missed: b is silent for 16 s of the broker's clock, a is not
        await s.elapse(14.0, b)
        assert not s.events("provider_lost")
        await s.elapse(2.0, b)
        lost = s.events("provider_lost")
        assert [e["peer"] for e in lost] == [peer_b] and lost[0]["cause"] == "ClockTicked"
        assert s.broker.registry.alive(host_of(a).peer_id)
        with pytest.raises(Exception, match="does not know"):
            await b.heartbeat()  # it hears so, and joins again
        await b.join()
        assert s.broker.registry.alive(peer_b)
    finally:
        await s.close()


async def test_a_job_runs_through_in_memory_providers_and_survives_a_stage_providers_death(
    tmp_path: Path, minilm_package: Path
) -> None:
    s: Swarm = await swarm(tmp_path, microbatch=4)
    try:
        for _ in range(3):  # two stages and a backup
            await s.provider()
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        plan = s.broker.driver.core.plans[model].placement
        assert plan is not None and plan.backups
        job = await s.broker.jobs.submit({"model": model, "texts": TEXTS, "microbatch": 4})
        await s.until("the job runs", lambda: s.events("job_running"))
        (r, i), backup = next(iter(plan.backups.items()))
        victim = plan.replicas[r].stages[i].provider
        s.net.kill(victim)  # mid-job: its requests fail at once
        done = await s.until(
            "the job's end",
            lambda: (row := s.broker.store.job(job.id, full=False)) and row.state != "running"
            and row.state != "placed" and row,
        )  # fmt: skip
        assert done.state == "succeeded", done.error
        assert any(e["peer"] == victim for e in s.events("provider_lost"))
        assert s.events("stage_promoted")[0]["peer"] == backup  # its warm backup took over
        rows = np.array(s.broker.jobs.results(job.id, 0, 100).embeddings)
        assert np.abs(rows - local_embeddings(minilm_package, TEXTS)).max() <= 1e-4
    finally:
        await s.close()


async def test_a_restarted_broker_restores_its_placement_and_repairs_who_did_not_come_back(
    tmp_path: Path, minilm_package: Path
) -> None:
    s = await swarm(tmp_path)
    try:
        for _ in range(3):
            await s.provider()
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        placement = s.broker.driver.core.plans[model].placement
        assert placement is not None
        serving = [st.provider for st in placement.replicas[0].stages]
        s.net.kill(serving[0])
        await s.restart()  # and it is gone while the broker is down
        for peer, p in s.providers.items():
            if peer in s.net.hosts:
                await p.join()  # they join again and announce what they have loaded
        core = s.broker.driver.core
        assert core.plans[model].placement == placement  # restored as it was
        await s.until("the others serve again", lambda: all((core.route(model) or [])[1:]))
        assert serving[0] not in (core.route(model) or [[]])[0]
        await s.elapse(s.broker.config.grace_s - 1)  # within its grace period
        assert not s.events("provider_missing")
        await s.elapse(2.0)  # its grace period ends on the broker's clock
        assert [e["peer"] for e in s.events("provider_missing")] == [serving[0]]
        await s.until("repaired", lambda: all(s.broker.serving.route(model) or [[]]))
    finally:
        await s.close()


@pytest.mark.parametrize("policy", ["fifo", "sjf-bsbf"])
async def test_the_queue_policy_orders_jobs_waiting_for_a_route(
    tmp_path: Path, minilm_package: Path, policy: str
) -> None:
    s = await swarm(tmp_path, queue_policy=policy)
    try:
        model = await s.add_model(minilm_package)  # no providers yet: placed later
        assert "no providers" in (s.broker.serving.describe(model).waiting or "")
        long = await s.broker.jobs.submit({"model": model, "texts": TEXTS * 3})  # 3 microbatches
        short = await s.broker.jobs.submit({"model": model, "texts": TEXTS[:4]})
        for _ in range(2):
            await s.provider()
        first = await s.until("a job placed", lambda: s.events("job_placed"))
        assert first[0]["job"] == (long.id if policy == "fifo" else short.id)
        for job in (long, short):
            await s.until(
                "the jobs' end",
                lambda job=job: s.broker.store.job(job.id, full=False).state == "succeeded",
            )
    finally:
        await s.close()


async def test_a_provider_that_joins_during_a_job_is_placed_once_the_job_ends(
    tmp_path: Path, minilm_package: Path
) -> None:
    """A placement is not changed under a running job; a provider that joins meanwhile (a
    standby at first) takes its share of the model as soon as the job has ended. Its
    profile is its twin's, corrected as the twin was seen to run (the prior)."""
    s = await swarm(tmp_path)
    try:
        first = host_of(await s.provider(fault=Fault(slow_ms=100))).peer_id
        model = await s.add_model(minilm_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        assert {p for peers in s.broker.serving.route(model) or [] for p in peers} == {first}
        job = await s.broker.jobs.submit({"model": model, "texts": TEXTS, "microbatch": 4})
        await s.until("some stage times", lambda: s.events("job_progress"))
        second = host_of(await s.provider()).peer_id
        row = s.broker.store.job(job.id, full=False)
        assert row is not None and row.state == "running", "the job ended first: make it longer"
        assert not s.events("model_rebalanced")  # not under the running job
        assert s.broker.driver.core.plans[model].rebalance_due
        await s.until(
            "the job's end", lambda: s.broker.store.job(job.id, full=False).state == "succeeded"
        )
        moved = await s.until("a rebalance", lambda: s.events("model_rebalanced"))
        assert {st[0] for r in moved[0]["replicas"] for st in r} == {first, second}
        core = s.broker.driver.core
        await s.until(
            "each serves one stage",
            lambda: (
                [len(set(peers)) for peers in s.broker.serving.route(model) or []] == [1, 1]
                and {p for peers in s.broker.serving.route(model) or [] for p in peers}
                == {first, second}
            ),
            explain=lambda: {
                "route": s.broker.serving.route(model),
                "sent": core.sent,
                "confirmed": core.confirmed,
                "loaded": core.loaded,
                "events": [e.to_json() for e in s.broker.store.events(limit=200)],
            },
        )
    finally:
        await s.close()


async def test_an_embedding_job_over_the_int8_wire(
    tmp_path: Path, minilm_package: Path, minilm_int8_wire_package: Path
) -> None:
    """The broker sends a MiniLM job's hidden states to its stages as int8 blocks, and the
    providers answer in kind: the embeddings are the in-process int8-wire run's, cosine
    >= 0.999 to the fp32 wire's."""
    s: Swarm = await swarm(tmp_path, microbatch=8)
    try:
        for _ in range(2):
            await s.provider()
        model = await s.add_model(minilm_int8_wire_package)
        await s.until("a route", lambda: all(s.broker.serving.route(model) or [[]]))
        job = await s.broker.jobs.submit({"model": model, "texts": TEXTS, "microbatch": 8})
        done = await s.until(
            "the job's end",
            lambda: (row := s.broker.store.job(job.id, full=False)) and row.state == "succeeded"
            and row,
        )  # fmt: skip
        assert done.state == "succeeded"
        rows = np.array(s.broker.jobs.results(job.id, 0, 100).embeddings)
        assert np.abs(rows - local_embeddings(minilm_int8_wire_package, TEXTS)).max() <= 1e-4
        fp32 = local_embeddings(minilm_package, TEXTS)
        cosine = (rows * fp32).sum(1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(fp32, axis=1)
        assert cosine.min() >= 0.999 and np.abs(rows - fp32).max() > 1e-4  # int8 did travel
    finally:
        await s.close()


async def test_a_relayed_provider_costs_its_relay_leg(tmp_path: Path) -> None:
    """A join announcing a relayed address: the cost model doubles its round trip (the relay
    leg) and gives it at most its share of the relay's cap."""
    import time

    import msgspec

    from proto.join import ExecutorInfo, JoinProfile

    s = await swarm(tmp_path, relay_rate_bytes_s=2e6)
    try:
        for i, relay in enumerate((False, True)):
            identity = Identity.ephemeral()
            relayed = [f"/ip4/203.0.113.10/tcp/40000/p2p/{identity.peer_id}"] if relay else []
            profile = JoinProfile(
                gpu=None,
                cpu="cpu",
                cpu_cores=2,
                executors=[ExecutorInfo("ort", "cpu", {"float32": 5e10}, 1e10, 8 << 30, 8 << 30)],
                executor="ort",
                memory_limit_bytes=2 << 30,
                net_up_bytes_s=1e8,
                rtt_s=0.05,
                version="test",
                relayed=relayed,
            )
            body, stamp = msgspec.json.encode(profile), time.time()
            signature = identity.sign(
                signed_join_bytes(body, s.broker.peer_id, stamp), domain=JOIN_DOMAIN
            )
            join = Join(profile=body, signature=signature, broker=s.broker.peer_id, timestamp=stamp)
            assert (await s.broker.registry.on_join(identity.peer_id, join)).accepted
            seen = s.broker.registry.core.pool.providers[identity.peer_id].profile
            want = (0.05, 1e8) if i == 0 else (0.1, 2e6)  # the only relayed one: all the cap
            assert (seen.rtt, seen.net_bandwidth) == pytest.approx(want)
    finally:
        await s.close()
