"""`fusionai sim calibrate --package`: what a provider daemon's work costs it, measured on
real processes (a broker and providers on loopback, the SDK generating through them): its CPU
per generated token holding every stage, and two providers' holding more and fewer of them at
once, free and under CPU quotas (root), and its CPU per generation beyond its tokens
(`sim.calibration.PackageTimes`)."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROVIDER_ROUNDS = 3  # generations of each length in one reading of the providers' CPU
PROVIDER_READINGS = 5  # readings (the median is kept); with a quota, alternately on and off
SHORT, LONG = 2, 24  # the generations' lengths (tokens)


async def _provider_generations(
    http: str, package: Path, pids: list[int], peers: list[str], split: tuple[int, ...],
    quotas: dict[float, list[Any]],
) -> dict[float, list[tuple[float, float]]]:  # fmt: skip
    """Each provider daemon's CPU seconds per generated token and per generation beyond its
    tokens: the package added to the broker at `http`, served by the providers `pids` (their
    peer ids `peers`), each holding its number of stages in `split`. A reading: the CPU each
    used over long generations less that over short ones (the opening, prefill and closing
    cancel) per extra token, and what the short ones used beyond their tokens, per
    generation; the median of the readings.
    With `quotas` (for each quota in cores, a `sim.cgroup.Quota` per provider) the readings
    cycle through the providers free (key 0.0) and under each quota (its key)."""
    from client.api import AsyncClient
    from ir.manifest import ModelManifest
    from sim.cgroup import cpu_s
    from sim.labscenario import prompt

    def used_s(pid: int) -> float:
        out = cpu_s(pid)
        if out is None:
            raise RuntimeError(f"the calibration's provider {pid} exited")
        return out

    name = ModelManifest.from_json((package / "manifest.json").read_bytes()).name
    text = prompt(8)  # (the lab scenarios' prompt length)
    modes = [0.0, *sorted(quotas)]
    readings: dict[float, list[list[tuple[float, float]]]] = {m: [] for m in modes}

    async def generated(n: int) -> int:
        return len((await fa.generate(text, n, model=name, stream=False)).tokens)

    async with AsyncClient(http, timeout=30.0) as fa:
        await fa.add_model(package)
        end = time.monotonic() + 120
        while not (model := await fa.model(name)).ready:
            if time.monotonic() > end:
                raise RuntimeError(f"the calibration's providers did not serve {name} in 120 s")
            await asyncio.sleep(0.2)
        held = [p.peer_id for s in model.stages for p in s.providers]
        counts = [held.count(p) for p in peers]
        if counts != list(split) or len(held) != sum(split):
            raise RuntimeError(
                f"the calibration wanted {'+'.join(map(str, split))} stages on its providers; "
                f"the broker placed {'+'.join(map(str, counts))}"
            )
        await fa.generate(text, SHORT, model=name, stream=False)  # connections open, warm
        for i in range(PROVIDER_READINGS * len(modes)):
            mode = modes[i % len(modes)]
            for k, pid in enumerate(pids):
                if mode:
                    quotas[mode][k].add(pid)
                elif quotas:
                    next(iter(quotas.values()))[k].release(pid)
            used, made = {}, {}
            for n in (SHORT, LONG):
                before, tokens = [used_s(pid) for pid in pids], 0
                for _ in range(PROVIDER_ROUNDS):
                    tokens += await generated(n)
                used[n] = [used_s(pid) - b for pid, b in zip(pids, before, strict=True)]
                made[n] = tokens
            if made[LONG] <= made[SHORT]:
                raise RuntimeError(f"{name}'s generations ended at once: no CPU per token")
            extra, one = made[LONG] - made[SHORT], []
            for long, short in zip(used[LONG], used[SHORT], strict=True):
                token = max(0.0, long - short) / extra
                one.append((token, max(0.0, short - token * made[SHORT]) / PROVIDER_ROUNDS))
            readings[mode].append(one)
    return {
        mode: [
            (statistics.median(r[k][0] for r in rs), statistics.median(r[k][1] for r in rs))
            for k in range(len(pids))
        ]
        for mode, rs in readings.items()
    }


def _split_memory(package: Path, held: int) -> float:
    """A provider memory limit (GiB) in which the broker places `held` of the package's
    provider stages and not one more (`broker.core.placement`'s accounting)."""
    from broker.config import LOAD_OVERHEAD, PLACEMENT_WORK
    from broker.models import model_spec
    from dag.cost import layer_memory, stage_workspace
    from ir.manifest import ModelManifest

    manifest = ModelManifest.from_json((package / "manifest.json").read_bytes())
    spec = model_spec(manifest)
    layers = spec.n_layers / len(manifest.provider_stages())
    need = stage_workspace(spec, PLACEMENT_WORK)
    need += (held + 0.5) * layers * layer_memory(spec, PLACEMENT_WORK)
    return LOAD_OVERHEAD * need / 1024**3


def _provider_token_cpu(
    package: Path, profile: bytes, executor: str, split: tuple[int, ...] | None = None,
    quotas: tuple[float, ...] = (),
) -> dict[float, list[tuple[float, float]]]:  # fmt: skip
    """A real broker and provider daemons (loopback, one compute thread each, this machine's
    profile as measured here), one holding each number of the provider stages of `package`
    in `split` (by its memory limit; None: one holding them all): each one's CPU per
    generated token and per generation (`_provider_generations`:
    free, key 0.0, and capped at each of `quotas` cores, keyed by it)."""
    import signal
    import tempfile
    import threading

    from cli.demo import STARTUP_TIMEOUT, Child, _cli, _raise_interrupt
    from ir.manifest import ModelManifest
    from sim.cgroup import Quota

    manifest = ModelManifest.from_json((package / "manifest.json").read_bytes())
    split = split or (len(manifest.provider_stages()),)
    memory = [f"{_split_memory(package, k):.4f}" if len(split) > 1 else "2" for k in split]
    env = {**os.environ, "FUSIONAI_THREADS": "1"}
    children: list[Child] = []
    groups: dict[float, list[Quota]] = {q: [] for q in quotas}
    # (a TERM stops the broker and providers and removes the quotas, as Ctrl-C does)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None
    with tempfile.TemporaryDirectory(prefix="fusionai-calibrate-") as tmp:
        work = Path(tmp)
        try:
            broker = Child("the broker", _cli(
                "broker", "start", "--listen", "/ip4/127.0.0.1/tcp/0", "--http",
                "127.0.0.1:0", "--data-dir", str(work / "broker"), "--trust-claims", "--json",
            ), work / "broker.log", env)  # fmt: skip
            children.append(broker)
            started = broker.wait_for("broker_started", STARTUP_TIMEOUT)
            pids = []
            for i in range(len(split)):
                data = work / f"provider-{i}"
                data.mkdir(mode=0o700)
                (data / "profile.json").write_bytes(profile)
                cmd = _cli(
                    "provider", "start", "--broker", started["addrs"][0], "--data-dir",
                    str(data), "--listen", "/ip4/127.0.0.1/tcp/0", "--executor", executor,
                    "--max-memory", memory[i], "--json",
                )  # fmt: skip
                for q in quotas:
                    groups[q].append(Quota(f"fusionai-calibrate-{os.getpid()}-{q:g}-{i}", q))
                child = Child(f"provider {i}", cmd, work / f"provider-{i}.log", env)
                children.append(child)
                pids.append(child.proc.pid)
            peers = [
                child.wait_for("listening", STARTUP_TIMEOUT)["peer_id"] for child in children[1:]
            ]
            for child in children[1:]:
                child.wait_for("joined", STARTUP_TIMEOUT)
            return asyncio.run(
                _provider_generations(started["http"], package, pids, peers, split, groups)
            )
        finally:
            if main:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (while they stop)
            for child in reversed(children):
                child.stop()
            for group in groups.values():
                for quota in group:
                    quota.close()
            if main:
                signal.signal(signal.SIGTERM, previous)


def provider_costs(package: Path, profile: bytes, executor: str) -> dict[str, Any]:
    """A provider daemon's CPU per token serving every stage; two providers', one serving
    all the stages but one and the other that one, measured together: the difference is the
    stages' alone, whatever this machine's speed did meanwhile (where there are only two
    stages, one each, solved with the first, measured apart); and the two again under CPU
    quotas (`QUOTA_PROBES`, as the lab caps its providers; as root only)."""
    token, session = _provider_token_cpu(package, profile, executor)[0.0][0]
    out: dict[str, Any] = {"provider_token_cpu_s": token, "provider_session_cpu_s": session}
    return {**out, **split_costs(package, profile, executor)}


def split_costs(package: Path, profile: bytes, executor: str) -> dict[str, Any]:
    """The two providers' part of `provider_costs` (its `provider_split_*` fields; none
    where the package has one provider stage or the broker placed them otherwise): what a
    benchmark reads again between lab runs, as this machine's speed drifts."""
    from ir.manifest import ModelManifest
    from sim.calibration import QUOTA_PROBES
    from sim.cgroup import available

    manifest = ModelManifest.from_json((package / "manifest.json").read_bytes())
    n = len(manifest.provider_stages())
    if n < 2:
        print(f"calibrate: no two-provider measurement: {manifest.name} has one provider "
              "stage", file=sys.stderr)  # fmt: skip
        return {}
    split = (n - 1, 1) if n > 2 else (1, 1)
    quotas = QUOTA_PROBES if available() is None else ()
    try:
        two = _provider_token_cpu(package, profile, executor, split, quotas)
    except RuntimeError as exc:  # (placed otherwise)
        print(f"calibrate: no two-provider measurement: {exc}", file=sys.stderr)
        return {}
    return {
        "provider_split_stages": list(split),
        "provider_split_token_cpu_s": [t for t, _ in two[0.0]],
        "provider_split_quota_token_cpu_s": {f"{q:g}": [t for t, _ in two[q]] for q in quotas},
        "provider_split_session_cpu_s": [g for _, g in two[0.0]],
    }
