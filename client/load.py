"""A load generator: generations one after another through a broker's swarm, timed token by
token (when the client sampled each), as one user sees them (`python -m client.load --help`).

    python -m client.load --broker http://127.0.0.1:7371 --prompt "Models travel" \\
        --max-new-tokens 32 --rounds 5 [--warmup] [--model NAME]

Prints one JSON line per generation: when it started (Unix time), its time to the first token,
the gaps between the tokens after it, and its failovers (stage, peer, the stall: the gap the
failover fell in). `--warmup` first runs a two-token generation, not reported, so connections
are open (its second step goes the chained way: the providers' connections to each other too)
and the model's client stages loaded; then the process settles its heap (`p2p.heap`).
`--wait S` first waits up to S seconds for the model to be served (`--backups`: with a
backup for every stage; `--backup-stage N`, repeatable: for stage N, 1 the first) and prints
its route; `--go-on-stdin` then waits for a line on stdin before the timed rounds (so that
several clients start together). Greedy decoding: every round is the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import time

from client.api import AsyncClient
from client.errors import FusionAIError
from client.types import Failover
from p2p import heap


async def _one(fa: AsyncClient, args: argparse.Namespace, tokens: int) -> dict[str, object]:
    failed: list[tuple[float, Failover]] = []
    started = time.time()
    t0 = time.monotonic()  # (the clock of the result's token_times)
    stream = fa.generate(
        args.prompt,
        tokens,
        model=args.model,
        on_failover=lambda e: failed.append((time.monotonic(), e)),
    )
    async for _ in stream:
        pass
    times = list(stream.result.token_times)  # when each token was sampled
    if not times:
        raise FusionAIError("the generation produced no token")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    failovers = []
    for at, event in failed:
        later = [i for i, t in enumerate(times) if t >= at]
        stall = times[later[0]] - times[later[0] - 1] if later and later[0] > 0 else None
        failovers.append(
            {"stage": event.stage, "peer_id": event.peer, "reason": event.reason, "stall_s": stall}
        )
    return {
        "event": "generation",
        "started": round(started, 6),
        "ttft_s": round(times[0] - t0, 6),
        "gaps_s": [round(g, 6) for g in gaps],
        "tokens": len(times),
        "failovers": failovers,
    }


async def _route(fa: AsyncClient, args: argparse.Namespace) -> dict[str, object]:
    """The model's route once it is served (with backups if asked), within `--wait` s."""
    end = time.monotonic() + args.wait
    while True:
        model = await fa.model(args.model)
        want = range(len(model.stages)) if args.backups else [n - 1 for n in args.backup_stage]
        if model.ready and all(model.stages[i].backups for i in want if i < len(model.stages)):
            stages = [
                {"index": s.index, "providers": [p.peer_id for p in s.providers],
                 "backups": list(s.backups)}
                for s in model.stages
            ]  # fmt: skip
            return {"event": "route", "model": model.model, "stages": stages}
        if time.monotonic() > end:
            why = model.waiting or "not every stage asked for has a backup yet"
            raise FusionAIError(f"{args.model} was not served within {args.wait:g} s: {why}")
        await asyncio.sleep(0.5)


async def _run(args: argparse.Namespace) -> int:
    async with AsyncClient(args.broker, timeout=args.timeout) as fa:
        if args.wait:
            print(json.dumps(await _route(fa, args)), flush=True)
        if args.warmup:
            await _one(fa, args, 2)
        heap.settle()  # (no full collection of what start-up made stalls the timed tokens)
        print(json.dumps({"event": "ready"}), flush=True)
        if args.go_on_stdin:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        for _ in range(args.rounds):
            print(json.dumps(await _one(fa, args, args.max_new_tokens)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.load", description=__doc__.splitlines()[0])
    p.add_argument("--broker", help="the broker's HTTP URL (default: $FUSIONAI_BROKER_URL)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", help="the model (default: the broker's only decoder)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="generations, one after another")
    p.add_argument("--warmup", action="store_true", help="a two-token generation first")
    p.add_argument("--timeout", type=float, default=30.0, help="per-step deadline, seconds")
    p.add_argument("--wait", type=float, default=0.0, help="wait for the model, seconds")
    p.add_argument("--backups", action="store_true", help="and for a backup of every stage")
    p.add_argument("--backup-stage", type=int, action="append", default=[], metavar="N",
                   help="and for a backup of stage N (1: the first; repeatable)")  # fmt: skip
    p.add_argument("--go-on-stdin", action="store_true", help="start on a line on stdin")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's steps")
    args = p.parse_args(argv)
    if args.verbose:  # (to stderr, timed to the millisecond: where a stall's time went)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not (1 <= args.max_new_tokens <= 4096 and 1 <= args.rounds <= 10_000):
        p.error("--max-new-tokens is 1 to 4096, --rounds 1 to 10000")
    if args.wait and not args.model:
        p.error("--wait needs --model")
    if any(n < 1 for n in args.backup_stage):
        p.error("--backup-stage counts from 1")
    try:
        return asyncio.run(_run(args))
    except (FusionAIError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
