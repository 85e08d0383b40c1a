"""`fusionai provider ...`: run the provider daemon, or print this machine's profile."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

GB = 1024**3


def add_parser(sub: Any, dispatch: Any) -> None:
    provider = sub.add_parser("provider", help="contribute this machine's GPU to a broker")
    psub = provider.add_subparsers(dest="provider_command", required=True, metavar="SUBCOMMAND")
    data_help = "where the identity, profile and artifacts live (default: $FUSIONAI_DATA_DIR)"

    start = psub.add_parser("start", help="join a broker and serve stages until Ctrl-C")
    start.add_argument("--broker", required=True, help="the broker's multiaddr (.../p2p/<id>)")
    start.add_argument("--data-dir", help=data_help)
    start.add_argument("--listen", action="append", help="multiaddr (default /ip4/0.0.0.0/tcp/0)")
    start.add_argument(
        "--announce",
        action="append",
        default=[],
        help="multiaddr others dial instead of the listen ones (e.g. a forwarded public port)",
    )
    start.add_argument(
        "--no-upnp",
        action="store_true",
        help="do not ask the home router for a port mapping (UPnP; asked by default when this "
        "machine has a private address)",
    )
    start.add_argument("--max-memory", type=float, help="GB of memory stages may use")
    start.add_argument("--cache-size", type=float, default=20.0, help="GB of artifact cache")
    start.add_argument("--executor", choices=["ort", "torch"], default="ort")
    start.add_argument("--device", help="ORT execution provider or torch device (default: best)")
    start.add_argument("--join-token", help="the broker's join token, if it requires one")
    start.add_argument("--drain", type=float, default=30.0, help="seconds to finish requests")
    start.add_argument("--max-queue", type=int, default=32, help="requests in flight at most")
    start.add_argument(
        "--compute-slots",
        type=int,
        default=1,
        help="stage runs at once (default 1: one run already uses every core, or the GPU)",
    )
    start.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="generation steps of different sessions on one stage run together, up to this "
        "many (default 16; 1: each alone). Bounds the memory a run takes",
    )
    start.add_argument(
        "--batch-window-ms",
        type=float,
        default=2.0,
        help="how long a run waits at most for the other sessions it expects (default 2)",
    )
    start.add_argument("--reprofile", action="store_true", help="measure the hardware again")
    start.add_argument("--json", action="store_true", help="print events as JSON lines")
    start.add_argument("--fault", help=argparse.SUPPRESS)  # tests: die-at-step=N, slow=MS, ...
    start.set_defaults(func=dispatch, provider_command="start")

    prof = psub.add_parser("profile", help="measure (or show the cached) hardware profile")
    prof.add_argument("--data-dir", help=data_help)
    prof.add_argument("--executor", choices=["ort", "torch"], help="only this executor")
    prof.add_argument("--device", help="ORT execution provider or torch device")
    prof.add_argument("--reprofile", action="store_true", help="measure again")
    prof.add_argument("--json", action="store_true", help="print as JSON")
    prof.set_defaults(func=dispatch, provider_command="profile")


def _data_dir(args: argparse.Namespace) -> Path:
    from p2p import default_data_dir

    return Path(args.data_dir) if args.data_dir else default_data_dir()


def profile(args: argparse.Namespace) -> int:
    import msgspec

    from provider.profile import load_or_measure, table

    try:
        result, fresh = load_or_measure(
            _data_dir(args), args.executor, args.device, reprofile=args.reprofile
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        print(table(result))
        if not fresh:
            print("(cached; --reprofile measures again)")
    return 0


def start(args: argparse.Namespace) -> int:
    from provider.config import ProviderConfig
    from provider.daemon import Provider
    from provider.events import add_event_sink
    from provider.faults import Fault
    from provider.hosting import ExecutorChoice

    if "/p2p/" not in args.broker:
        print("error: --broker must be a multiaddr ending in /p2p/<peer id>", file=sys.stderr)
        return 2
    try:
        fault = Fault.parse(args.fault)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.batch_window_ms <= 1000:
        print("error: --batch-window-ms must be 0 to 1000", file=sys.stderr)
        return 2
    for name in ("max_memory", "cache_size", "drain", "max_queue", "compute_slots", "max_batch"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    from p2p import check_multiaddr

    for addr in args.announce:
        try:
            check_multiaddr(addr)
        except ValueError as exc:
            print(f"error: --announce: {exc}", file=sys.stderr)
            return 2
    config = ProviderConfig(
        broker=args.broker,
        data_dir=_data_dir(args),
        listen=tuple(args.listen) if args.listen else ("/ip4/0.0.0.0/tcp/0",),
        announce=tuple(args.announce),
        upnp=not args.no_upnp,
        executor=ExecutorChoice(args.executor, args.device),
        max_memory_bytes=int(args.max_memory * GB) if args.max_memory else None,
        cache_bytes=int(args.cache_size * GB),
        drain_s=args.drain,
        join_token=args.join_token,
        reprofile=args.reprofile,
        max_queue=args.max_queue,
        compute_slots=args.compute_slots,
        max_batch=args.max_batch,
        batch_window_ms=args.batch_window_ms,
        fault=fault,
    )
    if args.json:
        add_event_sink(lambda e: print(json.dumps(e, default=str), flush=True))
    else:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger = logging.getLogger("fusionai.provider")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    async def main() -> int:
        stop, now = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():
                now.set()  # a second Ctrl-C: leave at once; whatever still runs after 3 s
                loop.call_later(3.0, os._exit, 130)  # (a stuck request) does not hold us
            else:
                stop.set()
                print(
                    "stopping: finishing requests in flight (Ctrl-C again to quit now)",
                    file=sys.stderr,
                    flush=True,
                )

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except NotImplementedError:  # Windows: no loop signal handlers
                signal.signal(sig, lambda *_: loop.call_soon_threadsafe(on_signal))
        try:
            provider = Provider(config)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            await provider.run(stop, now)
        except Exception as exc:  # a clear last word instead of a traceback
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return 0

    return asyncio.run(main())
