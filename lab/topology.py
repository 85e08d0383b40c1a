"""The lab's network: an Internet segment, a broker host on it, and homes behind NAT routers.

    Internet (namespace `inet`, bridge br0, 203.0.113.0/24)
      ├── broker    eth0 203.0.113.10
      ├── relay     eth0 203.0.113.11          (a second public host, for relays)
      ├── stun      eth0 203.0.113.2 and .3    (a STUN server, `lab.stun`)
      └── home i:   router wan 203.0.113.(100+i) ── NAT ── lan 10.i.0.1 ── host eth0 10.i.0.2

A home's router is one of three kinds: `cone` (iptables MASQUERADE: the same public port for a
socket whatever it talks to, inbound only from where it has sent: port-restricted cone),
`symmetric` (MASQUERADE --random-fully: a new public port per destination) or `upnp` (cone
plus a UPnP IGD, miniupnpd, that hosts may ask for port mappings). Routers forward nothing
unsolicited inward. A home's access link (router wan to the Internet) is shaped to
`rate_mbit` each way with `tc tbf` and delayed `delay_ms` each way by `lab.link`.

    with Lab(["cone", "symmetric"]) as lab:
        lab.run(lab.homes[0].host, "python", "-m", "...")

Everything is torn down on exit, whatever happened (namespaces, their processes, the links).
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.net import LabError, ip, missing, remove, sh

INTERNET = "203.0.113"  # TEST-NET-3: the lab's public addresses
BROKER_IP = f"{INTERNET}.10"
RELAY_IP = f"{INTERNET}.11"
STUN_IPS = (f"{INTERNET}.2", f"{INTERNET}.3")
KINDS = ("cone", "symmetric", "upnp")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Home:
    index: int
    kind: str
    router: str  # namespace names
    host: str
    wan_ip: str  # the router's public address
    host_ip: str  # the host's private address

    @property
    def lan_gateway(self) -> str:
        return f"10.{self.index}.0.1"


@dataclass
class Lab:
    kinds: Sequence[str] = KINDS
    rate_mbit: float = 20.0
    delay_ms: float = 25.0
    links: Sequence[tuple[float, float]] = ()  # per home (rate_mbit, delay_ms); else the above
    run_id: str = field(default_factory=lambda: secrets.token_hex(2))
    homes: list[Home] = field(default_factory=list)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"fl{self.run_id}-{role}"

    @property
    def inet(self) -> str:
        return self.ns("inet")

    @property
    def broker(self) -> str:
        return self.ns("broker")

    @property
    def relay(self) -> str:
        return self.ns("relay")

    def __enter__(self) -> Lab:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- building ------------------------------------------------------------------------

    def up(self) -> Lab:
        why = missing()
        if why:
            raise LabError(why)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise LabError(f"unknown router kinds {bad}; known: {', '.join(KINDS)}")
        if self.links and len(self.links) != len(self.kinds):
            raise LabError(f"{len(self.links)} links for {len(self.kinds)} homes")
        self._namespace(self.inet)
        ip(self.inet, "link", "add", "br0", "type", "bridge")
        ip(self.inet, "link", "set", "br0", "up")
        for role, address in (("broker", BROKER_IP), ("relay", RELAY_IP), ("stun", STUN_IPS[0])):
            self._namespace(self.ns(role))
            self._veth(self.ns(role), "eth0", self.inet, role, f"{address}/24")
        ip(self.ns("stun"), "addr", "add", f"{STUN_IPS[1]}/24", "dev", "eth0")
        stun = self.spawn(self.ns("stun"), sys.executable, "-m", "lab.stun", *STUN_IPS,
                          stdout=subprocess.PIPE, cwd=ROOT)  # fmt: skip
        if not stun.stdout or stun.stdout.readline().strip() != b"ready":
            raise LabError("the lab's STUN server did not start")
        for i, kind in enumerate(self.kinds, start=1):
            self._home(i, kind)
        self._neighbours()
        return self

    def _neighbours(self) -> None:
        """Every host on the Internet segment knows every other's link address from the
        start (permanent neighbour entries), as a home router on the real Internet sends
        everything to its provider's gateway, resolved once. Without them, the first packet
        between two homes waited for address resolution over both delayed access links: a
        round trip more (a first UDP round trip over a 20 ms link took 81 ms, 41 with them; a
        failover's dial to its backup 377 ms, 323 with them)."""
        hosts = [(self.ns(role), "eth0") for role in ("broker", "relay", "stun")]
        hosts += [(home.router, "wan") for home in self.homes]
        addresses = {}  # namespace -> (its device, its MAC, its IPv4 addresses)
        for ns, dev in hosts:
            (link,) = json.loads(ip(ns, "-j", "addr", "show", "dev", dev))
            ips = [a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet"]
            addresses[ns] = (dev, link["address"], ips)
        with tempfile.TemporaryDirectory(prefix="fusionai-lab-") as tmp:
            for ns, (dev, _, _) in addresses.items():
                batch = Path(tmp) / f"{ns}.neigh"
                batch.write_text("".join(
                    f"neigh replace {a} lladdr {mac} dev {dev} nud permanent\n"
                    for other, (_, mac, ips) in addresses.items() if other != ns for a in ips
                ))  # fmt: skip
                ip(ns, "-batch", str(batch))

    def link(self, i: int) -> tuple[float, float]:
        """Home `i`'s access link (from 1): (rate in Mbit/s each way, one-way delay in ms)."""
        return self.links[i - 1] if self.links else (self.rate_mbit, self.delay_ms)

    def _namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.names.append(name)
        ip(name, "link", "set", "lo", "up")

    def _veth(self, ns: str, dev: str, bridge_ns: str, port: str, address: str) -> None:
        """A veth from `ns` (named `dev`, with `address`) to the Internet bridge."""
        ip(ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", bridge_ns)
        ip(bridge_ns, "link", "set", port, "master", "br0", "up")
        ip(ns, "addr", "add", address, "dev", dev)
        ip(ns, "link", "set", dev, "up")

    def _home(self, i: int, kind: str) -> None:
        router, host = self.ns(f"r{i}"), self.ns(f"h{i}")
        home = Home(i, kind, router, host, f"{INTERNET}.{100 + i}", f"10.{i}.0.2")
        for name in (router, host):
            self._namespace(name)
        # the access link: router wan <-> Internet bridge, delayed in userspace
        proc = subprocess.Popen(
            [sys.executable, "-m", "lab.link", router, "wan", self.inet, f"wan{i}",
             "--delay-ms", str(self.link(i)[1])],
            stdout=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        self.procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else b""
        if line.strip() != b"ready":
            raise LabError(f"the access link of home {i} did not come up")
        ip(self.inet, "link", "set", f"wan{i}", "master", "br0", "up")
        ip(router, "addr", "add", f"{home.wan_ip}/24", "dev", "wan")
        ip(router, "link", "set", "wan", "up")
        ip(router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", host)
        ip(router, "addr", "add", f"{home.lan_gateway}/24", "dev", "lan")
        ip(router, "link", "set", "lan", "up")
        ip(host, "addr", "add", f"{home.host_ip}/24", "dev", "eth0")
        ip(host, "link", "set", "eth0", "up")
        ip(host, "route", "add", "default", "via", home.lan_gateway)
        self._router(home)
        self.homes.append(home)

    def _router(self, home: Home) -> None:
        r = home.router
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=r)
        masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
        if home.kind == "symmetric":
            masquerade.append("--random-fully")
        sh(*masquerade, ns=r)
        # nothing unsolicited goes in: only answers, and (UPnP) what a mapping forwards
        sh("iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate",
           "ESTABLISHED,RELATED,DNAT", "-j", "ACCEPT", ns=r)  # fmt: skip
        sh("iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP", ns=r)
        mbit = self.link(home.index)[0]
        per_s = mbit * 1e6 / 8
        # A burst of 10 ms at the rate (two frames at least): the link keeps its rate on the
        # small scale too, as the simulator prices every message (a 32 KB burst passed 32 KiB
        # probes of a 0.15 Mbit/s uplink at line rate). Its queue: 200 ms and 32 KB.
        burst = max(2 * 1514, round(per_s * 0.01))
        limit = round(per_s * 0.2) + 32 * 1024
        for dev in ("wan", "lan"):  # upload leaves by wan, download by lan
            sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst",
               str(burst), "limit", str(limit), ns=r)  # fmt: skip
        if home.kind == "upnp":
            self._igd(home)

    def _igd(self, home: Home) -> None:
        """miniupnpd on the router's lan, mapping into its own nftables chains."""
        r = home.router
        tables = """
table inet filter {
    chain miniupnpd {
    }
    chain forward {
        type filter hook forward priority 0; policy accept;
        jump miniupnpd
    }
}
table inet nat {
    chain prerouting_miniupnpd {
    }
    chain postrouting_miniupnpd {
    }
    chain prerouting {
        type nat hook prerouting priority -100; policy accept;
        jump prerouting_miniupnpd
    }
    chain postrouting {
        type nat hook postrouting priority 100; policy accept;
        jump postrouting_miniupnpd
    }
}
"""
        work = Path(tempfile.mkdtemp(prefix=f"{r}-igd-"))
        self.dirs.append(work)
        (work / "rules.nft").write_text(tables)
        sh("nft", "-f", str(work / "rules.nft"), ns=r)
        (work / "miniupnpd.conf").write_text(
            "\n".join(
                [
                    "ext_ifname=wan",
                    "listening_ip=lan",
                    "port=5000",
                    "enable_natpmp=yes",
                    "enable_upnp=yes",
                    "secure_mode=yes",
                    "system_uptime=yes",
                    "upnp_nat_table_name=nat",
                    # its WAN address is a documentation one, which it refuses to map unless
                    # STUN shows the router is reachable there
                    "ext_perform_stun=yes",
                    f"ext_stun_host={STUN_IPS[0]}",
                    "ext_stun_port=3478",
                    f"uuid=fa000000-0000-4000-8000-{home.index:012d}",
                    f"allow 1024-65535 10.{home.index}.0.0/24 1024-65535",
                    "deny 0-65535 0.0.0.0/0 0-65535",
                    "",
                ]
            )
        )
        proc = subprocess.Popen(
            ["ip", "netns", "exec", r, "miniupnpd", "-d", "-f", str(work / "miniupnpd.conf"),
             "-P", str(work / "miniupnpd.pid")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.procs.append(proc)

    # ---- using ---------------------------------------------------------------------------

    def run(self, ns: str, *cmd: str, timeout: float = 60, check: bool = True) -> str:
        return sh(*cmd, ns=ns, timeout=timeout, check=check)

    def spawn(self, ns: str, *cmd: str, **options: Any) -> subprocess.Popen[Any]:
        """A process in namespace `ns` (killed at teardown)."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **options)
        self.procs.append(proc)
        return proc

    # ---- tearing down --------------------------------------------------------------------

    def down(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        remove(self.names)
        for work in self.dirs:
            shutil.rmtree(work, ignore_errors=True)
        self.dirs.clear()
        self.names.clear()
        self.procs.clear()
        self.homes.clear()


def link_reading(
    delay_ms: float = 10.0, rate_mbit: float = 20.0, count: int = 100, size: int = 4_000_000
) -> tuple[float, float]:
    """One of the lab's access links, measured in a lab of one home: (what it adds to each
    way beyond its configured delay, in seconds; the rate it carries over its configured
    rate). The first: its frames are forwarded by a process in user space, and the router's
    NAT; half of the UDP round trip from the home's host to the broker, less the link's delay
    both ways and the round trip between two hosts on the Internet segment alone (the relay
    host to the broker: the probes' own time), medians of `count` round trips each. The
    second: `size` bytes up and then down through it over TCP, in frame bytes (`frame`),
    their mean."""
    with Lab(["cone"], links=[(rate_mbit, delay_ms)]) as lab:
        server = lab.spawn(
            lab.broker, sys.executable, "-m", "lab.probe", "serve", "7003",
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        if server.stdout is None or "ready" not in server.stdout.readline():
            raise LabError("the lab's probe server did not start")
        probe = (sys.executable, "-m", "lab.probe")
        rtt = (*probe, "rtt", BROKER_IP, "7003", "-n", str(count))
        base = json.loads(lab.run(lab.relay, *rtt))["median_ms"]
        home = json.loads(lab.run(lab.homes[0].host, *rtt))["median_ms"]
        lab.run(lab.homes[0].host, *probe, "bulk", BROKER_IP, "7003", str(size))
        up = json.loads(server.stdout.readline())["mbit_s"]  # (as the sink saw it arrive)
        pull = (*probe, "pull", BROKER_IP, "7003", str(size))
        down = json.loads(lab.run(lab.homes[0].host, *pull))["mbit_s"]
    extra = max(0.0, home - 2 * delay_ms - base) / 2 / 1e3
    return extra, (up + down) / 2 * frame() / rate_mbit


def frame() -> float:
    """Bytes on the wire per payload byte of a bulk TCP transfer (Ethernet, IP, TCP with
    timestamps: 1514 a 1448-byte segment), as the simulator counts a message's."""
    from sim.fidelity import HEADER_BYTES, SEGMENT_BYTES

    return (SEGMENT_BYTES + HEADER_BYTES) / SEGMENT_BYTES
