"""`fusionai train`: pre-train a package with K data-parallel replicas, and `fusionai ir init`
(a package to pre-train from scratch)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def init(args: argparse.Namespace) -> int:
    """A randomly initialised model with a tokenizer trained on the data, as a package."""
    from ir.errors import IRError
    from ir.scratch import SHIPPED_DATA, init_package, read_config, read_texts

    try:
        config = read_config(args.config)
        texts = read_texts(Path(args.data) if args.data else SHIPPED_DATA)
        say = None if args.json else (lambda line: print(line, flush=True))
        manifest = init_package(
            Path(args.out),
            texts,
            config=config,
            stages=args.stages,
            seed=args.seed,
            name=args.name,
            progress=say,
        )
    except (IRError, OSError, ValueError) as exc:
        return _fail(exc)
    if args.json:
        print(manifest.to_json().decode())
    else:
        print(f"wrote {manifest.name} ({len(manifest.stages)} stages) to {args.out}")
    return 0


def swarm_train(args: argparse.Namespace) -> int:
    """A train job through a broker: K providers each hold a replica; progress per step."""
    import asyncio

    from tqdm import tqdm

    from client import AsyncClient, FusionAIError
    from ir.errors import IRError
    from ir.scratch import SHIPPED_DATA, read_texts

    if args.out:
        return _fail(ValueError("--out is for --local; a train job's result is a broker model"))
    try:
        texts = read_texts(Path(args.data) if args.data else SHIPPED_DATA)
    except (IRError, OSError, ValueError) as exc:
        return _fail(exc)
    bar = tqdm(total=args.steps, unit="step", disable=args.json, file=sys.stderr)
    start = time.perf_counter()

    def progress(step: Any) -> None:
        bar.update(1)
        shown = {"loss": f"{step.loss:.4f}" if step.loss is not None else "nan",
                 "tok_s": f"{step.tokens / max(step.seconds, 1e-9):,.0f}",
                 "replicas": step.replicas, "sent_MB": f"{step.bytes_sent / 1e6:.2f}"}  # fmt: skip
        if step.val_loss is not None:
            shown["val"] = f"{step.val_loss:.4f}"
        bar.set_postfix(shown)

    options = {
        "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup,
        "compress": args.compress, "rank": args.rank, "outer_every": args.outer_every,
        "start_after": args.start_after, "seed": args.seed, "eval_every": args.eval_every,
    }  # fmt: skip
    if args.name:
        options["name"] = args.name

    async def main() -> Any:
        async with AsyncClient(args.broker, args.api_key, cacert=args.cacert) as fa:
            return await fa.train(
                args.model,
                texts,
                steps=args.steps,
                replicas=args.replicas,
                progress=progress,
                timeout=args.timeout,
                **options,
            )

    try:
        result = asyncio.run(main())
    except (FusionAIError, ValueError, OSError) as exc:
        return _fail(exc)
    finally:
        bar.close()
    vals = [s.val_loss for s in result.steps if s.val_loss is not None]
    summary = {
        "job": result.job,
        "model": result.model,
        "trained": result.trained,
        "steps": len(result.steps),
        "first_loss": result.losses[0],
        "loss": result.losses[-1],
        "validation_loss": vals[-1] if vals else None,
        "sent_per_step": sum(s.bytes_sent for s in result.steps) / max(len(result.steps), 1),
        "seconds": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"{key:>24}: {shown}")
        print(f"generate from it: fusionai generate --model {result.trained} PROMPT")
    return 0


def train(args: argparse.Namespace) -> int:
    """Pre-train with K replicas: through a broker's providers, or in this process
    (`--local`)."""
    if not args.local:
        return swarm_train(args)
    from tqdm import tqdm

    from ir.compress import CompressionError
    from ir.errors import IRError
    from ir.package import load_package
    from ir.scratch import SHIPPED_DATA, Corpus, read_texts, tokenize
    from provider.localtrain import LocalRun, TrainSettings

    settings = TrainSettings(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        compress=args.compress,
        rank=args.rank,
        outer_every=args.outer_every,
        start_after=args.start_after,
        seed=args.seed,
    )
    try:
        settings.check(args.replicas)
        texts = read_texts(Path(args.data) if args.data else SHIPPED_DATA)
        package = Path(args.model)
        manifest = load_package(package, stages=[]).manifest
        if manifest.tokenizer is None:
            raise IRError(f"{package}: the package has no tokenizer to read text with")
        corpus = Corpus(tokenize(texts, package / manifest.tokenizer), args.seq_len, seed=args.seed)
        run = LocalRun(package, corpus, args.replicas, settings)
    except (IRError, CompressionError, OSError, ValueError) as exc:
        return _fail(exc)
    tokens = args.batch * args.seq_len
    full = 4 * run.replicas[0].parameters
    start = time.perf_counter()
    bar = tqdm(total=args.steps, unit="step", disable=args.json, file=sys.stderr)

    def progress(record: Any) -> None:
        bar.update(1)
        bar.set_postfix(
            loss=f"{record.loss:.4f}",
            tok_s=f"{tokens / record.seconds:,.0f}",
            sent_MB=f"{record.bytes_sent / 1e6:.2f}",
        )

    first = run.validation_loss()
    try:
        records = run.run(progress=progress)
    except KeyboardInterrupt:
        records = run.records
        print("stopped: keeping the weights trained so far", file=sys.stderr)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    payload = sum(r.payload_bytes for r in records) / max(len(records), 1)
    summary: dict[str, Any] = {
        "model": manifest.name,
        "replicas": args.replicas,
        "compress": args.compress,
        "rank": args.rank,
        "outer_every": args.outer_every,
        "steps": len(records),
        "parameters": run.replicas[0].parameters,
        "tokens": corpus.tokens,
        "first_loss": records[0].loss if records else None,
        "loss": records[-1].loss if records else None,
        "validation_loss_before": first,
        "validation_loss": run.validation_loss(),
        "bytes_per_step": payload,
        "sent_per_step": sum(r.bytes_sent for r in records) / max(len(records), 1),
        "compression": full / payload if payload else None,
        "tokens_s": tokens * len(records) / seconds if seconds else None,
        "seconds": seconds,
    }
    if args.out and records:
        name = args.name or f"{manifest.name}-trained"
        summary["package"] = str(run.replicas[0].save(Path(args.out), name))
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"{key:>24}: {shown}")
    return 0


def add_parsers(sub: Any) -> None:
    from cli.broker_cmd import _client_options
    from ir.compress import COMPRESSORS

    tr = sub.add_parser(
        "train",
        help="pre-train a package with data-parallel replicas (compressed gradients, DiLoCo)",
        description="K providers (or, with --local, K replicas in this process) each hold the "
        "whole model and train on their shard of every global batch; their gradients are "
        "summed by a ring all-reduce, peer to peer, compressed as asked. "
        "The global batch and learning-rate schedule do not depend on K. Make a package to "
        "train from scratch with `fusionai ir init`.",
    )
    tr.add_argument(
        "--model",
        required=True,
        help="the broker's model (a trainable package added with `fusionai model add`), "
        "or with --local a package directory",
    )
    tr.add_argument(
        "--data",
        help='text: .jsonl with a "text" field, or a plain text file '
        "(default: the shipped Python-reference corpus)",
    )
    tr.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    tr.add_argument("--replicas", type=int, default=2, help="data-parallel replicas (default 2)")
    tr.add_argument(
        "--compress",
        choices=COMPRESSORS,
        default="none",
        help="gradient compression (default none)",
    )
    tr.add_argument("--rank", type=int, default=4, help="low-rank compressors' rank (default 4)")
    tr.add_argument(
        "--outer-every",
        type=int,
        default=0,
        help="DiLoCo: local steps between outer steps (default 0: every step synced)",
    )
    tr.add_argument(
        "--start-after",
        type=int,
        default=0,
        help="steps all-reduced uncompressed before compression starts (default 0)",
    )
    tr.add_argument("--batch", type=int, default=12, help="global batch in rows (default 12)")
    tr.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    tr.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    tr.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    tr.add_argument("--seed", type=int, default=0, help="data order and factors' seed")
    tr.add_argument(
        "--local",
        action="store_true",
        help="run the replicas in this process (--model is then a package directory)",
    )
    tr.add_argument("--eval-every", type=int, default=0, help="steps between validations")
    tr.add_argument("--timeout", type=float, help="give up waiting after this many seconds")
    tr.add_argument("--out", help="--local: write the trained weights as a package here")
    tr.add_argument("--name", help="the trained model's name")
    _client_options(tr)
    tr.add_argument("--json", action="store_true", help="print the summary as JSON")
    tr.set_defaults(func=train)
