"""Generation across the home internet with a death: four providers behind the lab's
routers (two behind the cone, relayed; one behind the symmetric, relayed; one behind the UPnP
router, mapped) serve a model with backups; a client in another home streams a generation,
the provider serving its first stage is killed mid-answer, and the tokens are the local run's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lab.topology import BROKER_IP, Lab
from tests.procs import ROOT, Proc
from tests.test_broker.test_gateway import local_greedy
from tests.test_lab.conftest import start_broker, start_provider

pytestmark = [pytest.mark.lab, pytest.mark.timeout(420)]
PROMPT = "Models travel as ONNX"
STEPS = 16
CLIENT = """
import json, sys, time
from client import Client
with Client(sys.argv[1], timeout=30) as fa:
    fa.add_model(sys.argv[2])
    end = time.monotonic() + 180
    while True:
        route = fa.model("tiny-llama")
        if route.ready and all(s.backups for s in route.stages):
            break
        assert time.monotonic() < end, "the model was never served with backups"
        time.sleep(0.5)
    stream = fa.generate(sys.argv[3], int(sys.argv[4]), model="tiny-llama")
    n = 0
    for _ in stream:
        n += 1
        if n == 3:
            print(json.dumps({"victim": route.stages[0].providers[0].peer_id}), flush=True)
            sys.stdin.readline()  # the test kills it, then says go on
    r = stream.result
    print(json.dumps({"tokens": r.tokens, "failovers": [f.peer for f in r.failovers]}), flush=True)
"""


def test_a_generation_through_nat_survives_a_provider_death(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path, llama_package: Path
) -> None:
    cone, symmetric, upnp, elsewhere = lab.homes
    broker, addr = start_broker(lab, spawn, tmp_path / "broker")
    procs: dict[str, Proc] = {}
    expect: dict[str, str] = {}
    for i, (home, reach) in enumerate(
        ((cone, "relayed"), (cone, "relayed"), (symmetric, "relayed"), (upnp, "mapped"))
    ):
        listen = f"/ip4/0.0.0.0/tcp/{4800 + i}"
        proc = start_provider(spawn, home.host, addr, tmp_path / f"p{i}",
                              "--listen", listen, "--drain", "5")  # fmt: skip
        peer = proc.wait_for("listening", timeout=120)["peer_id"]
        procs[peer], expect[peer] = proc, reach
    for peer, reach in expect.items():
        seen = broker.wait_for(
            "provider_reach", lambda e, p=peer, r=reach: e["peer"] == p and e["reach"] == r,
            timeout=120, since=0,
        )  # fmt: skip
        assert seen["reach"] == reach

    tokens, _ = local_greedy(llama_package, PROMPT, STEPS)
    client = lab.spawn(
        elsewhere.host, sys.executable, "-c", CLIENT, f"http://{BROKER_IP}:7371",
        str(llama_package), PROMPT, str(STEPS),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert client.stdout is not None and client.stdin is not None
    victim = json.loads(client.stdout.readline())["victim"]
    procs[victim].signal(signal.SIGKILL)
    assert procs[victim].proc.wait(timeout=10) != 0
    client.stdin.write("go\n")
    client.stdin.flush()
    answer = json.loads(client.stdout.readline())
    assert client.wait(timeout=60) == 0
    assert answer["tokens"] == tokens[: len(answer["tokens"])] and len(answer["tokens"]) == len(
        tokens
    )
    assert victim in answer["failovers"]
