"""`fusionai embed`, `generate`, `finetune`, `swarm`: the SDK from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

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
    gen.add_argument("--adapter", help="a fine-tune job's id, or an adapter .safetensors file")
    gen.add_argument(
        "--verify",
        action="store_true",
        help="run every step also on a second provider and compare (shadow steps)",
    )
    _client_options(gen)
    gen.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    gen.set_defaults(func=generate_cmd)

    ft = sub.add_parser(
        "finetune", help="fine-tune a decoder through the swarm", description=finetune_cmd.__doc__
    )
    ft.add_argument("--model", required=True, help="a decoder exported with adapter slots")
    ft.add_argument(
        "--data",
        help='training texts: a .jsonl file of {"text": ...} lines, or one example per line '
        "(default: the sample shipped with fusionai)",
    )
    ft.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    ft.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ft.add_argument("--microbatches", type=int, default=2, help="per step (default 2)")
    ft.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    ft.add_argument("--method", choices=["lora-fa", "lora"], default="lora-fa")
    ft.add_argument("--rank", type=int, default=4, help="adapter rank (default 4)")
    ft.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 0.01)")
    ft.add_argument("--seed", type=int, default=0)
    ft.add_argument(
        "--snapshot-every", type=int, default=5, help="steps between snapshots (0: none)"
    )
    ft.add_argument(
        "--shards", default="2/3", help="K/N: N shards in other providers' RAM, any K rebuild"
    )
    ft.add_argument("--out", type=Path, help="also copy the trained adapter here")
    ft.add_argument("--timeout", type=float, help="give up waiting after this many seconds")
    _client_options(ft)
    ft.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    ft.set_defaults(func=finetune_cmd)

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
                adapter=args.adapter,
                verify=args.verify,
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
        if args.verify:
            out["checked"], out["unchecked"] = result.checked, result.unchecked
            out["distrusted"] = result.distrusted
        print(json.dumps(out))
    else:
        rate = len(result.tokens) / seconds if seconds > 0 else 0.0
        print(f"[{len(result.tokens)} tokens, {rate:.1f}/s]", file=sys.stderr)
        if args.verify:
            print(
                f"[{result.checked} stage steps checked on a second provider, "
                f"{result.unchecked} could not be; distrusted: {result.distrusted or 'none'}]",
                file=sys.stderr,
            )
    return 0


def finetune_cmd(args: argparse.Namespace) -> int:
    """Fine-tune a decoder through the swarm with LoRA-FA (or LoRA): each provider trains its
    own stage's adapters; their state is snapshotted, erasure-coded, into other providers' RAM,
    so the job survives a provider quitting. Prints each step's loss and speed, then where the
    trained adapter (safetensors) is; `fusionai generate --adapter JOB` applies it."""
    import shutil

    from client import FinetuneStep, FusionAIError
    from client.data import SAMPLE_DATA

    k, _, n = args.shards.partition("/")
    if not (k.isdigit() and n.isdigit()):
        return _fail(ValueError(f"--shards takes K/N, e.g. 2/3; got {args.shards!r}"))
    start = time.perf_counter()

    def progress(step: FinetuneStep) -> None:
        if not args.json:
            print(
                f"step {step.step}/{step.steps}  loss {step.loss:.4f}  "
                f"{step.tokens_s:,.0f} tokens/s  [{time.perf_counter() - start:.1f} s]",
                file=sys.stderr,
                flush=True,
            )

    async def main() -> Any:
        async with _client(args) as fa:
            return await fa.finetune(
                args.model,
                args.data or SAMPLE_DATA,
                steps=args.steps,
                batch=args.batch,
                microbatches=args.microbatches,
                seq_len=args.seq_len,
                method=args.method,
                rank=args.rank,
                lr=args.lr,
                seed=args.seed,
                snapshot_every=args.snapshot_every,
                shards=[int(k), int(n)],
                progress=progress,
                timeout=args.timeout,
            )

    try:
        result = asyncio.run(main())
        if args.out is not None:
            shutil.copyfile(result.adapter, args.out)
    except (FusionAIError, ValueError, OSError) as exc:
        return _fail(exc)
    adapter = args.out or result.adapter
    if args.json:
        out = {
            "job": result.job,
            "model": result.model,
            "losses": result.losses,
            "adapter": str(adapter),
            "sha256": result.sha256,
            "seconds": round(time.perf_counter() - start, 3),
        }
        print(json.dumps(out))
    else:
        first, last = result.losses[0], result.losses[-1]
        print(f"job {result.job}: loss {first:.4f} -> {last:.4f} in {len(result.losses)} steps")
        print(f"adapter: {adapter} (sha256 {result.sha256[:16]}...)")
        print(f"use it:  fusionai generate --model {result.model} --adapter {result.job} PROMPT")
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
        print(json.dumps(msgspec.to_builtins(swarm), indent=2))
        return 0
    lines = [f"broker {swarm.broker.peer_id}", "providers:"]
    for p in swarm.providers:
        lines.append(
            f"  {p.peer_id[-12:]}  {p.pool:<8} {p.hardware or '?':<24} "
            f"{p.executor or '?':<6} {p.reach:<11} queued {p.queued}"
        )
    lines.append("models:")
    for m in swarm.models:
        lines.append(f"  {m.model}: {'ready' if m.ready else m.waiting or 'placing'}")
        for s in m.stages:
            serving = ", ".join(p.peer_id[-8:] for p in s.providers) or "-"
            lines.append(f"    {s.key:<24} on {serving:<20} backups {len(s.backups)}")
    print("\n".join(lines))
    return 0
