"""The relay in the lab: providers in a cone home and a symmetric home, whom nobody can dial,
hold ports at the broker's relay; a client in a third home generates through them with the
tokens of a local run, and what the relay forwarded never holds a marker sent through it.
A relay that answers clients itself instead of forwarding is refused; a session whose relay
dies goes on through the ports the providers reserve when it is back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lab.topology import BROKER_IP, RELAY_IP, Lab
from tests.procs import ROOT, Proc
from tests.test_broker.test_gateway import local_greedy
from tests.test_lab.conftest import start_broker, start_provider

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300)]
PROMPT = "Models travel as ONNX"
CLIENT = """
import json, sys, time
from client import Client
with Client(sys.argv[1], timeout=60) as fa:
    fa.add_model(sys.argv[2])
    end = time.monotonic() + 120
    while not fa.model("tiny-llama").ready:
        assert time.monotonic() < end, "the model was never served"
        time.sleep(0.5)
    answer = fa.generate(sys.argv[3], 8, stream=False, model="tiny-llama")
    print(json.dumps({"tokens": answer.tokens, "failovers": len(answer.failovers)}))
"""
CAPTURE = """
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
s.bind(("eth0", 0)); s.settimeout(0.5)
end = time.monotonic() + float(sys.argv[2])
with open(sys.argv[1], "wb") as out:
    print("ready", flush=True)
    while time.monotonic() < end:
        try:
            out.write(s.recv(65536))
        except socket.timeout:
            pass
"""
MARKER = """
import asyncio, sys
from p2p import Host, HostConfig
from proto.ping import PING, Ping
async def main():
    async with Host(HostConfig(listen=("/ip4/0.0.0.0/tcp/0",))) as h:
        peer = await h.connect(sys.argv[1])
        marker = Ping(nonce=1, payload=b"MARKER-TENSOR-" * 500)
        answer = await h.request(peer, PING, marker, timeout=30)
        assert answer.nonce == 1
        print("sent")
asyncio.run(main())
"""


def test_providers_behind_nat_serve_a_generation_through_the_relay(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path, llama_package: Path
) -> None:
    cone, symmetric, elsewhere = lab.homes[0], lab.homes[1], lab.homes[3]
    broker, addr = start_broker(lab, spawn, tmp_path / "broker")
    relayed = {}
    for home in (cone, symmetric):
        proc = start_provider(spawn, home.host, addr, tmp_path / home.kind,
                              "--listen", "/ip4/0.0.0.0/tcp/4700", "--no-upnp")  # fmt: skip
        held = proc.wait_for("relay", timeout=120)
        assert held["held"] is True and held["address"].startswith(f"/ip4/{BROKER_IP}/tcp/")
        relayed[proc.wait_for("listening")["peer_id"]] = held["address"]
    for p, address in relayed.items():
        reach = broker.wait_for(
            "provider_reach", lambda e, p=p: e["peer"] == p and e["reach"] != "unreachable",
            timeout=60,
        )  # fmt: skip
        assert reach["reach"] == "relayed" and reach["address"] == address

    tokens, _ = local_greedy(llama_package, PROMPT, 8)
    out = lab.run(elsewhere.host, sys.executable, "-c", CLIENT, f"http://{BROKER_IP}:7371",
                  str(llama_package), PROMPT, timeout=240)  # fmt: skip
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer == {"tokens": tokens[: len(answer["tokens"])], "failovers": 0}
    assert len(answer["tokens"]) == len(tokens)

    # what the relay forwards is encrypted end to end: a marker sent through it is not there
    capture = tmp_path / "relay.pcap"
    sniffer = lab.spawn(lab.broker, sys.executable, "-c", CAPTURE, str(capture), "20",
                        stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sniffer.stdout is not None and sniffer.stdout.readline().strip() == "ready"
    target = next(iter(relayed.values()))
    sent = lab.run(elsewhere.host, sys.executable, "-c", MARKER, target, timeout=60)
    assert "sent" in sent
    sniffer.kill()
    sniffer.wait()
    seen = capture.read_bytes()
    assert len(seen) > 7000 * 2, "the capture saw the relayed bytes go by"
    assert b"MARKER-TENSOR-" not in seen


FAKE_RELAY = """
import asyncio
from p2p import Host, HostConfig
from p2p.relay import RelayServer, splice
class Answering(RelayServer):  # the relay's control protocol, but it answers clients itself
    async def _forward(self, r, reader, writer):
        print("answered", flush=True)
        await splice((reader, writer), await asyncio.open_connection("127.0.0.1", self.own))
async def main():
    async with Host(HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))) as own:
        relay = Answering("0.0.0.0", 7400)
        relay.own = int(own.addrs[0].split("/")[4])
        await relay.start()
        print("ready", flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""
RESERVE = """
import asyncio, sys
from p2p import Host, HostConfig
from p2p.relay import RelayClient
async def main():
    async with Host(HostConfig(listen=("/ip4/0.0.0.0/tcp/0",))) as me:
        local = ("127.0.0.1", int(me.addrs[0].split("/")[4]))
        print(await RelayClient(me.identity, (sys.argv[1], 7400), local).reserve(), flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""
DIAL = """
import asyncio, sys
from p2p import Host, HostConfig, P2PError
async def main():
    async with Host(HostConfig(listen=("/ip4/0.0.0.0/tcp/0",))) as h:
        try:
            print("connected to", await h.connect(sys.argv[1]))
        except (P2PError, ValueError) as exc:
            print("refused:", exc)
asyncio.run(main())
"""


def test_a_relay_that_answers_instead_of_forwarding_is_refused(lab: Lab) -> None:
    """A 'relay' on the Internet takes the cone home's provider's signed reservation, then
    answers the client itself: the Noise handshake shows its key, not the provider's."""
    fake = lab.spawn(lab.relay, sys.executable, "-c", FAKE_RELAY,
                     stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    assert fake.stdout is not None
    assert fake.stdout.readline().strip() == "ready"  # listening before the provider dials it
    provider = lab.spawn(lab.homes[0].host, sys.executable, "-c", RESERVE, RELAY_IP,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    assert provider.stdout is not None
    address = provider.stdout.readline().strip()
    assert address.startswith(f"/ip4/{RELAY_IP}/tcp/")
    said = lab.run(lab.homes[3].host, sys.executable, "-c", DIAL, address, timeout=60)
    assert said.startswith("refused:"), said
    assert fake.stdout.readline().strip() == "answered"  # the client did reach the fake


PAUSED = """
import json, sys, time
from client import Client
with Client(sys.argv[1], timeout=30) as fa:
    fa.add_model(sys.argv[2])
    end = time.monotonic() + 120
    while not fa.model("tiny-llama").ready:
        assert time.monotonic() < end, "the model was never served"
        time.sleep(0.5)
    stream = fa.generate(sys.argv[3], 12, model="tiny-llama")
    for n, _ in enumerate(stream, 1):
        if n == 3:
            print("paused", flush=True)
            sys.stdin.readline()  # the test kills the broker and its relay, then starts it again
            while not fa.model("tiny-llama").ready:
                time.sleep(0.5)
    r = stream.result
    print(json.dumps({"tokens": r.tokens, "failovers": [f.reason for f in r.failovers]}))
"""


def paused_client(lab: Lab, package: Path) -> subprocess.Popen[Any]:
    """The `PAUSED` client in the fourth home, once it has paused mid-generation."""
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "cwd": ROOT}
    client = lab.spawn(lab.homes[3].host, sys.executable, "-c", PAUSED,
                       f"http://{BROKER_IP}:7371", str(package), PROMPT, **pipes)  # fmt: skip
    assert client.stdout is not None and client.stdin is not None
    assert client.stdout.readline().strip() == "paused"
    return client


def test_a_session_recovers_when_its_relay_dies(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path, llama_package: Path
) -> None:
    """Both stages are served by relayed providers; mid-generation the broker, and with it
    the relay every step crosses, is killed and started again: the providers reserve new
    ports there, and the client's session goes on through them with a local run's tokens."""
    broker, addr = start_broker(lab, spawn, tmp_path / "broker")
    for home in lab.homes[:2]:
        proc = start_provider(spawn, home.host, addr, tmp_path / home.kind,
                              "--listen", "/ip4/0.0.0.0/tcp/4750", "--no-upnp")  # fmt: skip
        assert proc.wait_for("relay", timeout=120)["held"] is True
    tokens, _ = local_greedy(llama_package, PROMPT, 12)
    client = paused_client(lab, llama_package)
    broker.signal(signal.SIGKILL)
    broker.wait(timeout=10)
    broker, _ = start_broker(lab, spawn, tmp_path / "broker")  # the same identity and ports
    back: set[str] = set()  # both providers rejoined, with new ports at the new relay
    for _ in range(2):
        back.add(broker.wait_for("provider_reach", lambda e: e["reach"] == "relayed"
                                 and e["peer"] not in back, timeout=120)["peer"])  # fmt: skip
    client.stdin.write("go\n")
    client.stdin.flush()
    answer = json.loads(client.stdout.readline())
    assert client.wait(timeout=60) == 0
    assert answer["tokens"] == tokens and answer["failovers"], answer


def test_a_provider_relay_carries_providers_and_its_death_moves_them_to_the_brokers(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path, llama_package: Path
) -> None:
    """A provider on a public address offers a relay (40 Mbit/s): the broker checks it and,
    its own relay being capped at 1 Mbit/s, sends the providers nobody can dial there, with
    a ticket the relay asks for. A client generates through it; mid-generation the relay's
    provider dies: the providers reserve ports at the broker's relay instead, and the session
    goes on with a local run's tokens."""
    broker, addr = start_broker(lab, spawn, tmp_path / "broker", "--relay-mbit", "1")
    # (too little memory for any stage: it only relays)
    relay = start_provider(spawn, lab.relay, addr, tmp_path / "relay", "--offer-relay", "40",
                           "--max-memory", "0.0001")  # fmt: skip
    assert relay.wait_for("relay_offer", timeout=120)["running"] is True
    offered = broker.wait_for("relay_offer", timeout=120)
    assert offered["taken"] is True, offered
    providers = []
    for home in lab.homes[:2]:  # (no punching: every step crosses the relay)
        proc = start_provider(spawn, home.host, addr, tmp_path / home.kind, "--listen",
                              "/ip4/0.0.0.0/tcp/4760", "--no-upnp", "--no-punch")  # fmt: skip
        held = proc.wait_for("relay", lambda e: e["held"], timeout=120)
        assert held["address"].startswith(f"/ip4/{RELAY_IP}/tcp/"), held
        providers.append(proc)
    for proc in providers:
        peer = proc.wait_for("listening")["peer_id"]
        broker.wait_for("provider_reach", lambda e, p=peer: e["peer"] == p
                        and e["reach"] == "relayed", timeout=120, since=0)  # fmt: skip
    tokens, _ = local_greedy(llama_package, PROMPT, 12)
    client = paused_client(lab, llama_package)
    marks = [proc.mark() for proc in providers]
    relay.signal(signal.SIGKILL)
    relay.wait(timeout=10)
    for proc, since in zip(providers, marks, strict=True):
        held = proc.wait_for("relay", lambda e: e["held"], timeout=120, since=since)
        assert held["address"].startswith(f"/ip4/{BROKER_IP}/tcp/"), held
    client.stdin.write("go\n")
    client.stdin.flush()
    answer = json.loads(client.stdout.readline())
    assert client.wait(timeout=60) == 0
    assert answer["tokens"] == tokens and answer["failovers"], answer
