"""Run a lab scenario (`sim.labscenario`) for real: `python -m lab scenario F --package DIR`.

Each run builds a fresh lab: one home per provider (its router kind, its access link shaped
and delayed), a home for the clients, the broker on the Internet. Providers run as processes
in their homes, each in a cgroup (`sim.cgroup.Quota`) that caps it at its `cpu` cores, with
`threads` executor threads, the machine's profile at its share (`_profiles`) and the package
already in its artifact cache (`fusionai provider prefetch`); they start together. Once all
have joined the package is added, and once it is served (with a backup for what the events
hit) `sessions` clients (`python -m client.load`, one process each, warmed up) start together
and run `rounds` greedy generations each; the scenario's events happen at their times after
the start. The run's figures come from the clients' timings (`sim.labscenario.figures`); the
placement from the route the clients were given, named by the scenario's provider names;
beside them what the broker measured of each provider and where the CPU went.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from lab.net import LabError
from lab.topology import BROKER_IP, ROOT, Lab
from sim.calibration import load as load_calibration
from sim.cgroup import Quota, cpu_s
from sim.labscenario import LabScenario, LabSpec, figures, prompt, summarize


class Events:
    """A child's JSON lines, collected by a thread; `wait(name)` blocks for one."""

    def __init__(self, proc: subprocess.Popen[str], what: str) -> None:
        self.proc, self.what = proc, what
        self.lines: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, out: IO[str] | None) -> None:
        for line in out or ():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                with self.cond:
                    self.lines.append(event)
                    self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait(self, name: str, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.lines:
                    if e.get("event") == name:
                        return e
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise LabError(f"{self.what}: no {name!r} event within {timeout:g} s")
                self.cond.wait(min(left, 0.5))

    def all(self, name: str) -> list[dict[str, Any]]:
        with self.cond:
            return [e for e in self.lines if e.get("event") == name]


def _machine() -> tuple[float, float]:
    """(busy, all) CPU seconds of this machine so far, over every core (`/proc/stat`)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


@functools.cache
def _machine_profile() -> str:
    """This machine's `profile.json`, measured once per process (`fusionai provider
    profile`): the scenarios of one benchmark share it."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            _fusionai("provider", "profile", "--executor", "ort", "--data-dir", tmp),
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            check=True, timeout=180,
        )  # fmt: skip
        return (Path(tmp) / "profile.json").read_text()


def _profiles(spec: LabSpec, calibration: Path | None = None) -> dict[str, bytes]:
    """Each provider's hardware profile (`profile.json`): this machine as the provider
    daemon's own measurement (`fusionai provider profile`) sees it, with the compute figures
    `calibration` (`fusionai sim calibrate`) measured if given, scaled to the provider's
    share (`LabProvider.share`), as the simulator scales the calibration's. (Providers
    measuring under their quotas in 1 ms slices measured noisily: the same scenario was
    placed a, a, b, b in one run and a, a, a, a in the next.)"""
    machine = json.loads(_machine_profile())
    if calibration is not None:
        cal = load_calibration(calibration)
        if cal.profile.executor != "ort":
            raise LabError(f"{calibration} profiled {cal.profile.executor}; the lab runs ort")
        for e in machine["executors"]:
            e["flops"], e["mem_bandwidth"] = dict(cal.profile.flops), cal.profile.mem_bandwidth
    out = {}
    for p in spec.provider:
        mine = json.loads(json.dumps(machine))
        for e in mine["executors"]:
            e["flops"] = {k: v * p.share for k, v in e["flops"].items()}
            e["mem_bandwidth"] *= p.share
        out[p.name] = json.dumps(mine, indent=2).encode()
    return out


def _prefetched(package: Path, into: Path) -> Path:
    """An artifact cache holding `package`'s provider stages (`fusionai provider prefetch`),
    which each provider's cache starts as, as one that served the model before (the
    scenarios time generation, not downloads: a 600 KB stage takes half a minute through a
    0.15 Mbit/s link)."""
    subprocess.run(
        _fusionai("provider", "prefetch", str(package), "--data-dir", str(into)), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, check=True,
        timeout=120,
    )  # fmt: skip
    return into / "artifacts"


def _fusionai(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def _reach(provider: Events) -> str:
    """How a provider could be dialled, by its own events: "mapped" (its router mapped a
    port), "relayed" (it holds a relay port), or "" (neither: reached directly, or not said)."""
    if any(e.get("mapped") for e in provider.all("port_mapping")):
        return "mapped"
    if any(e.get("held") for e in provider.all("relay")):
        return "relayed"
    return ""


def run_once(
    s: LabScenario, package: Path, model: str, say: Any = print,
    profiles: dict[str, bytes] | None = None, keep: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One run of `s` in a fresh lab: its figures, placement and the providers' reach.
    `profiles`: the providers' (`_profiles`; measured here if not given). `keep`: keep the
    run's folder (the processes' logs) when it succeeds too."""
    spec = s.lab
    profiles = profiles or _profiles(spec)
    links = [(p.rate_mbit, p.delay_ms) for p in spec.provider]
    links.append((spec.client.rate_mbit, spec.client.delay_ms))
    kinds = [p.nat for p in spec.provider] + [spec.client.nat]
    quotas: list[Quota] = []
    work = Path(tempfile.mkdtemp(prefix="fusionai-lab-scenario-"))
    stderr = open(work / "stderr.log", "w")  # noqa: SIM115 (closed below)
    try:
        with Lab(kinds, links=links) as lab:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            broker = lab.spawn(
                lab.broker, *_fusionai(
                    "broker", "start", "--listen", "/ip4/0.0.0.0/tcp/7370", "--http",
                    "0.0.0.0:7371", "--public-url", f"http://{BROKER_IP}:7371", "--data-dir",
                    str(work / "broker"), "--heartbeat-s", str(spec.heartbeat_s), "--json",
                    "--placement", spec.placement,
                    # (the providers' profiles are the machine's scaled to their quotas; the
                    # join's check would time a short burst, which a quota throttles: it
                    # measured 11 GFLOP/s where 0.3 of the machine is 45 over time)
                    "--trust-claims",
                ), stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, env=env,
            )  # fmt: skip
            started = Events(broker, "the broker").wait("broker_started", 60)
            addr = f"/ip4/{BROKER_IP}/tcp/7370/p2p/{started['peer']}"
            procs: dict[str, subprocess.Popen[str]] = {}
            peers: dict[str, str] = {}  # peer id -> scenario name
            events: dict[str, Events] = {}
            seed = _prefetched(package, work / "prefetched")
            for i, p in enumerate(spec.provider):
                (work / p.name).mkdir(mode=0o700)
                (work / p.name / "profile.json").write_bytes(profiles[p.name])
                shutil.copytree(seed, work / p.name / "artifacts")
                try:
                    quota = Quota(f"fusionai-lab-{lab.run_id}-{p.name}", p.cpu)
                except OSError as exc:
                    raise LabError(f"cannot cap provider {p.name}'s CPU: {exc}") from None
                quotas.append(quota)
                cmd = _fusionai(
                    "provider", "start", "--broker", addr, "--data-dir", str(work / p.name),
                    "--executor", "ort", "--max-memory", str(p.max_memory_gib), "--listen",
                    "/ip4/0.0.0.0/tcp/4800", "--json",
                    "--batch-window-ms", str(spec.batch_window_ms),
                )  # fmt: skip
                # (the cgroup first: `ip netns exec` mounts its own /sys, without cgroups)
                wrapped = f'echo $$ > {quota.procs} && exec ip netns exec "$@"'
                proc = subprocess.Popen(
                    ["sh", "-c", wrapped, "sh", lab.homes[i].host, *cmd],
                    stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                    env={**env, "FUSIONAI_THREADS": str(p.threads)},
                )  # fmt: skip
                lab.procs.append(proc)  # (killed at teardown)
                procs[p.name] = proc
                events[p.name] = Events(proc, f"provider {p.name}")
            for p in spec.provider:  # (they start together)
                listening = events[p.name].wait("listening", 180)
                peers[listening["peer_id"]] = p.name
            for p in spec.provider:  # (the model is placed on those that joined)
                events[p.name].wait("joined", 120)
            say(f"{s.name}: {len(procs)} providers up; adding the model")
            client_ns = lab.homes[-1].host
            url = f"http://{BROKER_IP}:7371"
            lab.run(client_ns, *_fusionai("model", "add", str(package), "--broker", url),
                    timeout=120)  # fmt: skip
            w = spec.workload
            load = [
                "-m", "client.load", "--broker", url, "--model", model, "--prompt",
                prompt(w.prompt_words), "-n", str(w.output_tokens), "--rounds", str(w.rounds),
                "--timeout", str(w.step_timeout_s), "--wait", "240", "--warmup", "--go-on-stdin",
                "--verbose",
            ]  # fmt: skip
            for e in spec.event:  # (a backup for what the events hit; by name: every stage)
                load += ["--backups"] if e.stage is None else ["--backup-stage", str(e.stage)]
            clients = []
            for i in range(w.sessions):
                proc = lab.spawn(
                    client_ns, sys.executable, *load, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, env=env,
                )  # fmt: skip
                clients.append(Events(proc, f"client {i}"))
            for c in clients:
                c.wait("ready", 300)
            route = clients[0].wait("route", 1)
            swarm = json.loads(lab.run(client_ns, *_fusionai("swarm", "--broker", url, "--json")))
            seen = {  # what the broker measured of each provider at its join
                peers.get(p["peer_id"], p["peer_id"]): {
                    "net_up_mbit": round(p["net_up_bytes_s"] * 8 / 1e6, 2),
                    "rtt_ms": round(p["rtt_s"] * 1e3, 1),
                    "gflops": round(p["flops"].get("float32", 0.0) / 1e9, 2),
                    "checked_gflops": p["checked_flops"] and round(p["checked_flops"] / 1e9, 2),
                }
                for p in swarm["providers"]
            }
            cpu0 = {name: cpu_s(proc.pid) for name, proc in procs.items()}
            throttled0 = [q.throttled() for q in quotas]
            machine0 = _machine()
            start = time.time()
            for c in clients:
                assert c.proc.stdin is not None
                c.proc.stdin.write("go\n")
                c.proc.stdin.flush()
            for e in sorted(spec.event, key=lambda e: e.at_s):
                time.sleep(max(0.0, start + e.at_s - time.time()))
                serving = [peers.get(st["providers"][0], "") for st in route["stages"]]
                name = e.victim(serving)
                victim = procs[name]
                victim.send_signal(signal.SIGKILL if e.action == "kill" else signal.SIGSTOP)
                say(f"{s.name}: {e.action} {name} at {time.time() - start:.1f} s")
            for c in clients:
                if c.proc.wait(timeout=600) != 0:
                    raise LabError(f"{c.what} failed; see {work / 'stderr.log'}")
            wall = time.time() - start
            busy, total = (b - a for a, b in zip(machine0, _machine(), strict=True))
            cpu = {}  # what each provider used while the clients ran (a killed one: until then)
            for name, proc in procs.items():
                now, then = cpu_s(proc.pid), cpu0[name]
                cpu[name] = None if now is None or then is None else round(now - then, 2)
            throttled = {
                p.name: [b[0] - a[0], round(b[1] - a[1], 3)]
                for p, q, a in zip(spec.provider, quotas, throttled0, strict=True)
                if (b := q.throttled())
            }
            gens = [g for c in clients for g in c.all("generation")]
            placement = [
                {"stage": st["index"],
                 "providers": [peers.get(x, x) for x in st["providers"]],
                 "backups": [peers.get(x, x) for x in st["backups"]]}
                for st in route["stages"]
            ]  # fmt: skip
            raw = [{"started": round(g["started"] - start, 3), "ttft_s": g["ttft_s"],
                    "tokens": g["tokens"], "gaps_s": g["gaps_s"], "failovers": g["failovers"]}
                   for g in gens]  # fmt: skip
            result = {
                "figures": figures(gens, w.sessions),
                "placement": placement,
                "reach": {name: _reach(e) for name, e in events.items()},
                "seen": seen,
                "generations": raw,
                # where the CPU went: each provider's seconds and the machine's busy share
                "cpu": {"wall_s": round(wall, 2), "providers_s": cpu,
                        "throttled": throttled,  # per provider: [periods, seconds]
                        "machine_busy": round(busy / total, 3) if total else None},
            }  # fmt: skip
        if keep:
            say(f"{s.name}: the run's folder (its processes' stderr.log) is kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)  # (kept when a run fails: its stderr.log)
        return result
    finally:
        stderr.close()
        for q in quotas:
            q.close()


def run(
    s: LabScenario, package: Path, model: str, runs: int, say: Any = print,
    calibration: Path | None = None, keep: bool = False,
    before: Callable[[int], object] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`runs` runs of `s`: the result `fusionai sim --compare` reads (medians, spreads).
    `calibration`: the providers' profiles are its (`_profiles`); `keep`: `run_once`'s;
    `before`: called with each run's index before it."""
    done = []
    profiles = _profiles(s.lab, calibration)
    for i in range(runs):
        if before is not None:
            before(i)
        t = time.monotonic()
        one = run_once(s, package, model, say, profiles, keep)
        say(f"{s.name}: run {i + 1}/{runs} in {time.monotonic() - t:.0f} s: {one['figures']}")
        done.append(one)
    median, spread = summarize([d["figures"] for d in done])
    return {
        "scenario": s.name,
        "source": "lab",
        "runs": len(done),
        "figures": median,
        "spread": spread,
        "per_run": [d["figures"] for d in done],
        "generations": [d["generations"] for d in done],
        "placement": done[0]["placement"],
        "placements": [d["placement"] for d in done],  # (each run's: they may differ)
        "reach": [d["reach"] for d in done],
        "cpu": [d["cpu"] for d in done],
        "seen": [d["seen"] for d in done],
    }
