"""`fusionai demo`: a whole swarm on this machine, one provider dying mid-answer.

It starts a broker and N providers (default and minimum 4) as separate processes on 127.0.0.1, each
provider limited to one compute thread, adds two models (the packaged all-MiniLM-L6-v2 and a
small decoder, built once and cached), then through the client SDK:

1. embeds 64 texts through the swarm and compares them with the same model run in this process;
2. streams a greedy generation through the decoder's provider stages. Every provider was started
   with the fault `die-at-step=N,on=<the decoder's last stage>`: the provider serving that stage
   exits at its N-th step, mid-answer; the client replays the session into a replacement and
   the answer goes on. N is chosen so that the replacement stays below N steps, so exactly one
   provider dies. The text is compared with an uninterrupted run in this process.

It prints a summary (providers and pools, routes, throughput, the failover and its stall, the
dashboard's URL), or the same as JSON with `--json`. Every process it started is stopped on
exit, Ctrl-C included; with `--keep` the swarm stays up until Ctrl-C (to look at the dashboard).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from proto.api import Model

STARTUP_TIMEOUT = 120.0  # seconds a process may take to start (a first provider profiles)
READY_TIMEOUT = 180.0  # seconds for both models to be served
PROMPT = "When a provider dies"
EMBED_TEXTS = 64


class DemoError(RuntimeError):
    pass


class Child:
    """A process that prints JSON event lines; its stderr goes to a log file."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        self._err: TextIO = log.open("w")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL,
            text=True, env=env,
        )  # fmt: skip
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                continue

    def wait_for(self, name: str, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if event.get("event") == name:
                return event
        tail = self.log.read_text()[-1500:] if self.log.exists() else ""
        state = f"exited with {self.proc.poll()}" if self.proc.poll() is not None else "timed out"
        raise DemoError(f"{self.name} did not start ({state}); its log ends:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def _local_reference(encoder: Path, decoder: Path, texts: list[str]) -> tuple[Any, list[int]]:
    """Embeddings of `texts` and the greedy answer to PROMPT, run in this process."""
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    def pipeline(path: Path) -> tuple[LocalPipeline, ClientStages]:
        pkg = load_package(path)
        runs = [OrtExecutor(pkg.models[s.index]) for s in pkg.manifest.stages]
        return LocalPipeline(pkg.manifest, runs), ClientStages(path)

    enc, enc_stages = pipeline(encoder)
    vectors = enc.encode(*enc_stages.tokenize(texts))
    dec, dec_stages = pipeline(decoder)
    tokens = dec.generate_greedy(dec_stages.tokenizer.encode(PROMPT).ids, 48)
    if dec_stages.eos in tokens:
        tokens = tokens[: tokens.index(dec_stages.eos) + 1]
    return vectors, tokens


def run(args: argparse.Namespace) -> int:
    if args.providers < 4:
        # four provider stages (two per model); with fewer, the provider that dies may serve
        # all of the decoder, and nothing is left to take over
        print("error: --providers must be at least 4", file=sys.stderr)
        return 2
    quiet = args.json

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from client import FusionAIError
    from client.api import default_cache_dir

    try:
        from cli import demo_models

        encoder, decoder = demo_models.build(default_cache_dir(), say)
    except ImportError as exc:
        print(
            f"error: the demo builds its models with torch and transformers ({exc}); install "
            f"them with: pip install torch==2.13.0 && pip install -e '.[torch]'",
            file=sys.stderr,
        )
        return 2
    children: list[Child] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    work = Path(tempfile.mkdtemp(prefix="fusionai-demo-"))
    try:
        summary = _demo(args, encoder, decoder, work, children, say)
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            _print_summary(summary)
        if args.keep:
            say(f"\nthe swarm stays up; dashboard: {summary['dashboard']} (Ctrl-C to stop)")
            while True:
                time.sleep(3600)
        return 0
    except (DemoError, FusionAIError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if not quiet:
            say("\nstopping ...")
        return 130
    finally:
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leave processes behind
        for child in reversed(children):  # providers first, the broker last
            try:
                child.stop()
            except Exception as exc:  # keep stopping the others
                print(f"warning: stopping {child.name}: {exc}", file=sys.stderr)
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _demo(
    args: argparse.Namespace,
    encoder: Path,
    decoder: Path,
    work: Path,
    children: list[Child],
    say: Any,
) -> dict[str, Any]:
    from cli.demo_models import DECODER, ENCODER
    from ir.manifest import ModelManifest

    texts = [f"demo text {i}: a gaming PC serves stage {i % 5} of a model" for i in range(64)]
    local_vectors, local_tokens = _local_reference(encoder, decoder, texts)
    # The decoder's last provider stage fails on its `die_at`-th step, on every provider. The
    # first to serve it dies mid-answer; its replacement gets a replay, the step that failed and
    # the rest (2 + T - die_at steps of the T the answer takes), which stays below die_at.
    steps = len(local_tokens)
    die_at = steps // 2 + 3
    manifest = ModelManifest.from_json((decoder / "manifest.json").read_bytes())
    last = [s.index for s in manifest.stages if s.placement == "provider"][-1]
    fault = f"die-at-step={die_at},on={DECODER}/{last}"

    env = {**os.environ, "FUSIONAI_THREADS": "1"}
    say(f"starting a broker and {args.providers} providers on 127.0.0.1 ...")
    broker = Child(
        "the broker",
        _cli(
            "broker", "start", "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0",
            "--data-dir", str(work / "broker"), "--heartbeat-s", "1", "--json",
        ),
        work / "broker.log",
        env,
    )  # fmt: skip
    children.append(broker)
    started = broker.wait_for("broker_started", STARTUP_TIMEOUT)
    addr, http = started["addrs"][0], started["http"]
    profile = _profile_cache()
    providers: dict[str, Child] = {}
    spawned: list[Child] = []
    for i in range(args.providers):
        data = work / f"provider-{i + 1}"
        data.mkdir()
        if profile.is_file():
            shutil.copy(profile, data / "profile.json")  # measured once, on the first run
        child = Child(
            f"provider {i + 1}",
            _cli(
                "provider", "start", "--broker", addr, "--data-dir", str(data),
                "--listen", "/ip4/127.0.0.1/tcp/0", "--max-memory", "2", "--drain", "5",
                "--json", "--fault", fault,
            ),
            work / f"provider-{i + 1}.log",
            env,
        )  # fmt: skip
        children.append(child)
        spawned.append(child)
        if not profile.is_file():  # the others wait for its measurement, to copy it
            if i == 0:
                say("provider 1 measures this machine's hardware (first run only) ...")
            providers[child.wait_for("listening", STARTUP_TIMEOUT)["peer_id"]] = child
            if (data / "profile.json").is_file():
                profile.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(data / "profile.json", profile)
    for child in spawned:  # (the rest start side by side)
        if child not in providers.values():
            providers[child.wait_for("listening", STARTUP_TIMEOUT)["peer_id"]] = child
    models = {ENCODER: encoder, DECODER: decoder}
    reference = {"vectors": local_vectors, "tokens": local_tokens, "texts": texts}
    pids = [broker.proc.pid] + [c.proc.pid for c in providers.values()]
    summary = asyncio.run(_drive(http, models, providers, reference, say))
    summary["fault"] = f"every provider: --fault {fault}"
    summary["processes"] = pids
    return summary


def _profile_cache() -> Path:
    from client.api import default_cache_dir

    return default_cache_dir() / "demo-profile.json"


async def _drive(
    http: str,
    models: dict[str, Path],
    providers: dict[str, Child],
    reference: dict[str, Any],
    say: Any,
) -> dict[str, Any]:
    from cli.demo_models import DECODER, ENCODER
    from client import AsyncClient, Failover, FusionAIError

    async with AsyncClient(http, timeout=10) as fa:
        say(f"waiting for the {len(providers)} providers to join ...")
        await _wait_joined(fa, set(providers))
        for name, path in models.items():
            say(f"adding {name} ...")
            try:
                await fa.add_model(path)
            except FusionAIError as exc:
                raise DemoError(f"adding {name}: {exc}") from None
        say("waiting for the broker to place both models ...")
        routes = await _wait_ready(fa, list(models))

        say(f"embedding {len(reference['texts'])} texts through the swarm ...")
        start = time.perf_counter()
        vectors = await fa.embed(reference["texts"], model=ENCODER)
        embed_s = time.perf_counter() - start
        diff = float(np.abs(vectors - reference["vectors"]).max())

        say(f"\ngenerating through the swarm (greedy): {PROMPT!r}")
        seen: list[Failover] = []

        def failed(event: Failover) -> None:
            seen.append(event)
            say(f"\n  [provider {event.peer[-8:]} (stage {event.stage}) failed: {event.reason}]")
            say("  [replaying the session into a replacement ...]")

        stream = fa.generate(PROMPT, 48, model=DECODER, on_failover=failed, temperature=0.0)
        start = time.perf_counter()
        print(PROMPT, end="", file=sys.stderr, flush=True)
        async for piece in stream:
            print(piece, end="", file=sys.stderr, flush=True)
        print(file=sys.stderr, flush=True)
        gen_s = time.perf_counter() - start
        result = stream.result
        after = await fa.model(DECODER)
        swarm = await fa.swarm()

    gaps = np.diff(result.token_times) if len(result.token_times) > 1 else np.zeros(1)
    died = []
    for peer, child in providers.items():
        try:
            code = child.proc.wait(timeout=5) if any(f.peer == peer for f in seen) else None
        except subprocess.TimeoutExpired:
            code = None
        if child.proc.poll() is not None:
            died.append({"peer_id": peer, "pid": child.proc.pid, "exit_code": code})
    pools = {p.peer_id: p.pool for p in swarm.providers}
    return {
        "providers": [
            {
                "peer_id": peer,
                "pid": child.proc.pid,
                "pool": pools.get(peer, "unknown"),
                "running": child.proc.poll() is None,
            }
            for peer, child in providers.items()
        ],
        "routes": routes,
        "embeddings": {
            "model": ENCODER,
            "texts": len(reference["texts"]),
            "seconds": round(embed_s, 3),
            "texts_per_s": round(len(reference["texts"]) / embed_s, 1),
            "max_abs_diff_vs_local": diff,
        },
        "generation": {
            "model": DECODER,
            "prompt": PROMPT,
            "text": result.text,
            "tokens": len(result.tokens),
            "tokens_per_s": round(len(result.tokens) / gen_s, 1),
            "matches_local": result.tokens == reference["tokens"],
            "finish_reason": result.finish_reason,
            "route_after": _route(after),
        },
        "failover": {
            "happened": bool(seen),
            "events": [{"stage": f.stage, "peer_id": f.peer, "reason": f.reason} for f in seen],
            "died": died,
            "longest_token_gap_s": round(float(gaps.max()), 3),
            "median_token_gap_s": round(float(np.median(gaps)), 4),
        },
        "dashboard": http + "/",
    }


async def _wait_joined(fa: Any, peers: set[str]) -> None:
    """Until the broker lists every provider started (one still joining when a model is added
    would be left out of its placement, as a spare)."""
    end = time.monotonic() + STARTUP_TIMEOUT
    while True:
        joined = {p.peer_id for p in (await fa.swarm()).providers}
        if peers <= joined:
            return
        if time.monotonic() > end:
            missing = ", ".join(sorted(p[-8:] for p in peers - joined))
            raise DemoError(f"providers {missing} did not join within {STARTUP_TIMEOUT:g} s")
        await asyncio.sleep(0.2)


async def _wait_ready(fa: Any, names: list[str]) -> dict[str, Any]:
    """Each model's route (stage key: providers, backups) once all are served."""
    end = time.monotonic() + READY_TIMEOUT
    while True:
        described = {name: await fa.model(name) for name in names}
        if all(d.ready for d in described.values()):
            return {name: _route(d) for name, d in described.items()}
        if time.monotonic() > end:
            waiting = {n: d.waiting for n, d in described.items() if not d.ready}
            raise DemoError(f"the models were not served within {READY_TIMEOUT:g} s: {waiting}")
        await asyncio.sleep(0.3)


def _route(described: Model) -> list[dict[str, Any]]:
    return [
        {"stage": s.key, "providers": [p.peer_id for p in s.providers], "backups": s.backups}
        for s in described.stages
    ]


def _print_summary(s: dict[str, Any]) -> None:
    def short(peer: str) -> str:
        return "…" + peer[-8:]

    lines = ["", "providers:"]
    for p in s["providers"]:
        state = "running" if p["running"] else "exited"
        lines.append(f"  {short(p['peer_id'])}  pid {p['pid']:<7} pool {p['pool']:<8} {state}")
    lines.append("routes when both models were ready:")
    for stages in s["routes"].values():
        for st in stages:
            serving = ", ".join(short(x) for x in st["providers"]) or "-"
            backups = ", ".join(short(x) for x in st["backups"]) or "-"
            lines.append(f"  {st['stage']:<16} on {serving:<12} backups {backups}")
    e, g, f = s["embeddings"], s["generation"], s["failover"]
    lines.append(
        f"embeddings: {e['texts']} texts in {e['seconds']} s ({e['texts_per_s']} texts/s); "
        f"max |swarm - local| = {e['max_abs_diff_vs_local']:.1e}"
    )
    lines.append(
        f"generation: {g['tokens']} tokens ({g['tokens_per_s']} tokens/s); the same tokens as "
        f"an uninterrupted run in this process: {'yes' if g['matches_local'] else 'NO'}"
    )
    if f["happened"]:
        for d in f["died"]:
            lines.append(
                f"failover: provider {short(d['peer_id'])} (pid {d['pid']}) died mid-answer "
                f"(exit code {d['exit_code']}); the longest gap between tokens was "
                f"{f['longest_token_gap_s']} s (median {f['median_token_gap_s']} s)"
            )
        now = ", ".join(
            f"{st['stage']} on {short(st['providers'][0])}"
            for st in g["route_after"]
            if st["providers"]
        )
        lines.append(f"the decoder's route now: {now}")
    else:
        lines.append("failover: no provider died (the fault never fired)")
    lines.append(f"fault injected: {s['fault']}")
    lines.append(f"dashboard: {s['dashboard']} (up while the demo runs; --keep leaves it up)")
    print("\n".join(lines))
