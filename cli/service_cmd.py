"""`fusionai provider install-service | uninstall-service | status`: the provider as a
service of this user (`provider.service`) and what a running provider reports
(`provider.status`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec


def start_argv(args: argparse.Namespace, data_dir: Path, log_file: Path | None) -> list[str]:
    """`provider start` with the options `args` carries that differ from their defaults
    (the data directory made absolute), as this interpreter runs it."""
    from cli.provider_options import start_options

    out = ["provider", "start", "--data-dir", str(data_dir)]
    for action in start_options(argparse.ArgumentParser(), ""):
        if not action.option_strings or action.dest in ("help", "data_dir", "log_file"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(value, bool):
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    if log_file is not None:
        out += ["--log-file", str(log_file)]
    return [sys.executable, "-m", "cli.main", *out]


def source_root() -> Path | None:
    """The folder holding this `cli` package when it runs from a source checkout (not from
    site-packages): the service then runs in it, so `-m cli.main` loads this very code."""
    root = Path(__file__).resolve().parents[1]
    return None if {"site-packages", "dist-packages"} & set(root.parts) else root


def install_service(args: argparse.Namespace) -> int:
    from cli.provider_options import config_from_args, data_dir_of
    from provider import service

    try:
        config_from_args(args)  # the service starts only with options `start` accepts
        kind = service.platform_kind(args.platform)
    except (ValueError, service.ServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data_dir = data_dir_of(args).expanduser().resolve()
    log_file = Path(args.log_file).expanduser() if args.log_file else None
    if log_file is None and kind == "launchd":
        log_file = service.launchd_logs() / "provider.log"
    elif log_file is None and kind == "task":
        log_file = service.windows_logs() / "provider.log"
    argv = start_argv(args, data_dir, log_file)
    if kind == "task":
        argv[0] = service.windowless(argv[0])
    spec = service.ServiceSpec(
        argv=tuple(argv),
        workdir=source_root() or data_dir,
        stop_timeout_s=args.drain + 15.0,
        log_file=log_file,
    )
    try:
        if args.print:
            if kind == "systemd":
                sys.stdout.write(service.systemd_unit(spec))
            elif kind == "launchd":
                sys.stdout.write(service.launchd_plist(spec).decode())
            else:
                sys.stdout.write(service.task_xml(spec))
            return 0
        data_dir.mkdir(parents=True, exist_ok=True)
        done = service.install(spec, enable=not args.no_enable, kind=kind)
    except (OSError, service.ServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{done.kind} service file: {done.path}")
    print(done.note)
    print(f"logs: {done.logs}")
    print(f"status: fusionai provider status --data-dir {data_dir}")
    return 0 if done.started or args.no_enable else 1


def uninstall_service(args: argparse.Namespace) -> int:
    from provider import service

    try:
        removed, notes = service.uninstall()
    except service.ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in removed:
        print(f"removed {path}")
    for note in notes:
        print(f"note: {note}")
    if not removed and service.platform_kind() != "task":
        print("no service file was installed")
    return 0


def status(args: argparse.Namespace) -> int:
    from cli.provider_options import data_dir_of
    from provider import service
    from provider.status import describe, read, running

    data_dir = data_dir_of(args)
    found = read(data_dir)
    try:
        unit = service.installed_file()
    except service.ServiceError:
        unit = None
    where = f"installed ({unit})" if unit is not None else None
    if found is None:
        if args.json:
            print(json.dumps({"running": False, "service": str(unit) if unit else None}))
        else:
            print(f"no provider has run with data directory {data_dir}")
            if where:
                print(f"service    {where}")
        return 1
    alive = running(found)
    if args.json:
        out = {
            **msgspec.to_builtins(found),
            "running": alive,
            "service": str(unit) if unit else None,
        }
        print(json.dumps(out))
    else:
        print(describe(found, alive, where))
    return 0 if alive else 1
