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

from cli.provider_options import config_from_args, data_dir_of, start_options


def add_parser(sub: Any, dispatch: Any) -> None:
    provider = sub.add_parser("provider", help="contribute this machine's GPU to a broker")
    psub = provider.add_subparsers(dest="provider_command", required=True, metavar="SUBCOMMAND")
    data_help = "where the identity, profile and artifacts live (default: $FUSIONAI_DATA_DIR)"

    start = psub.add_parser("start", help="join a broker and serve stages until Ctrl-C")
    start_options(start, data_help)
    start.set_defaults(func=dispatch, provider_command="start")

    install = psub.add_parser(
        "install-service",
        help="run the provider as a service of this user: started at log-in, kept running",
        description="Writes and starts a systemd user unit (Linux), a launchd agent (macOS) "
        "or a Task Scheduler task (Windows) that runs `provider start` with the options given "
        "here.",
    )
    start_options(install, data_help)
    install.add_argument(
        "--no-enable", action="store_true", help="write the service file only; start nothing"
    )
    install.add_argument(
        "--print", action="store_true", help="print the service file; write nothing"
    )
    install.add_argument("--platform", choices=["linux", "darwin", "win32"], help=argparse.SUPPRESS)
    install.set_defaults(func=dispatch, provider_command="install_service")

    uninstall = psub.add_parser("uninstall-service", help="stop and remove the service")
    uninstall.set_defaults(func=dispatch, provider_command="uninstall_service")

    status = psub.add_parser(
        "status", help="what the provider here serves: pool, reachability, work done"
    )
    status.add_argument("--data-dir", help=data_help)
    status.add_argument("--json", action="store_true", help="print as JSON")
    status.set_defaults(func=dispatch, provider_command="status")

    prof = psub.add_parser("profile", help="measure (or show the cached) hardware profile")
    prof.add_argument("--data-dir", help=data_help)
    prof.add_argument("--executor", choices=["ort", "torch"], help="only this executor")
    prof.add_argument("--device", help="ORT execution provider or torch device")
    prof.add_argument("--reprofile", action="store_true", help="measure again")
    prof.add_argument("--json", action="store_true", help="print as JSON")
    prof.set_defaults(func=dispatch, provider_command="profile")

    pre = psub.add_parser(
        "prefetch",
        help="put a model package's provider stages into this provider's artifact cache",
        description="Copies the stages from a local package (verified by their SHA-256), so "
        "the provider downloads nothing when the broker assigns them: for thin uplinks, or "
        "machines that share one download.",
    )
    pre.add_argument("package", help="a model package directory (from `fusionai ir split`)")
    pre.add_argument("--data-dir", help=data_help)
    pre.set_defaults(func=dispatch, provider_command="prefetch")


def prefetch(args: argparse.Namespace) -> int:
    from files.cache import ArtifactCache, ArtifactError
    from ir.errors import ManifestError
    from ir.manifest import ModelManifest

    package = Path(args.package)
    try:
        manifest = ModelManifest.from_json((package / "manifest.json").read_bytes())
    except OSError as exc:
        print(f"error: {package} is not a model package: {exc.strerror}", file=sys.stderr)
        return 2
    except (ManifestError, ValueError) as exc:
        print(f"error: {package}/manifest.json: {exc}", file=sys.stderr)
        return 2
    cache = ArtifactCache(data_dir_of(args) / "artifacts")
    stages = [s for s in manifest.stages if s.placement == "provider"]
    for s in stages:
        try:
            cache.put(s.sha256, (package / s.file).read_bytes())
        except OSError as exc:
            print(f"error: {package / s.file}: {exc.strerror}", file=sys.stderr)
            return 2
        except ArtifactError as exc:
            print(f"error: {package / s.file}: {exc}", file=sys.stderr)
            return 2
    print(f"{len(stages)} stages of {manifest.name} in {cache.root}")
    return 0


def profile(args: argparse.Namespace) -> int:
    import msgspec

    from provider.profile import load_or_measure, table

    try:
        result, fresh = load_or_measure(
            data_dir_of(args), args.executor, args.device, reprofile=args.reprofile
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


def install_service(args: argparse.Namespace) -> int:
    from cli.service_cmd import install_service

    return install_service(args)


def uninstall_service(args: argparse.Namespace) -> int:
    from cli.service_cmd import uninstall_service

    return uninstall_service(args)


def status(args: argparse.Namespace) -> int:
    from cli.service_cmd import status

    return status(args)


def start(args: argparse.Namespace) -> int:
    from provider.daemon import Provider
    from provider.events import add_event_sink, onnxruntime_distributions, two_runtimes

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runtimes = onnxruntime_distributions()
    if len(runtimes) > 1:
        print(f"error: {two_runtimes(runtimes)}", file=sys.stderr)
        return 2
    if args.log_file:
        import logging.handlers

        path = Path(args.log_file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.handlers.RotatingFileHandler(
            path, maxBytes=10 * 1024**2, backupCount=3, encoding="utf-8"
        )
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        file_logger = logging.getLogger("fusionai.provider")
        file_logger.addHandler(to_file)
        file_logger.setLevel(logging.INFO)
    if args.json:
        add_event_sink(lambda e: print(json.dumps(e, default=str), flush=True))
    elif sys.stderr is not None:  # (none under pythonw.exe: a service without a console)
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
