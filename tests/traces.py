"""Recorded broker runs for the trace-equivalence test (`tests/test_sim/test_replay.py`).

    python -m tests.traces record [--out tests/data/traces]

records two runs of real processes with `fusionai broker start --trace`, gzip-compressed:

- `chaos.jsonl.gz`: `make chaos`'s run (two models, 5 providers killed, frozen, restarted,
  and the broker itself killed and restarted once);
- `two-models.jsonl.gz`: a scripted run under SJF-BSBF: a short job shares a long one's
  route; a provider joins during a job (the rebalance waits until the model is idle, then
  uses the newcomer, rated with the correction its twin earned); a second model takes the
  first one's backups to serve; providers are killed with and without a warm backup; one
  provider comes and goes until it is flapping.

`situations(path)` replays a trace and says which of those situations it holds: the test
requires all of them across the recorded traces.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.core import Core
from broker.core.actions import Notice, PromoteBackup, ProviderLost, Replan, StartJob
from broker.core.events import JobEnded, ModelUsed, ProviderJoined
from broker.core.trace import Step
from sim.driver import Replay, replay_file

TRACES = Path(__file__).parent / "data" / "traces"
SITUATIONS = (
    "crash with a warm backup",
    "crash with no warm backup (re-plan)",
    "join during a running job: rebalance put off",
    "put-off rebalance done once idle",
    "two models sharing providers",
    "a model taking another's backup",
    "a flapping provider",
    "rescored placement using the correction prior",
    "SJF-BSBF partner job",
    "SJF-BSBF guest holds the route after its host",
)


def situations(path: Path) -> tuple[Replay, set[str]]:
    """Replay `path` through the simulator's driver, noting the situations it holds."""
    seen: set[str] = set()
    guests: set[str] = set()

    def observe(core: Core, step: Step) -> None:
        actions, event = step.actions, step.event
        lost = {a.peer_id for a in actions if isinstance(a, ProviderLost) and not a.graceful}
        lost_serving = {
            a.peer_id for a in actions if isinstance(a, ProviderLost) and a.stage is not None
        }
        for a in actions:
            if isinstance(a, PromoteBackup) and a.replacing in lost:
                seen.add("crash with a warm backup")
            if isinstance(a, Replan) and a.lost in lost & lost_serving:
                seen.add("crash with no warm backup (re-plan)")
            if isinstance(a, Notice) and a.kind == "backups_taken":
                seen.add("a model taking another's backup")
            if isinstance(a, StartJob) and a.shares is not None:
                seen.add("SJF-BSBF partner job")
                guests.add(a.job)
            if isinstance(a, Notice) and a.kind == "model_rebalanced":
                if isinstance(event, JobEnded | ModelUsed):
                    seen.add("put-off rebalance done once idle")
                plan = core.plans[a.data["model"]]
                profiles = core.candidates(plan)
                prior = [
                    p
                    for p in profiles
                    if not core.pool.providers[p].correction.samples and profiles[p].slowdown != 1.0
                ]
                if prior:
                    seen.add("rescored placement using the correction prior")
        if isinstance(event, ProviderJoined) and any(
            plan.rebalance_due and core.busy(name) for name, plan in core.plans.items()
        ):
            seen.add("join during a running job: rebalance put off")
        if sum(plan.placement is not None for plan in core.plans.values()) >= 2:
            seen.add("two models sharing providers")
        pool = core.pool
        if any(p.flapping(pool.now, pool.config) for p in pool.providers.values()):
            seen.add("a flapping provider")
        if isinstance(event, JobEnded):
            running = core.queue.running
            if any(g in running and running[g].held == 1 for g in guests):
                seen.add("SJF-BSBF guest holds the route after its host")

    return replay_file(path, observe=observe), seen


# ---- recording -------------------------------------------------------------------------------


def _gzip(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as f, gzip.open(dest, "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)


def record_chaos(out: Path, work: Path) -> None:
    trace = work / "chaos.jsonl"
    run = [sys.executable, "-m", "tests.chaos", "--seed", "1", "--jobs", "100"]
    done = subprocess.run([*run, "--trace", str(trace)], capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode != 0:
        raise RuntimeError(f"the chaos run failed: {json.dumps(summary)[:2000]}")
    _gzip(trace, out / "chaos.jsonl.gz")


def record_two_models(out: Path, work: Path) -> None:
    from tests.chaos import EMBED, FT, build_packages
    from tests.procs import Proc, broker_command, provider_command, wait_until
    from tests.test_broker.conftest import add_model, api, wait_ready

    minilm, llama = build_packages(work / "packages")
    trace = work / "two-models.jsonl"
    procs: list[Proc] = []
    # (claims trusted, as `broker_command` has it: the provider that joins during a job takes
    # its share once the job ends)
    flags = ("--queue", "sjf-bsbf", "--verify-fraction", "0")
    broker = Proc(broker_command(work / "broker", *flags, "--trace", str(trace)))
    procs.append(broker)
    try:
        http = broker.wait_for("broker_started", timeout=60)["http"]
        addr = broker.wait_for("broker_started", timeout=1)["addrs"][0]
    except Exception:
        broker.stop()
        raise
    peers: dict[str, Proc] = {}
    names: dict[str, str] = {}  # peer id -> name

    def start(name: str, *extra: str) -> str:
        folder = work / name
        if not folder.exists() and (work / "p0" / "profile.json").is_file():
            folder.mkdir()  # the same machine: its measured profile, not one measured under load
            shutil.copy(work / "p0" / "profile.json", folder / "profile.json")
        since = broker.mark()
        proc = Proc(provider_command(addr, folder, "--max-memory", "2", *extra))
        procs.append(proc)
        peer = str(proc.wait_for("listening", timeout=60)["peer_id"])
        peers[name], names[peer] = proc, name
        broker.wait_for("provider_joined", lambda e: e["peer"] == peer, timeout=60, since=since)
        return peer

    def events(kind: str) -> list[dict[str, Any]]:
        return [e for e in api(http, "GET", "/v1/events")[1]["events"] if e["kind"] == kind]

    def kill(name: str) -> None:
        peers[name].signal(signal.SIGKILL)
        peers[name].proc.wait(timeout=30)

    def serving(model: str, backed: bool) -> str:
        """A provider serving a stage of `model` that has (or has no) warm backup."""
        out = api(http, "GET", f"/v1/models/{model}")[1]
        for stage in out["stages"]:
            if bool(stage["backups"]) == backed and stage["providers"]:
                return str(stage["providers"][0]["peer_id"])
        raise RuntimeError(f"no stage of {model} with backed={backed}: {out}")

    try:
        # 1. One slow provider holds MiniLM whole. A long job runs; a shorter one shares its
        # route (SJF-BSBF); the long one is cancelled, and the other carries on, holding it.
        start("p0", "--fault", "slow=300")
        add_model(http, minilm)
        wait_ready(http, EMBED)
        texts = [f"sentence {i} about gaming PCs" for i in range(240)]
        _, host = api(http, "POST", "/v1/jobs", {"model": EMBED, "texts": texts, "microbatch": 4})
        broker.wait_for("job_running", lambda e: e["job"] == host["id"], timeout=60)
        body = {"model": EMBED, "texts": texts[:80], "microbatch": 4}
        _, guest = api(http, "POST", "/v1/jobs", body)
        shared = broker.wait_for("job_placed", lambda e: e["job"] == guest["id"], timeout=60)
        assert shared["shares_with"] == host["id"], shared
        api(http, "POST", f"/v1/jobs/{host['id']}/cancel")
        # 2. A provider joins during the job: the rebalance waits until the model is idle.
        start("p1")
        wait_until(
            "the job's end",
            lambda: api(http, "GET", f"/v1/jobs/{guest['id']}")[1]["state"] == "succeeded",
            timeout=240,
        )
        broker.wait_for("model_rebalanced", timeout=60)
        # 3. Two more join (MiniLM's backups); the fine-tune model takes them to serve.
        start("p2")
        start("p3")
        wait_ready(http, EMBED, backups=1, timeout=120)
        add_model(http, llama)
        wait_ready(http, FT, timeout=120)
        assert events("backups_taken"), "the second model did not take the first's backups"
        # 4. Two spares join and stand by; a serving provider with a warm backup is killed.
        start("p4")
        start("p5")
        wait_until("a warm backup", lambda: _has_backup(http, (EMBED, FT)), timeout=120)
        victim = next(serving(m, True) for m in (EMBED, FT) if _has_backup(http, (m,)))
        since = broker.mark()
        kill(names[victim])
        broker.wait_for("model_repaired", timeout=60, since=since)
        # 5. One without a warm backup is killed: a re-plan.
        wait_ready(http, EMBED, timeout=120)
        wait_ready(http, FT, timeout=120)
        model = next(m for m in (EMBED, FT) if _unbacked(http, m))
        since = broker.mark()
        kill(names[serving(model, False)])
        broker.wait_for("model_repaired", timeout=60, since=since)
        # 6. A provider comes and goes until it is flapping (each restart is a departure).
        for _ in range(3):
            if peers["p5"].proc.poll() is None:
                kill("p5")
            start("p5")
    finally:
        for proc in reversed(procs):
            if proc.proc.poll() is None:
                proc.signal(signal.SIGCONT)
                proc.stop()
    _gzip(trace, out / "two-models.jsonl.gz")


def _has_backup(http: str, models: tuple[str, ...]) -> bool:
    from tests.test_broker.conftest import api

    return any(
        s["backups"] and s["providers"]
        for m in models
        for s in api(http, "GET", f"/v1/models/{m}")[1]["stages"]
    )


def _unbacked(http: str, model: str) -> bool:
    from tests.test_broker.conftest import api

    stages = api(http, "GET", f"/v1/models/{model}")[1]["stages"]
    return any(not s["backups"] and s["providers"] for s in stages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["record", "check"])
    parser.add_argument("--out", type=Path, default=TRACES)
    parser.add_argument("--only", choices=["chaos", "two-models"])
    args = parser.parse_args(argv)
    runs: dict[str, Callable[[Path, Path], None]] = {
        "chaos": record_chaos,
        "two-models": record_two_models,
    }
    if args.command == "record":
        for name, record in runs.items():
            if args.only in (None, name):
                with tempfile.TemporaryDirectory(prefix=f"fusionai-trace-{name}-") as tmp:
                    record(args.out, Path(tmp))
    found: set[str] = set()
    for path in sorted(args.out.glob("*.jsonl.gz")):
        result, seen = situations(path)
        found |= seen
        print(json.dumps({"trace": path.name, **result.summary(), "situations": sorted(seen)}))
    missing = [s for s in SITUATIONS if s not in found]
    print(json.dumps({"missing_situations": missing}))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
