"""Hole punching in the lab: a peer behind a cone NAT, reachable only through its port at
the broker's relay, is dialled through it from another cone home; the two punch a direct
TCP connection (simultaneous open from their listening ports), and traffic then goes there,
not through the relay: in each of 20 attempts. Two peers behind symmetric NATs stay relayed
and still exchange data. A client generating on a relayed provider in a cone home does so
over a direct connection, with the tokens of a local run."""

from __future__ import annotations

import base64
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lab.topology import BROKER_IP, Lab
from tests.procs import Proc, fusionai
from tests.test_broker.test_gateway import local_greedy
from tests.test_lab.conftest import need_lab
from tests.test_lab.test_embed import CLIENT  # an embed job's client, run in a home

pytestmark = [pytest.mark.lab, pytest.mark.timeout(420)]
RELAY_PORT = 7372
LISTEN_PORT = 4700
ATTEMPTS = 20
PAYLOAD = 256 * 1024  # echoed once per attempt after the punch: 512 KiB across the link

RELAY = """
import asyncio, json, sys
from p2p.relay import RelayServer
async def main():
    count = [0]
    def seen(chunk): count[0] += len(chunk)
    relay = RelayServer("0.0.0.0", int(sys.argv[1]), seen=seen)
    await relay.start()
    print(json.dumps({"event": "ready"}), flush=True)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps({"event": "forwarded", "bytes": count[0]}), flush=True)
    await relay.close()
asyncio.run(main())
"""
RESPONDER = """
import asyncio, json, sys
from p2p import Host, HostConfig
from p2p.punch import Puncher
from p2p.relay import RelayClient
from p2p.testing import serve_test_protocols
async def main():
    relay, port = (sys.argv[1], int(sys.argv[2])), int(sys.argv[3])
    async with Host(HostConfig(listen=(f"/ip4/0.0.0.0/tcp/{port}",))) as host:
        serve_test_protocols(host)
        held = RelayClient(host.identity, relay, ("127.0.0.1", port))
        Puncher(host, lambda: relay, origin=held.origin)
        print(json.dumps({"event": "relayed", "address": await held.reserve()}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await held.close()
asyncio.run(main())
"""
INITIATOR = """
import asyncio, json, sys
from p2p import Host, HostConfig
from p2p.punch import Puncher
from p2p.testing import ECHO_COMPUTE, Echo
def say(**event): print(json.dumps(event), flush=True)
async def main():
    target, attempts, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    loop = asyncio.get_running_loop()
    for i in range(attempts):
        async with Host(HostConfig(listen=("/ip4/0.0.0.0/tcp/0",))) as host:
            puncher = Puncher(host)
            peer = await host.connect(target)
            before = puncher.remote_addrs(peer)
            p = await puncher.punch(peer)
            say(event="punched", attempt=i, direct=p.direct, tries=p.attempts, seconds=p.seconds,
                rtt=p.rtt, reason=p.reason, before=before, after=puncher.remote_addrs(peer))
            await loop.run_in_executor(None, sys.stdin.readline)  # the test reads the relay
            answer = await host.request(peer, ECHO_COMPUTE, Echo(data=b"x" * size, n=i),
                                        timeout=60)
            say(event="echoed", ok=answer.data == b"x" * size and answer.n == i + 2,
                over=puncher.remote_addrs(peer))
            await loop.run_in_executor(None, sys.stdin.readline)
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    need_lab()
    with Lab(["cone", "cone", "symmetric", "symmetric"]) as built:
        yield built


def in_ns(lab: Lab, ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, *args]


def start_pair(
    lab: Lab, spawn: Callable[..., Proc], responder_ns: str, initiator_ns: str, attempts: int
) -> tuple[Proc, Proc]:
    """The relay at the broker, a responder holding a port there, and an initiator that
    dials it through the relay `attempts` times, punching each time."""
    relay = spawn(in_ns(lab, lab.broker, "-c", RELAY, str(RELAY_PORT)))
    relay.wait_for("ready", timeout=30)
    responder = spawn(
        in_ns(lab, responder_ns, "-c", RESPONDER, BROKER_IP, str(RELAY_PORT), str(LISTEN_PORT))
    )
    address = responder.wait_for("relayed", timeout=60)["address"]
    assert address.startswith(f"/ip4/{BROKER_IP}/tcp/")
    initiator = spawn(in_ns(lab, initiator_ns, "-c", INITIATOR, address, str(attempts),
                            str(PAYLOAD)))  # fmt: skip
    return relay, initiator


def forwarded(relay: Proc) -> int:
    since = relay.mark()
    relay.send({})
    return int(relay.wait_for("forwarded", timeout=10, since=since)["bytes"])


def run_attempts(relay: Proc, initiator: Proc, attempts: int) -> list[dict[str, Any]]:
    """Each attempt's punch, with the bytes the relay forwarded while its echo ran."""
    results = []
    for i in range(attempts):
        punched = initiator.wait_for("punched", lambda e, i=i: e["attempt"] == i, timeout=90)
        ahead = forwarded(relay)
        since = initiator.mark()
        initiator.send({})
        echoed = initiator.wait_for("echoed", timeout=60, since=since)
        results.append({**punched, **echoed, "relayed_bytes": forwarded(relay) - ahead})
        initiator.send({})
    return results


def test_two_cone_homes_end_up_directly_connected_in_each_of_20_attempts(
    lab: Lab, spawn: Callable[..., Proc]
) -> None:
    responder_home, initiator_home = lab.homes[0], lab.homes[1]
    relay, initiator = start_pair(lab, spawn, responder_home.host, initiator_home.host, ATTEMPTS)
    results = run_attempts(relay, initiator, ATTEMPTS)
    direct = f"/ip4/{responder_home.wan_ip}/tcp/{LISTEN_PORT}"
    for r in results:
        assert r["before"] and all(a.startswith(f"/ip4/{BROKER_IP}/") for a in r["before"]), r
        assert r["direct"] == direct, r  # the other home's router, not the relay
        assert r["after"] == [direct] and r["over"] == [direct], r  # the relayed one closed
        assert r["ok"], r
        # the echo (2 x 256 KiB) went direct: the relay forwarded (almost) nothing meanwhile
        assert r["relayed_bytes"] < 4096, r
    seconds = [r["seconds"] for r in results]
    print(
        f"\nhole punching, cone to cone: {len(results)}/{ATTEMPTS} direct; tries "
        f"{[r['tries'] for r in results]}; punch time median {statistics.median(seconds):.3f} s, "
        f"max {max(seconds):.3f} s; relayed RTT median "
        f"{statistics.median(r['rtt'] for r in results) * 1000:.0f} ms"
    )


def test_two_symmetric_homes_stay_relayed_and_still_work(
    lab: Lab, spawn: Callable[..., Proc]
) -> None:
    responder_home, initiator_home = lab.homes[2], lab.homes[3]
    relay, initiator = start_pair(lab, spawn, responder_home.host, initiator_home.host, 1)
    (r,) = run_attempts(relay, initiator, 1)
    # the observation shows the NAT changed the port: no try is made (each would fail)
    assert r["direct"] is None and "symmetric" in r["reason"] and r["tries"] == 0, r
    assert r["after"] == r["before"] and r["over"] == r["before"], r  # still the relay's
    assert all(a.startswith(f"/ip4/{BROKER_IP}/") for a in r["after"]), r
    assert r["ok"], r
    assert r["relayed_bytes"] > 2 * PAYLOAD, r  # and the echo went through the relay
    print(f"\nsymmetric to symmetric: relayed, told in {r['seconds']:.2f} s: {r['reason']}")


GENERATE = """
import asyncio, json, sys, time
from client import AsyncClient
async def main():
    async with AsyncClient(sys.argv[1], timeout=60) as fa:
        await fa.add_model(sys.argv[2])
        end = time.monotonic() + 120
        while not (await fa.model("tiny-llama")).ready:
            assert time.monotonic() < end, "the model was never served"
            await asyncio.sleep(0.5)
        answer = await fa.generate(sys.argv[3], 8, stream=False, model="tiny-llama")
        host = await fa._p2p()
        conns = {p: fa._puncher.remote_addrs(p) for p in host.connected_peers()}
        print(json.dumps({"tokens": answer.tokens, "connections": conns}))
asyncio.run(main())
"""


def test_a_client_generates_on_a_relayed_provider_over_a_punched_connection(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path, llama_package: Path
) -> None:
    provider_home, client_home = lab.homes[0], lab.homes[1]
    broker = spawn(
        ["ip", "netns", "exec", lab.broker, *fusionai(
            "broker", "start", "--listen", "/ip4/0.0.0.0/tcp/7370", "--http", "0.0.0.0:7371",
            "--public-url", f"http://{BROKER_IP}:7371", "--data-dir", str(tmp_path / "broker"),
            "--heartbeat-s", "1", "--json",
        )]
    )  # fmt: skip
    peer = broker.wait_for("broker_started", timeout=60)["peer"]
    provider = spawn(
        ["ip", "netns", "exec", provider_home.host, *fusionai(
            "provider", "start", "--broker", f"/ip4/{BROKER_IP}/tcp/7370/p2p/{peer}",
            "--data-dir", str(tmp_path / "provider"), "--listen",
            f"/ip4/0.0.0.0/tcp/{LISTEN_PORT}", "--max-memory", "2", "--no-upnp", "--json",
        )]
    )  # fmt: skip
    assert provider.wait_for("relay", timeout=120)["held"] is True
    provider_id = provider.wait_for("listening")["peer_id"]

    tokens, _ = local_greedy(llama_package, "Models travel as ONNX", 8)
    out = lab.run(client_home.host, sys.executable, "-c", GENERATE, f"http://{BROKER_IP}:7371",
                  str(llama_package), "Models travel as ONNX", timeout=240)  # fmt: skip
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["tokens"] == tokens
    direct = f"/ip4/{provider_home.wan_ip}/tcp/{LISTEN_PORT}"
    assert answer["connections"][provider_id] == [direct], answer


def test_chained_hops_between_relayed_cone_providers_punch_a_direct_connection(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    """A batch job's activations go provider to provider; two providers reachable only
    through the broker's relay punch a direct connection before the first one goes across."""
    from cli.demo_models import build_minilm
    from tests.procs import sample_texts
    from tests.test_broker.conftest import local_embeddings
    from tests.test_lab.conftest import start_broker, start_provider

    package = tmp_path / "minilm2"
    build_minilm(package, 2)
    broker, addr = start_broker(lab, spawn, tmp_path / "broker")
    providers, wan = {}, {}
    for home in lab.homes[:2]:  # both cone homes, no UPnP there: relayed
        proc = start_provider(spawn, home.host, addr, tmp_path / f"p{home.index}", "--no-upnp",
                              "--listen", f"/ip4/0.0.0.0/tcp/{LISTEN_PORT}")  # fmt: skip
        peer = proc.wait_for("listening", timeout=120)["peer_id"]
        providers[peer], wan[peer] = proc, f"/ip4/{home.wan_ip}/tcp/{LISTEN_PORT}"
    for peer in providers:
        broker.wait_for("provider_reach", lambda e, p=peer: e["peer"] == p
                        and e["reach"] == "relayed", timeout=120, since=0)  # fmt: skip

    texts = sample_texts(16)
    out = lab.run(lab.homes[2].host, sys.executable, "-c", CLIENT, f"http://{BROKER_IP}:7371",
                  str(package), json.dumps(texts), timeout=240)  # fmt: skip
    answer = json.loads(out.strip().splitlines()[-1])
    got = np.frombuffer(base64.b64decode(answer["data"]), "<f4").reshape(answer["shape"])
    assert np.abs(got - local_embeddings(package, texts)).max() <= 1e-4
    # the first stage's provider punched to the second's (the other cone home's router)
    punches = []
    for peer, proc in providers.items():
        proc.drain_events()
        punches += [(peer, e) for e in proc.events if e["event"] == "punched"]
    assert punches, "no provider punched to its next hop"
    assert all(e["direct"] == wan[e["peer"]] and e["peer"] != peer for peer, e in punches), punches
    print(f"\nchained hop punched: {[(e['seconds'], e['attempts']) for _, e in punches]}")
