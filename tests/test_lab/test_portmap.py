"""UPnP in the lab: a provider in the UPnP home asks its router for a port mapping,
announces it, and the broker finds it reachable through it; the mapping is gone once the
provider has exited. In the cone home (no IGD) it goes on without one."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lab.topology import Lab
from tests.procs import Proc
from tests.test_lab.conftest import probe, start_broker, start_provider

pytestmark = [pytest.mark.lab, pytest.mark.timeout(240)]
LIST = (
    "import json, miniupnpc\n"
    "u = miniupnpc.UPnP(); u.discoverdelay = 1500; u.discover(); u.selectigd()\n"
    "out, i = [], 0\n"
    "while (m := u.getgenericportmapping(i)) is not None:\n"
    "    out.append(m[0]); i += 1\n"
    "print(json.dumps(out))\n"
)


def test_a_provider_behind_a_upnp_router_maps_a_port_and_removes_it_on_exit(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    broker, addr = start_broker(lab, spawn, tmp_path / "broker")
    cone, upnp = lab.homes[0], lab.homes[2]
    mapped = start_provider(spawn, upnp.host, addr, tmp_path / "upnp",
                            "--listen", "/ip4/0.0.0.0/tcp/4500")  # fmt: skip
    plain = start_provider(spawn, cone.host, addr, tmp_path / "cone",
                           "--listen", "/ip4/0.0.0.0/tcp/4600")  # fmt: skip
    event = mapped.wait_for("port_mapping", timeout=120)
    assert event["mapped"] is True and event["address"] == f"/ip4/{upnp.wan_ip}/tcp/4500"
    assert plain.wait_for("port_mapping", timeout=120)["mapped"] is False  # no IGD there
    peer = mapped.wait_for("listening")["peer_id"]
    reach = broker.wait_for("provider_reach", lambda e: e["peer"] == peer, timeout=120)
    assert reach["reach"] == "mapped" and reach["address"].startswith(event["address"])
    assert probe(lab.broker, "dial", upnp.wan_ip, "4500")["ok"]
    assert lab.run(upnp.host, sys.executable, "-c", LIST).strip() == "[4500]"
    mapped.signal(signal.SIGTERM)
    assert mapped.proc.wait(timeout=60) == 0
    assert lab.run(upnp.host, sys.executable, "-c", LIST).strip() == "[]"  # removed on exit
    assert not probe(lab.broker, "dial", upnp.wan_ip, "4500")["ok"]
