"""Verification benchmark: activation commitments (`ir.toploc`) on the demo decoder, in one
process (the scheme on real stages; providers' commitments, `provider/commitments.py`, are
the same bytes), and per-token latency through provider processes with and without them.

    python benchmarks/verify.py [--tokens 128] [--sessions 20] [--honest 50] [--swarm-rounds 20]

The demo decoder (`make demo`'s, trained here the same way) as a 2-stage package, fp32 and
fp16, onnxruntime on one thread. Prints one JSON object:
    verify_cost_ratio   seconds to recompute a session's stage outputs in one prefill pass and
                        check its commitments, over seconds to generate it one token at a time
                        with them (median over --sessions sessions of --tokens new tokens)
    latency_ratio       per-token latency through a broker and one provider process a stage on
                        this machine (the SDK's generation sessions, stepped greedily), with
                        the providers committing, over without: in each of --swarm-rounds
                        rounds, a session whose providers commit and one opened as a check
                        (for which a provider makes none) over the same prompt, stepped in
                        turn, token by token (either first in turn); the median over rounds of
                        their mean step times' ratio (`_p50`: of their median step times';
                        `session_ratio`: of their whole sessions, the close, which brings the
                        last commitments, included; `token_ms` and `token_ms_off`: the median
                        steps). Both must generate the same tokens, and the committing one
                        must bring every chunk's commitment of both stages
    latency_ratio_in_process  seconds per generated token with commitments made as a
                        provider makes them (`provider.commitments.Ledger`: to each stage's
                        inputs and outputs, signed, each chunk's worked out in the commitment
                        thread), over without, in one process: the client, every stage and
                        the commitment thread share one interpreter, so this is the
                        commitments' compute against a token of this small decoder (the same
                        sessions, each way first in turn; the chunk's cost is fixed: a larger
                        model's ratio is smaller)
    latency_ratio_in_process_inline  the same with each chunk's commitments worked out on
                        the step's path
    token_ms_in_process  milliseconds per generated token without them, in one process
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
    ap.add_argument("--swarm-rounds", type=int, default=20, help="pairs of sessions")
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
                **swarm,
                "latency_ratio_in_process": round(latency, 4),
                "latency_ratio_in_process_inline": round(
                    statistics.median(inline_s) / statistics.median(plain_s), 4
                ),
                "token_ms_in_process": round(statistics.median(plain_s) / args.tokens * 1e3, 3),
                "commitment_bytes_per_1k_tokens": wire,
                "toploc_bytes_per_1k_tokens": round(stages * 258 * 1000 / CHUNK, 1),
                "sampling_rate": rate,
                "catch_within_20": round(1 - (1 - rate) ** 20, 4),
                "network_cost": round(rate * cost, 4),
                "detection": detection,
                "false_positives": false_positives,
                "honest_sessions": args.honest,
                "scope": "latency_ratio, session_ratio, token_ms: provider processes on "
                "this machine; the rest in one process (the scheme on real stages)",
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
    the SDK's generation sessions stepping greedily: in each of `rounds` rounds, a session
    whose providers commit and one opened as a check (the broker's and shadow steps' kind, for
    which a provider makes no commitments) over the same prompt, stepped in turn, token by
    token (either first in turn): this machine's speed, which drifts by tens of percent over
    seconds, is then the same for both."""
    import asyncio

    from e2e import Swarm

    from client import AsyncClient
    from client.routing import HttpRouter
    from client.session import GenerationSession

    swarm = Swarm(tmp, "verify", 2)
    times: dict[bool, list[list[float]]] = {True: [], False: []}  # per round, each token's
    closes: dict[bool, list[float]] = {True: [], False: []}
    chunks: list[int] = []  # commitments the committing sessions brought, per round

    async def generate(http: str) -> None:
        async with AsyncClient(http, timeout=60, cache_dir=tmp / "sdk-cache") as fa:
            await fa.generate([1, 2, 3], 8, stream=False, model=name)  # warm
            stages, route, host = await fa.stages(name), await fa.model(name), await fa._p2p()
            keys = [s.key for s in route.stages]

            def session(on: bool) -> GenerationSession:
                s = GenerationSession(
                    host, stages, keys, HttpRouter(fa, name), timeout=60, chains=fa._chains
                )  # (no StepMux: it would hold each session's step for the other's)
                if not on:  # (a check's sessions: the providers commit to nothing)
                    opening = s._opening
                    s._opening = lambda stage, sid, peer, check=False: opening(  # type: ignore[method-assign]
                        stage, sid, peer, True
                    )
                return s

            for r in range(rounds):
                both = {True: session(True), False: session(False)}
                prompt = [int(t) for t in np.random.default_rng(r).integers(1, 200, 12)]
                fed = {on: [int(np.argmax(await s.feed(prompt)))] for on, s in both.items()}
                taken: dict[bool, list[float]] = {True: [], False: []}
                for i in range(tokens - 1):
                    for on in (True, False) if (r + i) % 2 else (False, True):
                        start = time.perf_counter()
                        logits = await both[on].feed(fed[on][-1:])
                        taken[on].append(time.perf_counter() - start)
                        fed[on].append(int(np.argmax(logits)))
                assert fed[True] == fed[False], "the same tokens with and without commitments"
                for on, s in both.items():
                    start = time.perf_counter()
                    await s.close()  # (the committing one's brings its last commitments)
                    closes[on].append(time.perf_counter() - start)
                    times[on].append(taken[on])
                got = both[True].commitments.sessions.values()
                chunks.append(sum(len(o.chunks) for o in got))
                assert not any(o.chunks for o in both[False].commitments.sessions.values())

    try:
        swarm.add(package)
        asyncio.run(generate(swarm.http))
    finally:
        swarm.stop()
    expected = 2 * -(-(12 + tokens - 1) // CHUNK)  # two stages' chunks of the tokens fed
    assert min(chunks) == expected, f"commitments of {chunks}, not {expected}, chunks"

    def ratio(of: Any) -> float:  # each round's committing session against the other
        pairs = [of(a) / of(b) for a, b in zip(times[True], times[False], strict=True)]
        return round(float(statistics.median(pairs)), 4)

    whole = {on: [sum(t) + c for t, c in zip(times[on], closes[on], strict=True)] for on in times}
    sessions = [a / b for a, b in zip(whole[True], whole[False], strict=True)]  # (the close in)
    return {
        "latency_ratio": ratio(np.mean),
        "latency_ratio_p50": ratio(np.median),
        "session_ratio": round(float(statistics.median(sessions)), 4),
        "token_ms": round(float(np.median(np.concatenate(times[True]))) * 1e3, 3),
        "token_ms_off": round(float(np.median(np.concatenate(times[False]))) * 1e3, 3),
    }


if __name__ == "__main__":
    main()
