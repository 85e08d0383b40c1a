"""`fusionai model add|list` and `fusionai job submit|list|status|cancel|story|results`: the
SDK (`client.AsyncClient`) from the shell. `--json` prints the broker's answer as it is.

Calls ride through a broker restart: the SDK tries a broker it cannot reach again, with
growing pauses, for `--timeout` seconds (`client.http`), and `job submit --wait` goes on
waiting once the broker is back. A command that gives up prints one line saying what failed
and what to do, and exits 1."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from client import AsyncClient, BrokerUnreachable, FusionAIError, JobFailed, JobTimeout
from ir.errors import IRError

T = TypeVar("T")
RETRY_S = 30.0  # seconds a call keeps retrying an unreachable broker without --timeout


def _run(args: argparse.Namespace, call: Callable[[AsyncClient], Awaitable[T]]) -> T:
    retry_s = RETRY_S if args.timeout is None else args.timeout

    async def main() -> T:
        async with AsyncClient(
            args.broker, args.api_key, cacert=args.cacert, timeout=60, retry_s=retry_s
        ) as fa:
            return await call(fa)

    return asyncio.run(main())


def _print(args: argparse.Namespace, value: Any, text: str) -> None:
    print(json.dumps(msgspec.to_builtins(value), indent=2) if args.json else text)


def run(args: argparse.Namespace) -> int:
    command = {
        ("model", "add"): model_add,
        ("model", "list"): model_list,
        ("job", "submit"): job_submit,
        ("job", "list"): job_list,
        ("job", "status"): job_status,
        ("job", "cancel"): job_cancel,
        ("job", "story"): job_story,
        ("job", "results"): job_results,
    }[args.group, args.cmd]
    try:
        return command(args)
    except IRError as exc:  # a package whose manifest is not readable
        print(f"error: {getattr(args, 'directory', '')}: {exc}", file=sys.stderr)
        return 2
    except BrokerUnreachable as exc:
        print(f"error: {exc}; is it running? (--timeout waits longer)", file=sys.stderr)
        return 1
    except (FusionAIError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def model_add(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    if not (directory / "manifest.json").is_file():
        print(f"error: {directory} is not a model package (no manifest.json)", file=sys.stderr)
        return 2

    def progress(file: str, index: int, count: int) -> None:
        if not args.json:
            size = (directory / file).stat().st_size
            print(f"[{index}/{count}] uploading {file} ({size / 1e6:.1f} MB)", file=sys.stderr)

    model = _run(args, lambda fa: fa.add_model(directory, progress=progress))
    state = "served" if model.ready else (model.waiting or "placing")
    _print(args, model, f"added {model.model}: {state}")
    return 0


def model_list(args: argparse.Namespace) -> int:
    models = _run(args, lambda fa: fa.swarm()).models
    lines = []
    for m in models:
        lines.append(f"{m.model}: {'ready' if m.ready else m.waiting or 'placing'}")
        for s in m.stages:
            serving = ", ".join(p.peer_id[-8:] for p in s.providers) or "-"
            backups = ", ".join(p[-8:] for p in s.backups) or "-"
            lines.append(f"  {s.key:<24} serving: {serving:<20} backups: {backups}")
    _print(args, {"models": models}, "\n".join(lines) or "no models")
    return 0


def _job_line(job: Any) -> str:
    return f"{job.id}: {job.state}" + (f" ({job.error})" if job.error else "")


def job_submit(args: argparse.Namespace) -> int:
    try:
        texts = [line for line in Path(args.texts).read_text().splitlines() if line.strip()]
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"model": args.model, "texts": texts}
    if args.microbatch:
        body["microbatch"] = args.microbatch

    start = time.monotonic()

    def progress(job: Any) -> None:
        if not args.json:
            print(f"\r{job.id}: {job.state} {job.progress:.0%}", end="", file=sys.stderr)

    async def submit(fa: AsyncClient) -> Any:
        job = await fa.submit(body)
        if not args.wait:
            return job
        left = None if args.timeout is None else max(args.timeout - time.monotonic() + start, 0)
        try:
            return await fa.wait(job.id, timeout=left, progress=progress)
        except JobFailed as exc:  # printed below, as a job that ended
            return exc.job
        finally:
            if not args.json:
                print(file=sys.stderr)

    try:
        job = _run(args, submit)
    except JobTimeout as exc:
        print(f"error: {exc}; it goes on: see `fusionai job status`", file=sys.stderr)
        return 1
    if not args.wait:
        _print(args, job, job.id)
        return 0
    _print(args, job, _job_line(job))
    return 0 if job.state == "succeeded" else 1


def job_list(args: argparse.Namespace) -> int:
    jobs = _run(args, lambda fa: fa.jobs(limit=args.limit))
    lines = [f"{_job_line(j)}  {j.model}  {j.done}/{j.microbatches}" for j in jobs]
    _print(args, {"jobs": jobs}, "\n".join(lines) or "no jobs")
    return 0


def job_status(args: argparse.Namespace) -> int:
    job = _run(args, lambda fa: fa.job(args.id))
    text = f"{job.id}: {job.state}, {job.done}/{job.microbatches} microbatches"
    _print(args, job, text + (f" ({job.error})" if job.error else ""))
    return 0


def job_cancel(args: argparse.Namespace) -> int:
    job = _run(args, lambda fa: fa.cancel(args.id))
    _print(args, job, _job_line(job))
    return 0


def job_story(args: argparse.Namespace) -> int:
    out = _run(args, lambda fa: fa.story(args.id))
    start = out.events[0]["at"] if out.events else 0.0
    lines = [f"job {out.job.id} ({out.job.state})"]
    for e in out.events:
        fields = {k: v for k, v in e.items() if k not in ("id", "at", "kind", "job")}
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        lines.append(f"  +{e['at'] - start:8.3f}s #{e['id']:<6} {e['kind']:<18} {detail}")
    _print(args, out, "\n".join(lines))
    return 0


def job_results(args: argparse.Namespace) -> int:
    """An embed job's rows, or a fine-tune job's steps, as JSON."""

    async def results(fa: AsyncClient) -> dict[str, Any]:
        job = await fa.job(args.id)
        if job.kind == "finetune":
            steps = await fa.finetune_steps(args.id)
            return {"job": job.id, "total": len(steps), "steps": msgspec.to_builtins(steps)}
        rows = await fa.results(args.id)
        return {"job": job.id, "total": len(rows), "embeddings": rows.tolist()}

    out = _run(args, results)
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {out['total']} rows to {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0
