"""The options of `fusionai provider start` (`install-service` takes the same) and the
daemon's settings they make."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

GB = 1024**3


def start_options(start: argparse.ArgumentParser, data_help: str) -> list[argparse.Action]:
    """The options of `provider start` (install-service takes the same); their actions."""
    a = start.add_argument
    return [
        a("--broker", required=True, help="the broker's multiaddr (.../p2p/<id>)"),
        a("--data-dir", help=data_help),
        a("--listen", action="append", help="multiaddr (default /ip4/0.0.0.0/tcp/0)"),
        a(
            "--announce",
            action="append",
            default=[],
            help="multiaddr others dial instead of the listen ones (e.g. a forwarded public port)",
        ),
        a(
            "--no-upnp",
            action="store_true",
            help="do not ask the home router for a port mapping (UPnP; asked by default when "
            "this machine has a private address)",
        ),
        a(
            "--offer-relay",
            type=float,
            default=0.0,
            metavar="MBIT",
            help="run a relay for providers nobody can dial, capped at MBIT Mbit/s (for a "
            "machine with a public address: each reservation listens on a port of its own; "
            "default 0: none)",
        ),
        a("--relay-port", type=int, default=0, help="the offered relay's control port (0: any)"),
        a(
            "--no-punch",
            action="store_true",
            help="neither offer nor try hole punching: peers met through a relay stay relayed",
        ),
        a("--max-memory", type=float, help="GB of memory stages may use"),
        a("--cache-size", type=float, default=20.0, help="GB of artifact cache"),
        a("--executor", choices=["ort", "torch"], default="ort"),
        a("--device", help="ORT execution provider or torch device (default: best)"),
        a("--join-token", help="the broker's join token, if it requires one"),
        a("--drain", type=float, default=30.0, help="seconds to finish requests"),
        a("--max-queue", type=int, default=32, help="requests in flight at most"),
        a(
            "--compute-slots",
            type=int,
            default=1,
            help="stage runs at once (default 1: one run already uses every core, or the GPU)",
        ),
        a(
            "--max-batch",
            type=int,
            default=16,
            help="generation steps of different sessions on one stage run together, up to this "
            "many (default 16; 1: each alone). Bounds the memory a run takes",
        ),
        a(
            "--batch-window-ms",
            type=float,
            default=2.0,
            help="how long a run waits at most for the other sessions it expects (default 2)",
        ),
        a("--reprofile", action="store_true", help="measure the hardware again"),
        a("--json", action="store_true", help="print events as JSON lines"),
        a("--log-file", help="also write the log here (rotated at 10 MB, 3 kept)"),
        *step_aside_options(start),
        a("--fault", help=argparse.SUPPRESS),  # tests: die-at-step=N, slow=MS, ...
    ]


def step_aside_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """When the provider makes way for the machine's owner (`provider.stepaside`)."""
    g = parser.add_argument_group(
        "stepping aside",
        "When the owner needs the machine, the provider drains, leaves the pool and pauses; "
        "it joins again once the machine has been free for --rejoin-after seconds.",
    )
    a = g.add_argument
    return [
        a(
            "--step-aside-for",
            action="append",
            default=[],
            metavar="PROGRAM",
            help="a program (a game: 'eldenring.exe') whose running makes way for it; repeat",
        ),
        a(
            "--step-aside-gpu",
            type=float,
            default=30.0,
            metavar="PERCENT",
            help="other programs' GPU use above this makes way (NVIDIA, via nvidia-ml-py; "
            "default 30, 0: off)",
        ),
        a(
            "--step-aside-gpu-idle",
            type=float,
            default=10.0,
            metavar="PERCENT",
            help="... and below this it is over (default 10)",
        ),
        a(
            "--step-aside-when-active",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="make way while keyboard or mouse were used within SECONDS (default 0: off)",
        ),
        a(
            "--step-aside-hours",
            action="append",
            default=[],
            metavar="HH:MM-HH:MM",
            help="daily hours (local time) kept for the owner, e.g. 18:00-23:30; repeat",
        ),
        a(
            "--step-aside-after",
            type=float,
            default=5.0,
            metavar="SECONDS",
            help="a cause must last this long before stepping aside (default 5)",
        ),
        a(
            "--rejoin-after",
            type=float,
            default=120.0,
            metavar="SECONDS",
            help="the machine must be free this long before joining again (default 120)",
        ),
        a(
            "--step-aside-every",
            type=float,
            default=2.0,
            metavar="SECONDS",
            help="look at the machine this often (default 2)",
        ),
        a("--no-step-aside", action="store_true", help="never step aside"),
    ]


def data_dir_of(args: argparse.Namespace) -> Path:
    from p2p import default_data_dir

    return Path(args.data_dir) if args.data_dir else default_data_dir()


def config_from_args(args: argparse.Namespace) -> Any:
    """The daemon's `ProviderConfig` from `provider start`'s options; ValueError says what
    is wrong."""
    from p2p import check_multiaddr
    from provider.config import ProviderConfig
    from provider.faults import Fault
    from provider.hosting import ExecutorChoice
    from provider.stepaside import StepAside, Window

    if "/p2p/" not in args.broker:
        raise ValueError("--broker must be a multiaddr ending in /p2p/<peer id>")
    fault = Fault.parse(args.fault)
    if not 0 <= args.batch_window_ms <= 1000:
        raise ValueError("--batch-window-ms must be 0 to 1000")
    for name in ("max_memory", "cache_size", "drain", "max_queue", "compute_slots", "max_batch"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if not (0 <= args.offer_relay <= 1e6 and 0 <= args.relay_port <= 65535):
        raise ValueError("--offer-relay takes 0 to 1e6 Mbit/s, --relay-port 0 to 65535")
    for addr in args.announce:
        try:
            check_multiaddr(addr)
        except ValueError as exc:
            raise ValueError(f"--announce: {exc}") from None
    try:
        hours = tuple(Window.parse(h) for h in args.step_aside_hours)
        step_aside = StepAside(
            enabled=not args.no_step_aside,
            processes=tuple(args.step_aside_for),
            gpu_busy_percent=args.step_aside_gpu,
            gpu_idle_percent=min(args.step_aside_gpu_idle, args.step_aside_gpu),
            user_active_s=args.step_aside_when_active,
            hours=hours,
            busy_after_s=args.step_aside_after,
            idle_after_s=args.rejoin_after,
            every_s=args.step_aside_every,
        )
    except ValueError as exc:
        raise ValueError(f"stepping aside: {exc}") from None
    return ProviderConfig(
        broker=args.broker,
        data_dir=data_dir_of(args),
        listen=tuple(args.listen) if args.listen else ("/ip4/0.0.0.0/tcp/0",),
        announce=tuple(args.announce),
        upnp=not args.no_upnp,
        punch=not args.no_punch,
        relay_rate_bytes_s=args.offer_relay * 1e6 / 8,
        relay_port=args.relay_port,
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
        step_aside=step_aside,
        settle_heap=True,
    )
