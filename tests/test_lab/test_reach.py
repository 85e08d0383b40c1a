"""Reachability in the lab: the broker dials each provider back where it saw it connect
from, and reports what each home allows: a public host direct, a port forwarded by hand
mapped, homes behind NAT with nothing forwarded (no UPnP asked, no relay) unreachable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lab.topology import RELAY_IP, Lab
from tests.procs import Proc
from tests.test_lab.conftest import start_broker, start_provider

pytestmark = [pytest.mark.lab, pytest.mark.timeout(240)]


def test_the_broker_reports_what_each_home_allows(
    lab: Lab, spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    broker, addr = start_broker(lab, spawn, tmp_path / "broker", "--no-relay")
    cone, symmetric, upnp = lab.homes[:3]
    # a port forwarded by hand on the cone home's router, announced by its provider
    forward = ["-i", "wan", "-p", "tcp", "--dport", "4100", "-j", "DNAT"]
    to = ["--to-destination", f"{cone.host_ip}:4100"]
    lab.run(cone.router, "iptables", "-t", "nat", "-A", "PREROUTING", *forward, *to)
    expect = {}
    for ns, public, extra, reach in (
        (lab.relay, RELAY_IP, ("--listen", "/ip4/0.0.0.0/tcp/4000"), "direct"),
        (cone.host, cone.wan_ip, ("--listen", "/ip4/0.0.0.0/tcp/4100",
                                  "--announce", f"/ip4/{cone.wan_ip}/tcp/4100"), "mapped"),
        (symmetric.host, symmetric.wan_ip, ("--listen", "/ip4/0.0.0.0/tcp/4200"), "unreachable"),
        (upnp.host, upnp.wan_ip, ("--listen", "/ip4/0.0.0.0/tcp/4300", "--no-upnp"),
         "unreachable"),
    ):  # fmt: skip
        proc = start_provider(spawn, ns, addr, tmp_path / ns, *extra)
        expect[proc.wait_for("listening", timeout=120)["peer_id"]] = (ns, public, reach)
    seen: dict[str, dict[str, str]] = {}
    for _ in expect:
        event = broker.wait_for("provider_reach", lambda e: e["peer"] not in seen, timeout=120)
        seen[event["peer"]] = event
    for peer, (ns, public, reach) in expect.items():
        assert seen[peer]["reach"] == reach, (ns, seen[peer])
        assert seen[peer]["observed"].startswith(f"/ip4/{public}/tcp/"), (ns, seen[peer])
