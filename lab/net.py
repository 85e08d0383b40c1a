"""Commands the lab runs (iproute2, iptables, tc, sysctl) and what it needs to run them."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

TOOLS = ("ip", "iptables", "tc", "nft")
PREFIX = "fl"  # every namespace the lab makes is named fl<run>-<role>


class LabError(RuntimeError):
    """A lab command failed; the message has the command and its output."""


def missing() -> str | None:
    """Why the lab cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, NAT)"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        need = ", ".join(absent)
        return f"the lab needs {need} (Debian: iproute2, iptables, nftables, miniupnpd-nftables)"
    if not Path("/dev/net/tun").exists():
        return "the lab needs /dev/net/tun (its delayed links are TAP devices)"
    return None


def sh(*cmd: str, ns: str | None = None, check: bool = True, timeout: float = 30) -> str:
    """Run a command (inside namespace `ns` if given); its stdout. Raises LabError."""
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"{' '.join(full)}: no answer in {timeout:g} s") from None
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(full)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def ip(ns: str, *args: str) -> str:
    """`ip -n ns ...` (iproute2 in a namespace without a process inside it)."""
    return sh("ip", "-n", ns, *args)


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose names start with `prefix` (the lab's own, of this run or earlier)."""
    out = sh("ip", "netns", "list")
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def remove(names: Sequence[str]) -> None:
    """Kill every process in these namespaces, then delete them (errors ignored: a half-made
    lab is torn down as far as it goes)."""
    for ns in names:
        pids = sh("ip", "netns", "pids", ns, check=False).split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
    for ns in names:
        sh("ip", "netns", "del", ns, check=False)


def host_state() -> dict[str, str]:
    """This machine's own network configuration: links, addresses, routes and firewall rules
    (counters left out), to compare before and after the lab."""

    def quiet(*cmd: str) -> str:
        return sh(*cmd, check=False) if shutil.which(cmd[0]) else ""

    def rules(text: str) -> str:
        return "\n".join(
            line.split(" [")[0] for line in text.splitlines() if line and not line.startswith("#")
        )

    return {
        "links": "\n".join(
            " ".join(w for w in line.split() if not w.startswith("state"))
            for line in quiet("ip", "-o", "link", "show").splitlines()
        ),
        "addresses": quiet("ip", "-o", "addr", "show"),
        "routes": quiet("ip", "route", "show", "table", "all"),
        "routes6": quiet("ip", "-6", "route", "show", "table", "all"),
        "iptables": rules(quiet("iptables-save")),
        "nftables": quiet("nft", "list", "ruleset"),
    }
