"""`fusionai embed`, `fusionai generate`, `fusionai swarm`: the SDK from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from cli.broker_cmd import _client_options


def add_parsers(sub: Any) -> None:
    embed = sub.add_parser(
        "embed", help="sentence embeddings through the swarm", description=embed_cmd.__doc__
    )
    embed.add_argument("texts", nargs="*", help="texts to embed (or --file)")
    embed.add_argument("--file", help="a file with one text per line ('-': standard input)")
    embed.add_argument("--model", help="the model (default: the broker's only encoder)")
    _client_options(embed)
    embed.add_argument("--json", action="store_true", help="print every vector as JSON")
    embed.set_defaults(func=embed_cmd)

    gen = sub.add_parser(
        "generate", help="stream a generation through the swarm", description=generate_cmd.__doc__
    )
    gen.add_argument("prompt")
    gen.add_argument("-n", "--max-new-tokens", type=int, default=64, help="at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1)")
    gen.add_argument("--seed", type=int, help="makes sampling repeatable")
    gen.add_argument("--stop", action="append", default=[], help="stop before this text")
    gen.add_argument("--model", help="the model (default: the broker's only decoder)")
    gen.add_argument("--timeout", type=float, default=30.0, help="per-step deadline, seconds")
    _client_options(gen)
    gen.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    gen.set_defaults(func=generate_cmd)

    swarm = sub.add_parser("swarm", help="the broker's providers, pools and model routes")
    _client_options(swarm)
    swarm.add_argument("--json", action="store_true", help="print as JSON")
    swarm.set_defaults(func=swarm_cmd)


def _client(args: argparse.Namespace, timeout: float = 60.0) -> Any:
    from client import AsyncClient

    return AsyncClient(args.broker, args.api_key, cacert=args.cacert, timeout=timeout)


def _fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def embed_cmd(args: argparse.Namespace) -> int:
    """Embed texts through the swarm; prints each text's vector size and first values, or with
    --json {"embeddings": [[...], ...]}."""
    from client import FusionAIError

    texts = list(args.texts)
    if args.file:
        try:
            source = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        except OSError as exc:
            return _fail(exc)
        texts += [line for line in source.splitlines() if line.strip()]
    if not texts:
        print("error: give texts to embed, or --file", file=sys.stderr)
        return 2

    async def main() -> Any:
        async with _client(args) as fa:
            return await fa.embed(texts, model=args.model)

    try:
        vectors = asyncio.run(main())
    except (FusionAIError, ValueError, OSError) as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps({"embeddings": vectors.tolist()}))
        return 0
    for text, row in zip(texts, vectors, strict=True):
        head = " ".join(f"{v:+.3f}" for v in row[:4])
        print(f"{len(row)} dims  [{head} ...]  {text[:60]}")
    return 0


def generate_cmd(args: argparse.Namespace) -> int:
    """Generate text after a prompt through the swarm, streamed as it comes. The client runs
    the tokenizer, embedding and head here and sends hidden states to the providers; if one
    dies, the session moves to a replacement and the text goes on unchanged."""
    from client import Failover, FusionAIError

    def failed(event: Failover) -> None:
        print(
            f"\n[stage {event.stage} on {event.peer[-8:]} failed ({event.reason}); resuming on a "
            f"replacement]",
            file=sys.stderr,
            flush=True,
        )

    async def main() -> Any:
        async with _client(args, args.timeout) as fa:
            stream = fa.generate(
                args.prompt,
                args.max_new_tokens,
                args.temperature,
                args.top_p,
                model=args.model,
                seed=args.seed,
                stop=args.stop,
                on_failover=failed,
            )
            start = time.perf_counter()
            async for piece in stream:
                if not args.json:
                    print(piece, end="", flush=True)
            if not args.json:
                print()
            return stream.result, time.perf_counter() - start

    try:
        result, seconds = asyncio.run(main())
    except (FusionAIError, ValueError, OSError) as exc:
        return _fail(exc)
    if args.json:
        out = {
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "seconds": round(seconds, 3),
            "failovers": [
                {"stage": f.stage, "peer_id": f.peer, "reason": f.reason} for f in result.failovers
            ],
            "route": result.route,
        }
        print(json.dumps(out))
    else:
        rate = len(result.tokens) / seconds if seconds > 0 else 0.0
        print(f"[{len(result.tokens)} tokens, {rate:.1f}/s]", file=sys.stderr)
    return 0


def swarm_cmd(args: argparse.Namespace) -> int:
    from client import FusionAIError

    async def main() -> Any:
        async with _client(args) as fa:
            return await fa.swarm()

    try:
        swarm = asyncio.run(main())
    except (FusionAIError, ValueError, OSError) as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(swarm, indent=2))
        return 0
    lines = [f"broker {swarm['broker']['peer_id']}", "providers:"]
    for p in swarm["providers"]:
        lines.append(
            f"  {p['peer_id'][-12:]}  {p['pool']:<8} {p['hardware'] or '?':<24} "
            f"{p['executor'] or '?':<6} queued {p['queued']}"
        )
    lines.append("models:")
    for m in swarm["models"]:
        lines.append(f"  {m['model']}: {'ready' if m['ready'] else m['waiting'] or 'placing'}")
        for s in m["stages"]:
            serving = ", ".join(p["peer_id"][-8:] for p in s["providers"]) or "-"
            lines.append(f"    {s['key']:<24} on {serving:<20} backups {len(s['backups'])}")
    print("\n".join(lines))
    return 0
