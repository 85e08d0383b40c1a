"""The broker with real provider processes on 127.0.0.1: pools, joins, serving, failover,
restart. Every wait has a deadline; faults are signals sent at chosen moments."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from tests.procs import ROOT, Proc
from tests.procs import sample_texts as texts
from tests.test_broker.conftest import (
    HEARTBEAT_S,
    BrokerProc,
    add_model,
    api,
    free_port,
    local_embeddings,
    pools,
    wait_job,
    wait_ready,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

Spawner = Callable[..., Any]


def peer_of(proc: Proc) -> str:
    peer: str = proc.wait_for("listening", timeout=60)["peer_id"]
    return peer


def gone(proc: Proc) -> bool:
    try:
        proc.proc.wait(timeout=5)
    except Exception:
        return False
    return True


def results(http: str, job: str) -> np.ndarray[Any, Any]:
    status, out = api(http, "GET", f"/v1/jobs/{job}/results")
    assert status == 200, out
    assert out["total"] == len(out["embeddings"])
    return np.array(out["embeddings"], dtype=np.float32)


def story(http: str, job: str) -> list[dict[str, Any]]:
    status, out = api(http, "GET", f"/v1/jobs/{job}/story")
    assert status == 200
    events: list[dict[str, Any]] = out["events"]
    return events


def test_join_leave_and_heartbeat_timeout_move_providers(
    broker: Spawner, provider: Spawner
) -> None:
    b: BrokerProc = broker()
    p1, p2 = provider(b.addr), provider(b.addr)
    id1, id2 = peer_of(p1), peer_of(p2)
    wait_until("both in the backup pool", lambda: pools(b.http) == {id1: "backup", id2: "backup"})
    # the broker dialled each back on the address it saw it connect from: on one machine,
    # both are directly reachable
    for peer in (id1, id2):
        reach = b.proc.wait_for("provider_reach", lambda e, p=peer: e["peer"] == p, since=0)
        assert reach["reach"] == "direct" and reach["observed"].startswith("/ip4/127.0.0.1/")
    _, listed = api(b.http, "GET", "/v1/providers")
    assert {p["reach"] for p in listed["providers"]} == {"direct"}

    p1.signal(signal.SIGTERM)  # graceful: drains, then tells the broker it leaves
    left = b.proc.wait_for("provider_left", lambda e: e["peer"] == id1, timeout=30)
    lost = b.proc.wait_for("provider_lost", lambda e: e["peer"] == id1, timeout=10)
    assert lost["graceful"] is True and left["id"] < lost["id"]
    assert pools(b.http)[id1] == "dead"

    p2.signal(signal.SIGSTOP)  # silent: the socket stays open, heartbeats stop
    try:
        stopped = time.monotonic()
        lost = b.proc.wait_for("provider_lost", lambda e: e["peer"] == id2, timeout=30)
        took = time.monotonic() - stopped
        assert lost["graceful"] is False and lost["cause"] == "ClockTicked"
        assert took <= HEARTBEAT_S * 3 + 2.0, took
        assert pools(b.http)[id2] == "dead"
    finally:
        p2.signal(signal.SIGCONT)
    # Back from the pause, it hears it is unknown, joins again and is a backup once more.
    b.proc.wait_for("provider_joined", lambda e: e["peer"] == id2, timeout=30, since=0)
    wait_until("p2 back in the backup pool", lambda: pools(b.http).get(id2) == "backup")


def test_bad_signature_missing_token_and_deny_list_are_refused(
    broker: Spawner, provider: Spawner, tmp_path: Path
) -> None:
    from p2p import Host, HostConfig, Identity
    from proto.join import JOIN, ExecutorInfo, Join, JoinProfile

    denied_dir = tmp_path / "denied"
    with Identity.load_or_create(denied_dir) as ident:
        denied = ident.peer_id
    b: BrokerProc = broker("--join-token", "s3cret", "--deny", denied)

    no_token = provider(b.addr)
    refused = b.proc.wait_for("join_refused", timeout=60)
    assert "join token" in refused["reason"]
    no_token.wait_for("join_refused", lambda e: "join token" in e["reason"], timeout=30)

    async def forged() -> Any:
        profile = JoinProfile(
            gpu=None,
            cpu="test",
            cpu_cores=1,
            executors=[ExecutorInfo("ort", "CPUExecutionProvider", {"float32": 1e9}, 1e9, 1, 1)],
            executor="ort",
            memory_limit_bytes=1 << 30,
            net_up_bytes_s=1e8,
            rtt_s=0.001,
            version="test",
        )
        config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), data_dir=tmp_path / "forger")
        async with Host(config) as host:
            broker_id = await host.connect(b.addr)
            return await host.request(
                broker_id,
                JOIN,
                Join(
                    profile=msgspec.json.encode(profile),
                    signature=b"\1" * 64,  # not this peer's signature
                    broker=broker_id,
                    timestamp=time.time(),
                    token="s3cret",
                ),
                timeout=10,
            )

    reply = asyncio.run(forged())
    assert not reply.accepted and "bad signature" in reply.reason

    # The denied identity, with the right token, is still refused.
    denied_proc = provider(b.addr, "--join-token", "s3cret", data_dir=denied_dir)
    b.proc.wait_for("join_refused", lambda e: e["peer"] == denied, timeout=60)
    denied_proc.wait_for("join_refused", lambda e: "deny list" in e["reason"], timeout=30)

    good = provider(b.addr, "--join-token", "s3cret")
    gid = peer_of(good)
    wait_until("the provider with the token joins", lambda: pools(b.http).get(gid) == "backup")
    assert denied not in pools(b.http)


def test_model_is_uploaded_placed_and_a_batch_job_equals_local(
    broker: Spawner, provider: Spawner, minilm_package: Path
) -> None:
    b: BrokerProc = broker()
    procs = [provider(b.addr) for _ in range(3)]
    ids = {peer_of(p) for p in procs}
    wait_until("three providers", lambda: set(pools(b.http)) == ids)
    add_model(b.http, minilm_package)
    route = wait_ready(b.http, "minilm", backups=0)
    served = {p["peer_id"] for s in route["stages"] for p in s["providers"]}
    assert served <= ids and all(p["addrs"] for s in route["stages"] for p in s["providers"])
    active = {pid for pid, pool in pools(b.http).items() if pool == "active"}
    assert active == served

    # Bad input gets 400 naming the field; unknown things 404.
    status, out = api(b.http, "POST", "/v1/jobs", raw=b"{not json")
    assert status == 400 and out["error"]["field"] == "body"
    status, out = api(
        b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": ["a"], "microbatch": "x"}
    )
    assert status == 400 and out["error"]["field"] == "microbatch"
    status, out = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": [1, 2]})
    assert status == 400 and out["error"]["field"] == "texts"
    status, out = api(b.http, "POST", "/v1/jobs", {"model": "nope", "texts": ["a"]})
    assert status == 404 and "nope" in out["error"]["message"]
    status, _ = api(b.http, "GET", "/v1/jobs/0123456789abcdef")
    assert status == 404

    batch = texts(40)
    status, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": batch})
    assert status == 201 and job["state"] == "queued"
    status, _ = api(b.http, "GET", f"/v1/jobs/{job['id']}/results")
    assert status in (409, 200)  # 409 until it has succeeded
    done = wait_job(b.http, job["id"])
    assert done["state"] == "succeeded", done
    got = results(b.http, job["id"])
    want = local_embeddings(minilm_package, batch)
    assert got.shape == want.shape == (40, 384)
    assert np.abs(got - want).max() <= 1e-4
    kinds = [e["kind"] for e in story(b.http, job["id"])]
    assert kinds[0] == "job_queued" and kinds[-1] == "job_succeeded" and "job_running" in kinds
    # Results stay until fetched and deleted.
    status, out = api(b.http, "DELETE", f"/v1/jobs/{job['id']}/results")
    assert status == 200 and out["deleted"] == 5
    told = subprocess.run(
        [sys.executable, "-m", "cli.main", "job", "story", job["id"], "--broker", b.http],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert told.returncode == 0 and "job_succeeded" in told.stdout, told.stderr

    # Artifacts are served by SHA-256 with range requests.
    manifest = json.loads((minilm_package / "manifest.json").read_bytes())
    stage = manifest["stages"][1]
    req = urllib.request.Request(
        f"{b.http}/v1/artifacts/{stage['sha256']}", headers={"Range": "bytes=100-163"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 206
        part = resp.read()
    assert part == (minilm_package / stage["file"]).read_bytes()[100:164]

    # A queued or running job can be cancelled; a cancelled job stays cancelled.
    _, big = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": texts(400)})
    status, out = api(b.http, "POST", f"/v1/jobs/{big['id']}/cancel")
    assert status == 200 and out["state"] == "cancelled"
    time.sleep(1.0)
    _, out = api(b.http, "GET", f"/v1/jobs/{big['id']}")
    assert out["state"] == "cancelled"


def _failover(
    broker: Spawner,
    provider: Spawner,
    package: Path,
    fault: int,
) -> tuple[BrokerProc, str, list[dict[str, Any]]]:
    """4 providers (2 active, 2 warm backups), a job, then `fault` sent to stage 0's server."""
    b: BrokerProc = broker()
    procs = [provider(b.addr) for _ in range(4)]
    by_peer = {peer_of(p): p for p in procs}
    wait_until("four providers", lambda: len(pools(b.http)) == 4)
    add_model(b.http, package)
    route = wait_ready(b.http, "minilm", backups=1)
    victim = route["stages"][0]["providers"][0]["peer_id"]
    backup = route["stages"][0]["backups"][0]
    batch = texts(120)  # 15 microbatches: the fault lands with most still to do
    _, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": batch})
    b.proc.wait_for("job_progress", lambda e: e["job"] == job["id"], timeout=120)
    by_peer[victim].signal(fault)
    try:
        done = wait_job(b.http, job["id"])
        assert done["state"] == "succeeded", done
        got = results(b.http, job["id"])
        assert np.abs(got - local_embeddings(package, batch)).max() <= 1e-4
        _, after = api(b.http, "GET", "/v1/models/minilm")
        assert after["stages"][0]["providers"][0]["peer_id"] == backup
        b.proc.wait_for(
            "stage_promoted", lambda e: e["peer"] == backup and e["key"] == "minilm/1", timeout=5
        )
    finally:
        if fault == signal.SIGSTOP:
            by_peer[victim].signal(signal.SIGCONT)
    if fault in (signal.SIGKILL, signal.SIGTERM):
        assert gone(by_peer[victim])
    return b, victim, story(b.http, job["id"])


def test_sigkill_of_an_active_provider_mid_job_fails_over_to_its_backup(
    broker: Spawner, provider: Spawner, minilm_package: Path
) -> None:
    b, victim, events = _failover(broker, provider, minilm_package, signal.SIGKILL)
    lost = b.proc.wait_for("provider_lost", lambda e: e["peer"] == victim, timeout=5)
    assert lost["graceful"] is False
    # The job's story tells who failed, who took over, and which microbatches were retried.
    retries = [e for e in events if e["kind"] == "microbatch_retry"]
    assert retries and all(e["peer"] == victim for e in retries)
    assert any(e["kind"] == "provider_lost" and e["peer"] == victim for e in events)
    assert any(e["kind"] == "stage_promoted" for e in events)
    assert any(e["kind"] == "microbatch_recovered" for e in events)


@pytest.mark.slow  # (the chaos run freezes providers and restarts the broker too)
def test_sigstop_of_an_active_provider_is_caught_by_missed_heartbeats(
    broker: Spawner, provider: Spawner, minilm_package: Path
) -> None:
    b, victim, _ = _failover(broker, provider, minilm_package, signal.SIGSTOP)
    lost = b.proc.wait_for("provider_lost", lambda e: e["peer"] == victim, timeout=5)
    assert lost["cause"] in ("ClockTicked", "HeartbeatsMissed")
    assert lost["graceful"] is False


def test_graceful_leave_mid_job_hands_over_to_the_backup_at_once(
    broker: Spawner, provider: Spawner, minilm_package: Path
) -> None:
    b, victim, events = _failover(broker, provider, minilm_package, signal.SIGTERM)
    draining = b.proc.wait_for("provider_draining", lambda e: e["peer"] == victim, timeout=5)
    repaired = b.proc.wait_for("model_repaired", lambda e: e["lost"] == victim, timeout=5)
    assert repaired["reason"] == "draining" and draining["id"] < repaired["id"]
    lost = b.proc.wait_for("provider_lost", lambda e: e["peer"] == victim, timeout=30)
    assert lost["graceful"] is True
    assert not any(e["kind"] == "job_failed" for e in events)


@pytest.mark.slow  # (the chaos run freezes providers and restarts the broker too)
def test_broker_sigkill_mid_job_then_restart_completes_the_job(
    broker: Spawner, provider: Spawner, minilm_package: Path, tmp_path: Path
) -> None:
    port = free_port()
    data = tmp_path / "broker-data"
    b: BrokerProc = broker(data_dir=data, port=port)
    procs = [provider(b.addr) for _ in range(3)]
    for p in procs:
        peer_of(p)
    wait_until("three providers", lambda: len(pools(b.http)) == 3)
    add_model(b.http, minilm_package)
    wait_ready(b.http, "minilm")
    batch = texts(120)
    _, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": batch})
    b.proc.wait_for("job_progress", lambda e: e["job"] == job["id"], timeout=120)
    b.proc.signal(signal.SIGKILL)
    assert gone(b.proc)

    again: BrokerProc = broker(data_dir=data, port=port)
    resumed = again.proc.wait_for("job_resumed", lambda e: e["job"] == job["id"], timeout=30)
    assert 0 < resumed["done"] < resumed["of"]
    done = wait_job(again.http, job["id"])
    assert done["state"] == "succeeded", done
    got = results(again.http, job["id"])
    assert got.shape == (120, 384)
    assert np.abs(got - local_embeddings(minilm_package, batch)).max() <= 1e-4
    # The providers came back on their own and nothing was placed anew.
    again.proc.mark()  # collect every event printed so far
    rejoined = [e for e in again.proc.events if e["event"] == "provider_joined"]
    assert len({e["peer"] for e in rejoined}) == 3
    assert all(e["loaded"] for e in rejoined if e["peer"] in _members(again.http))
    assert os.path.exists(data / "broker.db")


def _members(http: str) -> set[str]:
    _, out = api(http, "GET", "/v1/models/minilm")
    return {p["peer_id"] for s in out["stages"] for p in s["providers"]}


def test_a_job_status_request_waits_for_the_next_change(
    broker: Spawner, provider: Spawner, minilm_package: Path
) -> None:
    """`GET /v1/jobs/{id}?wait=S` holds the request until the job changes (a cancel answers
    it at once) or S seconds pass; `Client.wait` uses it, so it makes a few requests, not a
    polling loop, and still sees the end at once."""
    from concurrent.futures import ThreadPoolExecutor

    from client import Client

    b: BrokerProc = broker("--verify-fraction", "0")
    add_model(b.http, minilm_package)  # no providers yet: the job waits for a route
    _, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": texts(8)})
    path = f"/v1/jobs/{job['id']}"
    start = time.monotonic()
    status, out = api(b.http, "GET", path + "?wait=1")
    assert status == 200 and out["state"] == "queued", out
    assert time.monotonic() - start >= 0.9  # nothing changed: held for the whole second
    for bad in ("31", "-1", "soon", "nan"):
        status, out = api(b.http, "GET", f"{path}?wait={bad}")
        assert status == 400 and "wait" in out["error"]["message"], (bad, out)
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        held = pool.submit(api, b.http, "GET", path + "?wait=25")
        time.sleep(1.0)
        assert not held.done()
        api(b.http, "POST", path + "/cancel")
        status, out = held.result(timeout=10)
    assert status == 200 and out["state"] == "cancelled", out
    assert time.monotonic() - start < 8  # answered on the change, not after 25 s
    start = time.monotonic()
    assert api(b.http, "GET", path + "?wait=25")[1]["state"] == "cancelled"  # ended: at once
    assert time.monotonic() - start < 5

    peer_of(provider(b.addr))
    wait_ready(b.http, "minilm")
    with Client(b.http, timeout=30) as fa:
        submitted = fa.submit({"model": "minilm", "texts": texts(96), "microbatch": 8})
        seen: list[tuple[str, int]] = []
        done = fa.wait(
            submitted.id, timeout=120, poll=25, progress=lambda j: seen.append((j.state, j.done))
        )
    assert done.state == "succeeded" and seen[-1] == ("succeeded", 12), seen
    assert all(a != b for a, b in itertools.pairwise(seen)), seen  # every answer was a change
    with urllib.request.urlopen(b.http + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    polls = sum(
        float(n)
        for n in re.findall(
            r'fusionai_http_request_seconds_count\{method="GET",route="/v1/jobs/\{id\}",'
            r'status="200"\} (\S+)',
            metrics,
        )
    )
    # 3 requests above, then one per change the client saw (12 microbatches report progress
    # in 12 events at most, plus the state changes)
    assert len(seen) <= 16 and polls == 3 + len(seen), (polls, seen)


@pytest.mark.parametrize("relay", ["chain", "star"])
def test_batch_activations_go_provider_to_provider_or_through_the_broker(
    broker: Spawner, provider: Spawner, minilm_package: Path, relay: str
) -> None:
    """`--relay chain` (the default) sends a microbatch's hidden states from each stage's
    provider straight to the next one's; `--relay star` through the broker. Same results."""
    b: BrokerProc = broker("--relay", relay, "--verify-fraction", "0")
    for _ in range(2):
        peer_of(provider(b.addr))
    wait_until("two providers", lambda: len(pools(b.http)) == 2)
    add_model(b.http, minilm_package)
    wait_ready(b.http, "minilm")
    batch = texts(96)  # 3 microbatches of 32, each through 2 provider stages
    _, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": batch})
    assert wait_job(b.http, job["id"])["state"] == "succeeded"
    got = results(b.http, job["id"])
    assert np.abs(got - local_embeddings(minilm_package, batch)).max() <= 1e-4
    with urllib.request.urlopen(b.http + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    counts = {
        kind: float(n)
        for kind, n in re.findall(
            r'fusionai_stage_requests_total\{model="minilm",relay="(\w+)"\} (\S+)', metrics
        )
    }
    if relay == "chain":
        assert counts.get("chain", 0) >= 6 and counts.get("direct", 0) == 0, counts
    else:
        assert counts.get("direct", 0) >= 6 and counts.get("chain", 0) == 0, counts


def test_providers_that_cannot_reach_each_other_relay_through_the_broker(
    broker: Spawner, provider: Spawner, minilm_package: Path
) -> None:
    """Both providers announce an address nobody listens on: the broker reaches them over
    the connections they opened, but the first hop of a chain cannot dial the second. The
    broker notes the pair, checks the second is alive (it answers a ping, so it stays), and
    sends their hidden states through itself from then on; the job succeeds."""
    b: BrokerProc = broker("--verify-fraction", "0")
    # Room for one stage each (a 21 MB block and a 50 MB workspace), so the chain crosses
    # from one to the other: with room for both, a loaded machine's join measurements can
    # make the placement put both stages on one provider (no hop, no failed dial).
    for _ in range(2):
        announce = ("--announce", f"/ip4/127.0.0.1/tcp/{free_port()}")
        peer_of(provider(b.addr, *announce, "--max-memory", "0.1"))
    wait_until("two providers", lambda: len(pools(b.http)) == 2)
    add_model(b.http, minilm_package)
    route = wait_ready(b.http, "minilm")
    first, second = (s["providers"][0]["peer_id"] for s in route["stages"])
    batch = texts(64)
    _, job = api(b.http, "POST", "/v1/jobs", {"model": "minilm", "texts": batch})
    assert wait_job(b.http, job["id"])["state"] == "succeeded"
    got = results(b.http, job["id"])
    assert np.abs(got - local_embeddings(minilm_package, batch)).max() <= 1e-4
    noted = b.proc.wait_for("chain_unreachable", timeout=5)
    assert (noted["peer"], noted["to"]) == (first, second)
    b.proc.mark()
    assert not [e for e in b.proc.events if e["event"] == "provider_lost"]
    with urllib.request.urlopen(b.http + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    direct = re.search(
        r'fusionai_stage_requests_total\{model="minilm",relay="direct"\} (\S+)', metrics
    )
    assert direct is not None and float(direct.group(1)) >= 2 * 7  # the 7 or 8 after the first
