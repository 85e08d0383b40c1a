"""A chaos run of the whole swarm: a broker and 5 providers as real processes, 100 jobs of mixed
kinds (embedding batch jobs, greedy generations, fine-tune jobs), while providers are killed
(SIGKILL, and the `--fault die-at-step` option of the ones restarted), frozen (SIGSTOP, then
SIGCONT) and the broker itself is killed and restarted once. At most one provider is down or
frozen at a time, so every stage keeps a healthy provider, and every job must end succeeded
with output identical to a single-process run.

    python -m tests.chaos [--seed 1] [--jobs 100] [--trace FILE]     (or `make chaos`)

prints a JSON summary: jobs, succeeded, failed, lost, kills, stops, mismatches and more. The
same seed gives the same jobs and the same schedule of faults (their exact moments relative
to the jobs depend on the machine's speed). With `--trace`, the broker records its decision
core's inputs and decisions there (`broker.core.trace`).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.procs import Proc, broker_command, provider_command

PROVIDERS = 5
EMBED, FT = "minilm", "tiny-llama-ft"
PROMPTS = ["The broker places each stage", "Models travel as ONNX", "A provider joins", "Hello"]
TEXTS = [f"text {i}: gaming PCs serving {i % 7} stages to strangers" for i in range(16)]
GEN_TOKENS = 6
FT_SETTINGS: dict[str, Any] = {
    "steps": 2,
    "batch": 4,
    "microbatches": 2,
    "seq_len": 16,
    "lr": 0.05,
    "rank": 4,
    "seed": 3,
    "snapshot_every": 1,
}
JOB_DEADLINE_S = 300.0  # a job not finished this long after it started is lost
ATTEMPTS = 3  # tries of one generation (a generation lives in the client: a broker restart
# during its failover makes it fail, and the client starts it again)


def build_packages(out: Path) -> tuple[Path, Path]:
    """MiniLM in 2 provider stages; a small random Llama in 3, with adapter slots."""
    from cli.demo_models import build_minilm
    from ir.export import build_package
    from ir.families import AdapterConfig
    from tests.tiny_models import tiny_llama, tiny_tokenizer

    minilm = out / "minilm"
    build_minilm(minilm, 2)
    model = tiny_llama()
    tokenizer = out / "tokenizer.json"
    tiny_tokenizer(tokenizer, model.config.vocab_size)
    llama = out / "llama-ft"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(
            model,
            3,
            llama,
            name=FT,
            tokenizer_file=tokenizer,
            adapters=AdapterConfig(targets=("q", "k", "v", "o"), rank=4),
        )
    return minilm, llama


@dataclass
class References:
    """What a single process computes for the same inputs."""

    embeddings: np.ndarray[Any, Any]
    tokens: dict[str, list[int]]
    losses: list[float]


def references(minilm: Path, llama: Path) -> References:
    from broker.finetune import FinetuneRequest, LocalFinetune
    from client.data import SAMPLE_DATA, read_texts
    from tests.test_broker.conftest import local_embeddings
    from tests.test_broker.test_gateway import local_greedy

    settings = {k: v for k, v in FT_SETTINGS.items() if k != "snapshot_every"}
    request = FinetuneRequest(model=FT, texts=read_texts(SAMPLE_DATA), **settings)
    return References(
        local_embeddings(minilm, TEXTS),
        {p: local_greedy(llama, p, GEN_TOKENS)[0] for p in PROMPTS},
        list(LocalFinetune(llama, request).run()),
    )


@dataclass
class Outcome:
    kind: str
    state: str  # succeeded, failed, lost
    match: bool
    attempts: int = 1
    detail: str = ""


@dataclass
class Swarm:
    """The processes, and the faults done to them."""

    root: Path
    rng: random.Random
    broker: Proc | None = None
    addr: str = ""
    http: str = ""
    port: int = 0
    http_port: int = 0  # both fixed: the restarted broker is where clients left it
    providers: dict[int, Proc] = field(default_factory=dict)
    down: set[int] = field(default_factory=set)  # killed or frozen now
    kills: int = 0
    fault_deaths: int = 0
    stops: int = 0
    broker_restarts: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    trace: Path | None = None  # the broker records its core's inputs and decisions here
    stopped: bool = False  # a restart timer firing after `stop` starts nothing

    def start_broker(self) -> None:
        from tests.test_broker.conftest import free_port

        self.port = self.port or free_port()
        self.http_port = self.http_port or free_port()
        extra = ("--trace", str(self.trace)) if self.trace is not None else ()
        self.broker = Proc(
            broker_command(
                self.root / "broker",
                *extra,
                port=self.port,
                http_port=self.http_port,
                heartbeat_s=0.5,
            ),
            env={"FUSIONAI_THREADS": "1"},
        )
        started = self.broker.wait_for("broker_started", timeout=60)
        self.addr, self.http = started["addrs"][0], started["http"]

    def start_provider(self, i: int, *extra: str) -> None:
        proc = Proc(
            provider_command(
                self.addr, self.root / f"provider-{i}", "--max-memory", "2", "--drain", "5", *extra
            )
        )
        proc.wait_for("listening", timeout=60)
        self.providers[i] = proc

    def note(self, action: str, **fields: Any) -> None:
        self.log.append({"t": round(time.monotonic(), 2), "action": action, **fields})

    # ---- faults ----------------------------------------------------------------------------

    def reap(self) -> None:
        """Providers that died of their fault option are restarted (without one)."""
        for i, proc in list(self.providers.items()):
            if i not in self.down and proc.proc.poll() is not None:
                self.fault_deaths += 1
                self.note("died_of_fault", provider=i, code=proc.proc.returncode)
                self.start_provider(i)

    def fault(self) -> None:
        with self.lock:
            self.reap()
            if self.down:
                return
            i = self.rng.randrange(PROVIDERS)
            proc = self.providers[i]
            if self.rng.random() < 0.5:
                proc.signal(signal.SIGKILL)
                proc.proc.wait(timeout=30)
                self.kills += 1
                self.down.add(i)
                self.note("sigkill", provider=i)
                pause = self.rng.uniform(1, 4)
                die_at = self.rng.randrange(15, 60)
                threading.Timer(pause, self._restart, (i, die_at)).start()
            else:
                proc.signal(signal.SIGSTOP)
                self.stops += 1
                self.down.add(i)
                self.note("sigstop", provider=i)
                threading.Timer(self.rng.uniform(1, 5), self._resume, (i,)).start()

    def _restart(self, i: int, die_at: int) -> None:
        with self.lock:
            if self.stopped:
                return
            # comes back, and will die again by itself at its `die_at`-th request
            self.start_provider(i, "--fault", f"die-at-step={die_at}")
            self.down.discard(i)
            self.note("restarted", provider=i, die_at=die_at)

    def _resume(self, i: int) -> None:
        with self.lock:
            if self.stopped:
                return
            self.providers[i].signal(signal.SIGCONT)
            self.down.discard(i)
            self.note("sigcont", provider=i)

    def restart_broker(self) -> None:
        with self.lock:
            assert self.broker is not None
            self.broker.signal(signal.SIGKILL)
            self.broker.proc.wait(timeout=30)
            self.note("broker_sigkill")
            self.start_broker()
            self.broker_restarts += 1
            self.note("broker_restarted")

    def stop(self) -> None:
        with self.lock:  # (a restart under way finishes first; none starts after)
            self.stopped = True
        for proc in [*self.providers.values(), *([self.broker] if self.broker else [])]:
            if proc.proc.poll() is None:
                proc.signal(signal.SIGCONT)
                proc.stop()


def _poll(fa: Any, job_id: str) -> str:
    """The job's final state ("lost" past the deadline), through broker restarts."""
    from client import FusionAIError

    end = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < end:
        try:
            state: str = fa.job(job_id).state
        except FusionAIError:  # the broker restarting: ask again
            state = "unknown"
        if state in ("succeeded", "failed", "cancelled"):
            return state
        time.sleep(0.3)
    return "lost"


def run_job(swarm: Swarm, refs: References, kind: str, rng: random.Random) -> Outcome:
    from client import Client, FusionAIError

    with Client(swarm.http, timeout=10) as fa:
        if kind == "embed":
            picked = rng.sample(range(len(TEXTS)), 4)
            job = _retry(lambda: fa.submit({"model": EMBED, "texts": [TEXTS[i] for i in picked]}))
            state = _poll(fa, job.id)
            if state != "succeeded":
                return Outcome(kind, state, False, detail=fa.job(job.id).error or "")
            got = _retry(lambda: fa.results(job.id))
            return Outcome(kind, state, bool(np.abs(got - refs.embeddings[picked]).max() <= 1e-4))
        if kind == "finetune":
            body = {"kind": "finetune", "model": FT, "texts": _sample_texts(), **FT_SETTINGS}
            job = _retry(lambda: fa.submit(body))
            state = _poll(fa, job.id)
            if state != "succeeded":
                return Outcome(kind, state, False, detail=fa.job(job.id).error or "")
            losses = [s.loss for s in _retry(lambda: fa.finetune_steps(job.id))]
            ok = len(losses) == len(refs.losses) and all(
                abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses, refs.losses, strict=False)
            )
            return Outcome(kind, state, ok, detail="" if ok else f"{losses} vs {refs.losses}")
        prompt = rng.choice(PROMPTS)
        error = ""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                out = _retry(lambda: fa.generate(prompt, GEN_TOKENS, stream=False, model=FT))
            except FusionAIError as exc:
                error = str(exc)
                time.sleep(1.0)
                continue
            return Outcome(kind, "succeeded", out.tokens == refs.tokens[prompt], attempt)
        return Outcome(kind, "failed", False, ATTEMPTS, error)


def _sample_texts() -> list[str]:
    from client.data import SAMPLE_DATA, read_texts

    return read_texts(SAMPLE_DATA)


def _retry(call: Callable[[], Any], tries: int = 60) -> Any:
    """A request through a broker restart: tried again for up to a minute."""
    from client import BrokerUnreachable, UnavailableError

    for _ in range(tries - 1):
        try:
            return call()
        except (BrokerUnreachable, UnavailableError):
            time.sleep(1.0)
    return call()


def run_chaos(
    minilm: Path, llama: Path, root: Path, seed: int, jobs: int, trace: Path | None = None
) -> dict[str, Any]:
    from tests.test_broker.conftest import add_model, wait_ready

    rng = random.Random(seed)
    started = time.monotonic()
    refs = references(minilm, llama)
    swarm = Swarm(root, random.Random(seed + 1), trace=trace)
    kinds = [rng.choice(["embed"] * 5 + ["generate"] * 4 + ["finetune"]) for _ in range(jobs)]
    outcomes: list[Outcome | None] = [None] * jobs
    try:
        swarm.start_broker()
        for i in range(PROVIDERS):
            swarm.start_provider(i)
        add_model(swarm.http, minilm)
        add_model(swarm.http, llama)
        wait_ready(swarm.http, EMBED, timeout=180)
        wait_ready(swarm.http, FT, timeout=180)
        swarm.note("ready", seconds=round(time.monotonic() - started, 1))

        next_job = 0
        lock = threading.Lock()

        def worker(wrng: random.Random) -> None:
            nonlocal next_job
            while True:
                with lock:
                    if next_job >= jobs:
                        return
                    n = next_job
                    next_job += 1
                try:
                    outcomes[n] = run_job(swarm, refs, kinds[n], wrng)
                except Exception as exc:  # the harness reports, never hides, a crash
                    outcomes[n] = Outcome(kinds[n], "failed", False, detail=repr(exc))

        workers = [
            threading.Thread(target=worker, args=(random.Random(seed * 100 + w),), daemon=True)
            for w in range(3)
        ]
        for w in workers:
            w.start()
        restarted = False
        while any(w.is_alive() for w in workers):
            time.sleep(swarm.rng.uniform(1.0, 2.5))
            done = sum(o is not None for o in outcomes)
            if not restarted and done >= jobs // 2:
                swarm.restart_broker()
                restarted = True
            elif any(w.is_alive() for w in workers):
                swarm.fault()
        for w in workers:
            w.join()
    finally:
        swarm.stop()
    final = [o or Outcome("?", "lost", False) for o in outcomes]
    summary: dict[str, Any] = {
        "seed": seed,
        "jobs": jobs,
        "succeeded": sum(o.state == "succeeded" for o in final),
        "failed": sum(o.state == "failed" for o in final),
        "lost": sum(o.state in ("lost", "cancelled") for o in final),
        "kills": swarm.kills + swarm.fault_deaths,
        "sigkills": swarm.kills,
        "fault_deaths": swarm.fault_deaths,
        "stops": swarm.stops,
        "broker_restarts": swarm.broker_restarts,
        "mismatches": sum(o.state == "succeeded" and not o.match for o in final),
        "generation_retries": sum(o.attempts - 1 for o in final),
        "by_kind": {k: kinds.count(k) for k in sorted(set(kinds))},
        "seconds": round(time.monotonic() - started, 1),
        "timeline": swarm.log,  # the faults, in order (monotonic seconds)
        "problems": [
            {"job": n, "kind": o.kind, "state": o.state, "detail": o.detail[:300]}
            for n, o in enumerate(final)
            if o.state != "succeeded" or not o.match
        ],
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--trace", type=Path, help="record the broker's core decisions here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fusionai-chaos-") as tmp:
        root = Path(tmp)
        minilm, llama = build_packages(root / "packages")
        summary = run_chaos(minilm, llama, root / "run", args.seed, args.jobs, args.trace)
    print(json.dumps(summary))
    ok = summary["succeeded"] == summary["jobs"] and summary["mismatches"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
