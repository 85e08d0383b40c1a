"""Serving over the p2p layer from real provider processes, and the serving core's limits."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from ir.executors.ort import OrtExecutor
from ir.manifest import ModelManifest
from ir.package import load_package
from ir.pipeline import LocalPipeline, room
from p2p import (
    ConnectionLost,
    ErrorCode,
    Host,
    HostConfig,
    Identity,
    Refused,
    Relay,
    RemoteError,
    RequestTimeout,
    Tensor,
)
from p2p.tensor import encode, through_wire
from proto.forward import (
    FORWARD,
    ROUTE_DOMAIN,
    ChainAccepted,
    ChainBroken,
    Forward,
    ForwardResult,
    Hop,
    HopDone,
    route_bytes,
)
from proto.session import SESSION, SessionClose, SessionOpen, SessionStep
from provider.faults import Fault
from provider.gate import ComputeGate, Priority
from provider.serving import Server
from provider.stage import LoadedStage
from tests.procs import Proc

pytestmark = pytest.mark.timeout(120)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)


def _serve(broker: Proc, prov: Proc, stages: dict[str, int]) -> tuple[str, str]:
    """Assign `stages` (key -> index) to the provider; returns (peer id, its address)."""
    listening = prov.wait_for("listening")
    peer = listening["peer_id"]
    broker.wait_for("join", lambda e: e["peer"] == peer)
    for key, index in stages.items():
        broker.send({"cmd": "assign", "peer": peer, "key": key, "stage": index})
        status = broker.wait_for("status", lambda e, key=key: e["key"] == key)
        assert status["state"] == "ready", status
    return peer, listening["addrs"][0]


def _local(package: Path, index: int) -> OrtExecutor:
    loaded = load_package(package, stages=[index])
    info = loaded.manifest.stages[index]
    return OrtExecutor(loaded.models[index], inputs=info.inputs, outputs=info.outputs)


def _minilm_feeds(seq: int, fill: float) -> dict[str, np.ndarray[Any, Any]]:
    """Inputs of a MiniLM block stage: one sequence of `seq` tokens, hidden states `fill`."""
    return {
        "hidden_states": np.full((1, seq, 384), fill, dtype=np.float32),
        "attention_mask": np.ones((1, seq), dtype=np.int64),
    }


def _tensors(arrays: dict[str, np.ndarray[Any, Any]]) -> dict[str, Tensor]:
    return {k: Tensor.from_numpy(v) for k, v in arrays.items()}


async def test_a_served_minilm_stage_equals_a_local_run(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    peer, addr = _serve(broker, provider(broker), {"minilm/1": 1})
    rng = np.random.default_rng(0)
    feeds = {
        "hidden_states": rng.standard_normal((3, 9, 384)).astype(np.float32),
        "attention_mask": np.array([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7]),
    }
    expected = _local(minilm_package, 1).run(feeds)
    async with Host(HostConfig(listen=LOCAL)) as client:
        await client.connect(addr)
        result = await client.request(
            peer, FORWARD, Forward(stage="minilm/1", inputs=_tensors(feeds)), timeout=30
        )
        out = result.outputs["hidden_states_out"].to_numpy()
        np.testing.assert_allclose(out, expected["hidden_states_out"], rtol=1e-5, atol=1e-5)
        assert result.compute_ms > 0
        with pytest.raises(RemoteError) as missing:  # a stage it does not serve
            await client.request(peer, FORWARD, Forward(stage="nope", inputs=_tensors(feeds)))
        assert missing.value.code == ErrorCode.NOT_FOUND
        bad = {**feeds, "attention_mask": feeds["attention_mask"].astype(np.float32)}
        with pytest.raises(RemoteError) as wrong:  # inputs that do not match the stage
            await client.request(peer, FORWARD, Forward(stage="minilm/1", inputs=_tensors(bad)))
        assert wrong.value.code == ErrorCode.REFUSED and "attention_mask" in wrong.value.message


async def test_a_generation_session_with_kv_cache_equals_local_generation(
    standin: Callable[..., Proc], provider: Callable[..., Proc], llama_package: Path
) -> None:
    broker = standin(llama_package)
    peer, addr = _serve(broker, provider(broker), {"llama/1": 1, "llama/2": 2})
    loaded = load_package(llama_package)
    manifest: ModelManifest = loaded.manifest
    executors = [
        OrtExecutor(loaded.models[s.index], inputs=s.inputs, outputs=s.outputs)
        for s in manifest.stages
    ]
    prompt, steps = [5, 17, 300, 42, 8], 12
    expected = LocalPipeline(manifest, executors).generate_greedy(prompt, steps)
    embed, head = executors[0], executors[-1]
    tokens = list(prompt)
    async with Host(HostConfig(listen=LOCAL)) as client:
        await client.connect(addr)
        for key in ("llama/1", "llama/2"):
            await client.request(peer, SESSION, SessionOpen(session="s1", stage=key))
        fed = 0
        for _ in range(steps):
            ids = np.array([tokens[fed:]], dtype=np.int64)
            positions = np.arange(fed, len(tokens), dtype=np.int64)[None, :]
            hidden = embed.run({"input_ids": ids})["hidden_states"]
            for key in ("llama/1", "llama/2"):
                out = await client.request(
                    peer,
                    SESSION,
                    SessionStep(
                        session="s1",
                        stage=key,
                        inputs=_tensors({"hidden_states": hidden, "position_ids": positions}),
                    ),
                )
                hidden = out.outputs["hidden_states_out"].to_numpy()
                assert out.past_len == len(tokens)  # the provider cached every token so far
            fed = len(tokens)
            logits = head.run({"hidden_states": hidden})["logits"]
            tokens.append(int(np.argmax(logits[0, -1])))
        for key in ("llama/1", "llama/2"):
            await client.request(peer, SESSION, SessionClose(session="s1", stage=key))
    assert tokens[len(prompt) :] == expected


async def test_sigterm_drains_requests_in_flight_then_leaves(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    prov = provider(broker, "--fault", "slow=2000")
    peer, addr = _serve(broker, prov, {"minilm/1": 1})
    feeds = _minilm_feeds(4, 0.0)
    async with Host(HostConfig(listen=LOCAL)) as client:
        await client.connect(addr)
        call = asyncio.create_task(
            client.request(peer, FORWARD, Forward(stage="minilm/1", inputs=_tensors(feeds)))
        )
        await asyncio.sleep(0.7)  # the request is being served (2 s of injected slowness)
        prov.signal(signal.SIGTERM)
        result = await asyncio.wait_for(call, 20)
        assert result.outputs["hidden_states_out"].shape == (1, 4, 384)
    assert await asyncio.to_thread(prov.wait, 30) == 0
    drained = prov.wait_for("drained")
    assert drained["clean"] is True
    broker.wait_for("leave", lambda e: e["peer"] == peer)


async def test_a_provider_without_torch_serves_an_ort_stage(
    standin: Callable[..., Proc],
    provider: Callable[..., Proc],
    minilm_package: Path,
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    broker = standin(minilm_package)
    no_torch = {"PYTHONPATH": str(blocker.parent)}
    prov = provider(broker, env=no_torch)
    peer, addr = _serve(broker, prov, {"minilm/2": 2})
    feeds = _minilm_feeds(3, 1.0)
    async with Host(HostConfig(listen=LOCAL)) as client:
        await client.connect(addr)
        result = await client.request(
            peer, FORWARD, Forward(stage="minilm/2", inputs=_tensors(feeds))
        )
    expected = _local(minilm_package, 2).run(feeds)["hidden_states_out"]
    np.testing.assert_allclose(result.outputs["hidden_states_out"].to_numpy(), expected, atol=1e-5)
    # Asking for the torch executor there fails at start with a clear message.
    asked = provider(broker, "--executor", "torch", data_dir=tmp_path / "p2", env=no_torch)
    assert await asyncio.to_thread(asked.wait, 60) == 1
    assert "torch is not installed" in "".join(asked.stderr)


async def test_a_backup_stands_by_until_promoted(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    prov = provider(broker)
    peer = prov.wait_for("listening")["peer_id"]
    addr = prov.wait_for("listening")["addrs"][0]
    broker.wait_for("join", lambda e: e["peer"] == peer)
    broker.send({"cmd": "assign", "peer": peer, "key": "minilm/1", "stage": 1, "role": "backup"})
    status = broker.wait_for("status", lambda e: e["key"] == "minilm/1")
    assert (status["state"], status["role"]) == ("ready", "backup")
    feeds = _minilm_feeds(3, 1.0)
    request = Forward(stage="minilm/1", inputs=_tensors(feeds))
    async with Host(HostConfig(listen=LOCAL)) as client:
        await client.connect(addr)
        with pytest.raises(RemoteError, match="standby"):
            await client.request(peer, FORWARD, request)
        # A spot check of another provider's answer is the one thing a standby stage runs.
        checked = await client.request(peer, FORWARD, msgspec.structs.replace(request, check=True))
        assert checked.outputs["hidden_states_out"].shape == (1, 3, 384)
        mark = broker.mark()
        broker.send({"cmd": "promote", "peer": peer, "key": "minilm/1"})
        assert broker.wait_for("assign_ack", since=mark)["accepted"]
        result = await client.request(peer, FORWARD, request)
    assert result.outputs["hidden_states_out"].shape == (1, 3, 384)


async def test_die_at_step_kills_the_provider_at_that_request(
    standin: Callable[..., Proc], provider: Callable[..., Proc], minilm_package: Path
) -> None:
    broker = standin(minilm_package)
    prov = provider(broker, "--fault", "die-at-step=2")
    peer, addr = _serve(broker, prov, {"minilm/1": 1})
    feeds = _minilm_feeds(3, 1.0)
    request = Forward(stage="minilm/1", inputs=_tensors(feeds))
    async with Host(HostConfig(listen=LOCAL)) as client:
        await client.connect(addr)
        await client.request(peer, FORWARD, request)  # the first is served
        with pytest.raises((ConnectionLost, RequestTimeout)):
            await client.request(peer, FORWARD, request, timeout=10)
    assert await asyncio.to_thread(prov.wait, 30) == 137


def test_wrong_output_fault_changes_every_float_output(minilm_package: Path) -> None:
    feeds = _minilm_feeds(3, 1.0)
    request = Forward(stage="m/1", inputs=_tensors(feeds))
    honest = _server_with(minilm_package, 1, "m/1").forward("p", request)
    faulty = _server_with(minilm_package, 1, "m/1", fault=Fault(wrong_output=True))
    wrong = faulty.forward("p", request)
    np.testing.assert_allclose(
        wrong.outputs["hidden_states_out"].to_numpy(),
        honest.outputs["hidden_states_out"].to_numpy() + 1,
        rtol=1e-5,
    )


# ---- the serving core in-process: limits that need no network to show ----------------------


def _server_with(package: Path, index: int, key: str, **options: Any) -> Server:
    server = Server(**options)
    loaded = load_package(package, stages=[index])
    info = loaded.manifest.stages[index]
    executor = OrtExecutor(loaded.models[index], inputs=info.inputs, outputs=info.outputs)
    server.add(LoadedStage(key, info, executor, "active"))
    return server


def test_a_full_queue_answers_busy_at_once(minilm_package: Path) -> None:
    server = _server_with(
        minilm_package, 1, "m/1", max_queue=2, per_peer=5, fault=Fault(slow_ms=600)
    )
    request = Forward(
        stage="m/1",
        inputs=_tensors(_minilm_feeds(2, 0.0)),
    )
    threads = [threading.Thread(target=server.forward, args=(f"p{i}", request)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    start = time.monotonic()
    with pytest.raises(Refused) as busy:
        server.forward("p9", request)
    assert busy.value.code == ErrorCode.BUSY and time.monotonic() - start < 0.1
    training = Forward(stage="m/1", inputs=request.inputs, training=True)
    for t in threads:
        t.join()
    # Training may use only half the queue: with one inference request running it waits.
    slow = threading.Thread(target=server.forward, args=("p1", request))
    slow.start()
    time.sleep(0.2)
    with pytest.raises(Refused) as refused:
        server.forward("p2", training)
    assert refused.value.code == ErrorCode.BUSY
    slow.join()


def _wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_the_compute_gate_runs_one_at_a_time_most_urgent_first() -> None:
    gate = ComputeGate(1)
    order: list[str] = []
    running = 0
    most = 0
    lock = threading.Lock()

    def run(name: str, priority: Priority) -> None:
        nonlocal running, most
        with gate.slot(priority):
            with lock:
                running += 1
                most = max(most, running)
            order.append(name)
            time.sleep(0.01)
            with lock:
                running -= 1

    threads = []
    with gate.slot(Priority.FORWARD):  # busy: everyone below waits in line
        for name, priority in [
            ("train-1", Priority.TRAINING),
            ("batch-1", Priority.FORWARD),
            ("step-1", Priority.SESSION),
            ("batch-2", Priority.FORWARD),
            ("step-2", Priority.SESSION),
        ]:
            threads.append(threading.Thread(target=run, args=(name, priority)))
            threads[-1].start()
            n = len(threads)
            _wait_for(lambda n=n: gate.waiting == n)
    for t in threads:
        t.join(5)
    assert order == ["step-1", "step-2", "batch-1", "batch-2", "train-1"]
    assert most == 1 and gate.waiting == 0
    with pytest.raises(ValueError, match="slots"):
        ComputeGate(0)


def test_a_provider_runs_inference_before_queued_training_work(minilm_package: Path) -> None:
    server = _server_with(minilm_package, 1, "m/1", max_queue=8, per_peer=8)
    inputs = _tensors(_minilm_feeds(2, 0.0))
    done: list[str] = []

    def send(name: str, training: bool) -> None:
        server.forward(name, Forward(stage="m/1", inputs=inputs, training=training))
        done.append(name)

    threads = []
    with server.gate.slot(Priority.FORWARD):  # a stage run in progress
        for name, training in [("trainer", True), ("client", False)]:
            threads.append(threading.Thread(target=send, args=(name, training)))
            threads[-1].start()
            n = len(threads)
            _wait_for(lambda n=n: server.gate.waiting == n)
    for t in threads:
        t.join(30)
    assert done == ["client", "trainer"]


def test_session_caches_stay_within_budget_and_expire(llama_package: Path) -> None:
    server = _server_with(llama_package, 1, "l/1", kv_budget_bytes=100_000, idle_timeout_s=0.3)
    step = SessionStep(
        session="a",
        stage="l/1",
        inputs=_tensors(
            {
                "hidden_states": np.ones((1, 8, 128), dtype=np.float32),
                "position_ids": np.arange(8, dtype=np.int64)[None, :],
            }
        ),
    )
    server.session("peer", SessionOpen(session="a", stage="l/1"))
    out = server.session("peer", step)
    assert out.outputs["hidden_states_out"].wire == "native"  # type: ignore[union-attr]
    # the cache: 2 blocks x K and V x 2 heads x (8 tokens and room for 32 more) x 32 x 4
    # bytes; and the outputs kept for a replay of the next stage: 8 tokens x 128 x 4 bytes
    used = server.kv_bytes()
    assert room(8) == 8 + 32
    assert used == 2 * 2 * 2 * 40 * 32 * 4 + 8 * 128 * 4 and out.past_len == 8  # type: ignore[union-attr]
    # the work the heartbeats report: a session opened, a token generated, two runs of 8
    # positions; a check's session (a shadow, the broker's probe) is no user's
    server.session("peer", SessionOpen(session="x", stage="l/1", check=True))
    server.session("peer", SessionStep(session="x", stage="l/1", inputs=step.inputs))
    server.session("peer", SessionClose(session="x", stage="l/1"))
    (work,) = server.work_done()
    assert (work.key, work.requests, work.tokens) == ("l/1", 1, 1)
    assert work.positions == 2 * 8 and work.runs == 2 and work.busy_s > 0
    server.session("peer", SessionOpen(session="b", stage="l/1"))
    server.session("peer", SessionStep(session="b", stage="l/1", inputs=step.inputs))
    with pytest.raises(Refused) as full:  # a third 44 KiB session would pass 100 KB
        server.session("peer", SessionOpen(session="c", stage="l/1"))
        server.session("peer", SessionStep(session="c", stage="l/1", inputs=step.inputs))
    assert full.value.code == ErrorCode.BUSY
    with pytest.raises(Refused) as other:  # sessions belong to the peer that opened them
        server.session("intruder", SessionStep(session="a", stage="l/1", inputs=step.inputs))
    assert other.value.code == ErrorCode.NOT_FOUND
    time.sleep(0.4)
    assert server.expire() == 3 and server.kv_bytes() == 0
    # a step sent in the int8 wire format is answered in it
    hidden8 = encode(np.ones((1, 8, 128), dtype=np.float32), "int8")
    server.session("peer", SessionOpen(session="d", stage="l/1"))
    out8 = server.session(
        "peer",
        msgspec.structs.replace(
            step, session="d", inputs={**step.inputs, "hidden_states": hidden8}
        ),
    )
    answer8 = out8.outputs["hidden_states_out"]  # type: ignore[union-attr]
    assert answer8.wire == "int8" and answer8.nbytes == 8 * (128 + 4 * 2)
    server.session("peer", SessionClose(session="d", stage="l/1"))
    with pytest.raises(Refused, match="expired"):
        server.session("peer", step)


def test_fault_options_parse_or_are_refused() -> None:
    assert Fault.parse("die-at-step=3,slow=20") == Fault(die_at_step=3, slow_ms=20.0)
    assert Fault.parse("wrong-output") == Fault(wrong_output=True)
    assert Fault.parse("die-at-step=4,on=m/2") == Fault(die_at_step=4, on="m/2")
    with pytest.raises(ValueError, match="unknown fault"):
        Fault.parse("explode")
    assert Fault.parse(None) is None


def test_addresses_on_all_interfaces_are_announced_as_dialable_ones() -> None:
    from provider.addresses import dialable

    out = dialable(["/ip4/0.0.0.0/tcp/4001/p2p/12D3KooWX", "/ip4/10.1.2.3/tcp/9/p2p/12D3KooWX"])
    assert "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWX" in out
    assert not any(a.startswith("/ip4/0.0.0.0/") for a in out)
    assert out[-1] == "/ip4/10.1.2.3/tcp/9/p2p/12D3KooWX"
    expanded = out[:-1]
    assert expanded[-1].startswith("/ip4/127."), "loopback is tried last"


def test_chained_requests_follow_only_a_route_the_broker_signed(minilm_package: Path) -> None:
    """A provider runs a chained request only on the hop the broker's signed route gives it,
    from the peer before it, before the route expires; it then relays its hidden states to the
    next hop (stages that are also its own run here first), or its outputs to the broker."""
    broker, me, other = Identity.ephemeral(), Identity.ephemeral(), Identity.ephemeral()
    server = _server_with(minilm_package, 1, "m/1")
    stage2 = load_package(minilm_package, stages=[2])
    info2 = stage2.manifest.stages[2]
    server.add(LoadedStage("m/2", info2, OrtExecutor(stage2.models[2]), "active"))
    server.peer_id, server.broker_id = me.peer_id, broker.peer_id
    feeds = _tensors(_minilm_feeds(4, 0.5))

    def chained(
        route: list[Hop],
        hop: int = 0,
        *,
        signer: Identity = broker,
        ttl: float = 60,
        inputs: dict[str, Tensor] = feeds,
    ) -> Forward:
        expires = time.time() + ttl
        sig = signer.sign(route_bytes("c1", route, expires), domain=ROUTE_DOMAIN)
        return Forward(
            stage=route[hop].stage,
            inputs=inputs,
            chain="c1",
            route=route,
            hop=hop,
            expires=expires,
            signature=sig,
        )

    mine_then_other = [Hop(me.peer_id, "m/1"), Hop(other.peer_id, "m/2", ["/ip4/1.2.3.4/tcp/9"])]
    refusals = {
        "not signed by": (broker.peer_id, chained(mine_then_other, signer=other)),
        "comes from another peer": (other.peer_id, chained(mine_then_other)),
        "expired": (broker.peer_id, chained(mine_then_other, ttl=-1)),
        "not this provider's": (broker.peer_id, chained(mine_then_other[::-1])),
    }
    for reason, (sender, request) in refusals.items():
        with pytest.raises(Refused, match=reason):
            server.forward(sender, request)
    tampered = chained(mine_then_other)
    tampered = msgspec.structs.replace(
        tampered, route=[mine_then_other[0], Hop(broker.peer_id, "m/2")]
    )
    with pytest.raises(Refused, match="not signed by"):
        server.forward(broker.peer_id, tampered)

    one = server.forward(broker.peer_id, chained(mine_then_other))
    assert isinstance(one, Relay) and one.peer == other.peer_id
    # (dialled as a whole multiaddr: the route may leave the peer id off its addresses)
    assert one.addrs == [f"/ip4/1.2.3.4/tcp/9/p2p/{other.peer_id}"] and one.message.hop == 1
    want1 = server.stages["m/1"].executor.run(_minilm_feeds(4, 0.5))["hidden_states_out"]
    sent = one.message.inputs["hidden_states"].to_numpy()
    assert np.array_equal(sent, want1) and "attention_mask" in one.message.inputs
    later = ForwardResult(outputs={}, hops=[HopDone(other.peer_id, "m/2", 1.0)])
    assert [h.peer for h in one.finish(later).hops] == [me.peer_id, other.peer_id]
    broken = one.finish(ConnectionLost("gone"))
    assert isinstance(broken, ChainBroken) and broken.peer == other.peer_id
    # Both hops ours: both run here, and the outputs go to the broker.
    both = server.forward(broker.peer_id, chained([Hop(me.peer_id, "m/1"), Hop(me.peer_id, "m/2")]))
    assert isinstance(both, Relay) and both.peer == broker.peer_id
    want2 = server.stages["m/2"].executor.run(
        {"hidden_states": want1, "attention_mask": np.ones((1, 4), dtype=np.int64)}
    )["hidden_states_out"]
    assert np.array_equal(both.message.outputs["hidden_states_out"].to_numpy(), want2)
    answer = both.finish(ChainAccepted(chain="c1"))
    assert [(h.peer, h.stage) for h in answer.hops] == [(me.peer_id, "m/1"), (me.peer_id, "m/2")]
    # Hidden states sent as int8 blocks: the answer goes on in that format, and two hops on
    # one provider compute what they would on two (the int8 hop between them included).
    int8 = {**feeds, "hidden_states": encode(_minilm_feeds(4, 0.5)["hidden_states"], "int8")}
    both8 = server.forward(
        broker.peer_id,
        chained([Hop(me.peer_id, "m/1"), Hop(me.peer_id, "m/2")], inputs=int8),
    )
    assert isinstance(both8, Relay)
    out8 = both8.message.outputs["hidden_states_out"]
    mask = np.ones((1, 4), dtype=np.int64)
    hop1 = server.stages["m/1"].executor.run(
        {"hidden_states": int8["hidden_states"].to_numpy(), "attention_mask": mask}
    )["hidden_states_out"]
    hop2 = server.stages["m/2"].executor.run(
        {"hidden_states": through_wire(hop1, "int8"), "attention_mask": mask}
    )["hidden_states_out"]
    assert out8.wire == "int8" and np.array_equal(out8.to_numpy(), through_wire(hop2, "int8"))
    assert not np.array_equal(out8.to_numpy(), want2)
    both8.finish(ChainAccepted(chain="c1"))
    assert server.drain(1.0)  # the relays were finished: nothing is left in flight
