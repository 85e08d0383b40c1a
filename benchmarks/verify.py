"""Verification benchmark: activation commitments (`ir.toploc`) on the demo decoder, in one
process (the scheme on real stages; providers' commitments, `provider/commitments.py`, are
the same bytes), and per-token latency through provider processes with and without them.

    python benchmarks/verify.py [--tokens 128] [--sessions 20] [--honest 50] [--swarm-rounds 20]

The demo decoder (`make demo`'s, trained here the same way) as a 2-stage package, fp32 and
fp16, onnxruntime on one thread. Prints one JSON object:
    verify_cost_ratio   seconds to recompute a session's stage outputs in one prefill pass and
                        check its commitments, over seconds to generate it one token at a time
                        with them (median over --sessions sessions of --tokens new tokens)
    latency_ratio       seconds per generated token with commitments made as a provider makes
                        them (`provider.commitments.Ledger`: to each stage's inputs and
                        outputs, signed, each chunk's worked out in the provider's commitment
                        thread while the next tokens run), over without (the same sessions,
                        each way first in turn)
    latency_ratio_inline  the same with each chunk's commitments worked out on the step's path
                        (in one process the commitment thread shares the stages' interpreter:
                        these two are the commitments' compute over the tokens')
    token_ms            milliseconds per generated token without them (the commitments' cost
                        per 32 tokens is fixed: a larger model's ratio is smaller)
    swarm_latency_ratio  per-token latency through a broker and a provider process a stage
                        (the SDK generating, --swarm-rounds sessions each way) with the
                        providers committing, over sessions opened as checks, for which they
                        make none: the median over pairs of sessions run one after the other
                        (either first in turn) of their mean gaps between tokens' ratio
                        (`_p50`: of their p50 gaps'; `swarm_session_ratio`: of their whole
                        generations' wall times, the close, which waits for the last
                        commitments, included; `swarm_token_ms` and `_off`: the p50 gaps)
    commitment_bytes_per_1k_tokens   the signed commitments of both provider stages as sent
                        (msgpack), per 1,000 tokens; `toploc_bytes_per_1k_tokens` their
                        TOPLOC polynomials of the outputs alone (258 bytes per 32 tokens)
    sampling_rate       the share of sessions verified: the least r with 1 - (1 - r)^20 >= 0.99
    catch_within_20     the chance a provider cheating on every session is caught within 20
                        of its sessions at that rate
    network_cost        sampling_rate x verify_cost_ratio: verification's compute over
                        generation's, across the network
    detection           per cheat, the share of --sessions sessions caught
    false_positives     honest sessions accused, of --honest (fp32 and fp16 packages,
                        onnxruntime and torch on either side)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.toploc_runs: the sessions and cheats the tests use

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from ir.toploc import CHUNK  # noqa: E402
from p2p import Identity  # noqa: E402
from proto.session import COMMITMENT_DOMAIN  # noqa: E402
from provider.commitments import Ledger, worker  # noqa: E402
from tests.toploc_runs import (  # noqa: E402
    accused,
    build_packages,
    garbage,
    noise,
    replayed,
    serve,
    verdicts,
)


def main() -> None:
    import torch

    from cli.demo_models import train_decoder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--honest", type=int, default=50)
    ap.add_argument("--swarm-rounds", type=int, default=20, help="sessions each way")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = train_decoder(Path(tmp) / "tokenizer.json")
        pkgs = build_packages(model, Path(tmp))
        fp32, fp16 = pkgs["fp32"], pkgs["fp16"]
        vocab = int(fp32.manifest.config["vocab_size"])

        def prompt() -> list[int]:
            return [int(t) for t in rng.integers(1, vocab, size=12)]

        identity = Identity.ephemeral()

        def ledgers(defer: bool) -> list[Ledger]:
            def sign(data: bytes) -> bytes:
                return identity.sign(data, domain=COMMITMENT_DOMAIN)

            return [Ledger("s", f"m/{i}", sign, worker() if defer else None) for i in (1, 2)]

        serve(fp32, "ort", prompt(), 8, commits=False)  # warm
        serve(fp32, "ort", prompt(), 40, ledgers=ledgers(True))
        costs, plain_s, committed_s, inline_s = [], [], [], []
        kinds = {"plain": plain_s, "deferred": committed_s, "inline": inline_s}
        for i in range(args.sessions):
            p = prompt()
            for kind in [*kinds][i % 3 :] + [*kinds][: i % 3]:  # (each first in turn)
                start = time.perf_counter()
                if kind == "plain":
                    serve(fp32, "ort", p, args.tokens, commits=False)
                else:
                    tokens, sent = serve(
                        fp32, "ort", p, args.tokens, ledgers=ledgers(kind == "deferred")
                    )
                kinds[kind].append(took := time.perf_counter() - start)
                if kind == "deferred":  # the check, against generating with commitments
                    start = time.perf_counter()
                    assert not accused(fp32, verdicts(fp32, "ort", tokens, sent))
                    costs.append((time.perf_counter() - start) / took)
        cheats = {  # name: (the package the session was served as, the cheat)
            "another_model": (fp32, lambda p: serve(pkgs["other"], "ort", p, args.tokens)),
            "layer_skipped": (fp32, lambda p: serve(pkgs["skip"], "ort", p, args.tokens)),
            "fp32_computed_in_fp16": (fp32, lambda p: serve(fp32, "fp16", p, args.tokens)),
            "int4_for_fp32": (fp32, lambda p: serve(pkgs["int4"], "ort", p, args.tokens)),
            "replay": (fp32, lambda p: replayed(fp32, p, rng, args.tokens)),
            "garbage": (fp32, lambda p: garbage(fp32, p, rng, args.tokens)),
            "noise_1pct": (fp32, lambda p: serve(fp32, "ort", p, args.tokens, noise(0.01, rng))),
            "noise_0.1pct": (
                fp32,
                lambda p: serve(fp32, "ort", p, args.tokens, noise(0.001, rng)),
            ),
            "noise_1pct_fp16": (
                fp16,
                lambda p: serve(fp16, "ort", p, args.tokens, noise(0.01, rng)),
            ),
        }
        detection = {}
        for name, (honest, run) in cheats.items():
            caught = 0
            for _ in range(args.sessions):
                tokens, sent = run(prompt())
                caught += accused(honest, verdicts(honest, "ort", tokens, sent))
            detection[name] = caught / args.sessions
            print(f"{name}: {detection[name]:.2f}", file=sys.stderr, flush=True)
        sides = [("ort", "ort"), ("ort", "torch"), ("torch", "ort")]
        false_positives = 0
        for i in range(args.honest):
            pkg = fp16 if i % 2 else fp32
            prover, verifier = sides[i % len(sides)]
            tokens, sent = serve(pkg, prover, prompt(), args.tokens)
            false_positives += accused(pkg, verdicts(pkg, verifier, tokens, sent))
        wire = wire_bytes(ledgers(False), int(fp32.manifest.config["hidden_size"]), args.tokens)
        swarm = swarm_latency(
            Path(tmp), Path(tmp) / "fp32", fp32.manifest.name, args.tokens, args.swarm_rounds
        )
    rate = 1 - 0.01 ** (1 / 20)  # the least rate catching an always-cheater within 20 w.p. .99
    rate = math.ceil(rate * 100) / 100
    cost = statistics.median(costs)
    stages = len(fp32.manifest.stages) - 2
    latency = statistics.median(committed_s) / statistics.median(plain_s)
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "sessions": args.sessions,
                "verify_cost_ratio": round(cost, 4),
                "latency_ratio": round(latency, 4),
                "latency_ratio_inline": round(
                    statistics.median(inline_s) / statistics.median(plain_s), 4
                ),
                "token_ms": round(statistics.median(plain_s) / args.tokens * 1e3, 3),
                **swarm,
                "commitment_bytes_per_1k_tokens": wire,
                "toploc_bytes_per_1k_tokens": round(stages * 258 * 1000 / CHUNK, 1),
                "sampling_rate": rate,
                "catch_within_20": round(1 - (1 - rate) ** 20, 4),
                "network_cost": round(rate * cost, 4),
                "detection": detection,
                "false_positives": false_positives,
                "honest_sessions": args.honest,
                "scope": "one process: the scheme on real stages; swarm_*: provider "
                "processes on this machine",
            }
        )
    )


def wire_bytes(ledgers: list[Ledger], hidden: int, tokens: int) -> float:
    """Bytes of the signed commitments (`proto.session.Commitment`, msgpack as sent) that
    `ledgers` (one a stage) make for a session of `tokens` tokens, per 1,000 tokens."""
    rows = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32)
    sent = 0
    for ledger in ledgers:
        made = [c for i in range(tokens) for c in ledger.add(rows[i : i + 1], rows[i : i + 1])]
        sent += sum(len(msgspec.msgpack.encode(c)) for c in made + ledger.finish())
    return round(sent * 1000 / tokens, 1)


def swarm_latency(
    tmp: Path, package: Path, name: str, tokens: int, rounds: int
) -> dict[str, float]:
    """Per-token latency through a broker and one provider process a stage on this machine,
    the SDK generating: sessions whose providers commit, and sessions opened as checks (the
    broker's and shadow steps' kind, for which a provider makes no commitments), alternated.
    Gaps between a session's tokens, `rounds` sessions of each."""
    import asyncio

    from e2e import Swarm

    import client.session as sessions
    from client import AsyncClient
    from ir.manifest import ModelManifest as Manifest

    opening, stops = sessions.GenerationSession._opening, Manifest.stop_ids
    swarm = Swarm(tmp, "verify", 2)
    gaps: dict[bool, list[list[float]]] = {True: [], False: []}
    walls: dict[bool, list[float]] = {True: [], False: []}

    async def generate(http: str, name: str) -> None:
        async with AsyncClient(http, timeout=60, cache_dir=tmp / "sdk-cache") as fa:
            await fa.generate([1, 2, 3], 8, stream=False, model=name)  # warm
            for i in range(2 * rounds):
                on = i % 4 in (0, 3)  # (on, off, off, on, ...: neither always goes first)
                sessions.GenerationSession._opening = (  # type: ignore[method-assign]
                    opening if on else lambda s, st, sid, check=False: opening(s, st, sid, True)
                )
                prompt = [int(t) for t in np.random.default_rng(i // 2).integers(1, 200, 12)]
                start = time.perf_counter()
                done = await fa.generate(prompt, tokens, stream=False, model=name)
                walls[on].append(time.perf_counter() - start)  # (the close's wait included)
                assert len(done.tokens) == tokens, f"{len(done.tokens)} tokens, not {tokens}"
                gaps[on].append(list(np.diff(done.token_times) * 1e3))

    try:
        Manifest.stop_ids = lambda self: set()  # type: ignore[method-assign]  # (every session
        # runs its `tokens` tokens, as the in-process ones do: the demo decoder would stop early)
        swarm.add(package)
        asyncio.run(generate(swarm.http, name))
    finally:
        sessions.GenerationSession._opening = opening  # type: ignore[method-assign]
        Manifest.stop_ids = stops  # type: ignore[method-assign]
        swarm.stop()

    def ratio(of: Any, runs: dict[bool, Any]) -> float:  # each with commitments against
        pairs = [of(a) / of(b) for a, b in zip(runs[True], runs[False], strict=True)]
        return round(float(statistics.median(pairs)), 4)  # the one without beside it

    return {
        "swarm_token_ms": round(float(np.median(np.concatenate(gaps[True]))), 3),
        "swarm_token_ms_off": round(float(np.median(np.concatenate(gaps[False]))), 3),
        "swarm_latency_ratio": ratio(np.mean, gaps),
        "swarm_latency_ratio_p50": ratio(np.median, gaps),
        "swarm_session_ratio": ratio(float, walls),
    }


if __name__ == "__main__":
    main()
