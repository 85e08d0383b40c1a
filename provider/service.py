"""The provider as a service of its owner's session, started at log-in and kept running:
a systemd user unit (Linux), a launchd agent (macOS), a Task Scheduler task (Windows).

    spec = ServiceSpec(argv=[sys.executable, "-m", "cli.main", "provider", "start", ...], ...)
    systemd_unit(spec) / launchd_plist(spec) / task_xml(spec)   # the files, as text or bytes
    install(spec) / uninstall()                                 # write, register, start

Each file runs exactly the `provider start` command line it was given (the options the user
gave `install-service`), so the service serves as the command would. Logs go where the
platform keeps them: the journal on Linux (`journalctl --user -u fusionai-provider`),
`~/Library/Logs/fusionai/` on macOS and `%LOCALAPPDATA%\\fusionai\\Logs\\` on Windows
(`--log-file`, rotated by the provider, as neither launchd nor Task Scheduler keeps logs).
Stopping sends SIGTERM where the platform can (systemd, launchd): the provider drains, and
the platform waits `stop_timeout_s` before killing it. Task Scheduler ends a task at once.
"""

from __future__ import annotations

import datetime
import os
import plistlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from files.atomic import write_atomic

UNIT = "fusionai-provider.service"  # systemd user unit
LABEL = "ai.fusionai.provider"  # launchd agent
TASK = "\\FusionAI\\Provider"  # Task Scheduler path
TASK_NS = "http://schemas.microsoft.com/windows/2004/02/mit/task"


@dataclass(frozen=True)
class ServiceSpec:
    argv: tuple[str, ...]  # the whole command: interpreter, "-m", "cli.main", "provider", ...
    workdir: Path  # the directory it runs in (the data directory)
    env: dict[str, str] = field(default_factory=dict)  # variables the service runs with
    stop_timeout_s: float = 45.0  # after SIGTERM, how long the drain may take, seconds
    log_file: Path | None = None  # macOS and Windows: where the provider writes its log


class ServiceError(Exception):
    """The service could not be installed or removed; the message says what to do."""


def platform_kind(platform: str | None = None) -> str:
    """ "systemd", "launchd" or "task" for this (or the named) `sys.platform`."""
    p = platform or sys.platform
    if p.startswith("linux"):
        return "systemd"
    if p == "darwin":
        return "launchd"
    if p == "win32":
        return "task"
    raise ServiceError(f"no service manager is supported on {p!r} (Linux, macOS, Windows)")


# ---- systemd ---------------------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def _systemd_escape(text: str) -> str:
    """`%` starts a specifier and `$` a variable in unit files: double them."""
    return text.replace("%", "%%").replace("$", "$$")


def _systemd_word(word: str) -> str:
    if word and _PLAIN.fullmatch(word):
        return _systemd_escape(word)
    quoted = word.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + _systemd_escape(quoted) + '"'


def _check_line(text: str, what: str) -> None:
    if any(c in text for c in "\n\r\0"):
        raise ServiceError(f"{what} holds a line break or NUL character: {text!r}")


def systemd_unit(spec: ServiceSpec) -> str:
    for word in (*spec.argv, *spec.env, *spec.env.values(), str(spec.workdir)):
        _check_line(word, "the service's command")
    env = "".join(f"Environment={_systemd_word(f'{k}={v}')}\n" for k, v in sorted(spec.env.items()))
    return (
        "[Unit]\n"
        "Description=FusionAI provider (serves ML stages for a FusionAI broker)\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=exec\n"
        f"ExecStart={' '.join(_systemd_word(w) for w in spec.argv)}\n"
        f"WorkingDirectory={_systemd_word(str(spec.workdir))}\n"
        f"{env}"
        "Environment=PYTHONUNBUFFERED=1\n"
        "KillSignal=SIGTERM\n"
        "KillMode=mixed\n"  # SIGTERM to the provider only; whatever is left is killed after
        f"TimeoutStopSec={int(spec.stop_timeout_s + 0.999)}\n"
        "Restart=on-failure\n"
        "RestartSec=10\n"
        "Nice=10\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def systemd_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


# ---- launchd ---------------------------------------------------------------------------------


def launchd_plist(spec: ServiceSpec) -> bytes:
    log = spec.log_file or launchd_logs() / "provider.log"
    agent = {
        "Label": LABEL,
        "ProgramArguments": list(spec.argv),
        "WorkingDirectory": str(spec.workdir),
        "EnvironmentVariables": {**spec.env, "PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # again after a crash, not after a clean stop
        "ThrottleInterval": 10,
        "ExitTimeOut": int(spec.stop_timeout_s + 0.999),  # SIGTERM, then SIGKILL after this
        "Nice": 10,
        "ProcessType": "Standard",
        # what the provider prints before its own log is open (a crash at start)
        "StandardOutPath": str(log.with_name("provider.stdout.log")),
        "StandardErrorPath": str(log.with_name("provider.stderr.log")),
    }
    return plistlib.dumps(agent, fmt=plistlib.FMT_XML, sort_keys=True)


def launchd_dir() -> Path:
    return Path.home() / "Library" / "LaunchAgents"


def launchd_logs() -> Path:
    return Path.home() / "Library" / "Logs" / "fusionai"


# ---- Task Scheduler --------------------------------------------------------------------------


def _windows_arg(arg: str) -> str:
    """One argument as the C runtime's command-line parser reads it back."""
    if arg and not re.search(r'[\s"]', arg):
        return arg
    out, slashes = '"', 0
    for c in arg:
        if c == "\\":
            slashes += 1
            continue
        if c == '"':
            out += "\\" * (2 * slashes + 1) + '"'
        else:
            out += "\\" * slashes + c
        slashes = 0
    return out + "\\" * (2 * slashes) + '"'


def task_xml(
    spec: ServiceSpec, user: str | None = None, now: datetime.datetime | None = None
) -> str:
    """The task's definition (Task Scheduler schema 1.2): at the user's log-on, run the
    provider (pythonw.exe: no console window) with no time limit, restarted after a failure
    (every minute, up to 255 times: the schema's largest count)."""
    for word in (*spec.argv, str(spec.workdir)):
        _check_line(word, "the task's command")
    if spec.env:  # a task cannot set variables: they would be silently lost
        raise ServiceError("Task Scheduler tasks cannot set environment variables")
    command, *args = spec.argv
    when = (now or datetime.datetime.now()).replace(microsecond=0).isoformat()
    user_id = f"<UserId>{escape(user)}</UserId>" if user else ""
    xml = f"""<?xml version="1.0" encoding="UTF-16"?>
<Task version="1.2" xmlns="{TASK_NS}">
  <RegistrationInfo>
    <Date>{when}</Date>
    <Author>fusionai</Author>
    <Description>FusionAI provider (serves ML stages for a FusionAI broker)</Description>
    <URI>{escape(TASK)}</URI>
  </RegistrationInfo>
  <Triggers>
    <LogonTrigger>
      <Enabled>true</Enabled>
      {user_id}
    </LogonTrigger>
  </Triggers>
  <Principals>
    <Principal id="Author">
      {user_id}
      <LogonType>InteractiveToken</LogonType>
      <RunLevel>LeastPrivilege</RunLevel>
    </Principal>
  </Principals>
  <Settings>
    <MultipleInstancesPolicy>IgnoreNew</MultipleInstancesPolicy>
    <DisallowStartIfOnBatteries>false</DisallowStartIfOnBatteries>
    <StopIfGoingOnBatteries>false</StopIfGoingOnBatteries>
    <AllowHardTerminate>true</AllowHardTerminate>
    <StartWhenAvailable>true</StartWhenAvailable>
    <RunOnlyIfNetworkAvailable>false</RunOnlyIfNetworkAvailable>
    <IdleSettings>
      <StopOnIdleEnd>false</StopOnIdleEnd>
      <RestartOnIdle>false</RestartOnIdle>
    </IdleSettings>
    <AllowStartOnDemand>true</AllowStartOnDemand>
    <Enabled>true</Enabled>
    <Hidden>false</Hidden>
    <RunOnlyIfIdle>false</RunOnlyIfIdle>
    <WakeToRun>false</WakeToRun>
    <ExecutionTimeLimit>PT0S</ExecutionTimeLimit>
    <Priority>7</Priority>
    <RestartOnFailure>
      <Interval>PT1M</Interval>
      <Count>255</Count>
    </RestartOnFailure>
  </Settings>
  <Actions Context="Author">
    <Exec>
      <Command>{escape(_windows_arg(command))}</Command>
      <Arguments>{escape(" ".join(_windows_arg(a) for a in args))}</Arguments>
      <WorkingDirectory>{escape(str(spec.workdir))}</WorkingDirectory>
    </Exec>
  </Actions>
</Task>
"""
    return "".join(line for line in xml.splitlines(keepends=True) if line.strip())


def windows_logs() -> Path:
    base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
    return Path(base) / "fusionai" / "Logs"


def windowless(python: str) -> str:
    """pythonw.exe beside python.exe (no console window), when there is one."""
    path = Path(python)
    quiet = path.with_name("pythonw.exe")
    return str(quiet) if path.name.lower() == "python.exe" and quiet.exists() else python


# ---- installing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    kind: str  # "systemd", "launchd", "task"
    path: Path  # the file written
    started: bool  # registered and started with the service manager
    note: str  # what happened, or what the user must do
    logs: str  # where the logs are


def _run(*command: str) -> tuple[bool, str]:
    if shutil.which(command[0]) is None:
        return False, f"{command[0]} is not available"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return done.returncode == 0, (done.stderr or done.stdout).strip()


def install(spec: ServiceSpec, enable: bool = True, kind: str | None = None) -> Installed:
    """Write the service file and (with `enable`) register and start it."""
    kind = kind or platform_kind()
    steps: list[tuple[str, ...]]
    if kind == "systemd":
        path = systemd_dir() / UNIT
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, systemd_unit(spec).encode())
        logs = f"journalctl --user -u {UNIT.removesuffix('.service')}"
        steps = [
            ("systemctl", "--user", "daemon-reload"),
            ("systemctl", "--user", "enable", "--now", UNIT),
        ]
        later = f"systemctl --user daemon-reload && systemctl --user enable --now {UNIT}"
    elif kind == "launchd":
        path = launchd_dir() / f"{LABEL}.plist"
        path.parent.mkdir(parents=True, exist_ok=True)
        launchd_logs().mkdir(parents=True, exist_ok=True)
        write_atomic(path, launchd_plist(spec))
        logs = str(spec.log_file or launchd_logs() / "provider.log")
        domain = f"gui/{os.getuid()}" if hasattr(os, "getuid") else "gui"
        steps = [("launchctl", "bootstrap", domain, str(path))]
        later = f"launchctl bootstrap {domain} {path}"
    else:
        path = windows_logs().parent / "fusionai-provider-task.xml"  # %LOCALAPPDATA%\fusionai
        path.parent.mkdir(parents=True, exist_ok=True)
        xml = task_xml(spec, os.environ.get("USERNAME"))
        write_atomic(path, xml.encode("utf-16"))
        logs = str(spec.log_file or windows_logs() / "provider.log")
        steps = [
            ("schtasks", "/Create", "/TN", TASK, "/XML", str(path), "/F"),
            ("schtasks", "/Run", "/TN", TASK),
        ]
        later = f'schtasks /Create /TN "{TASK}" /XML "{path}" /F && schtasks /Run /TN "{TASK}"'
    if not enable:
        return Installed(kind, path, False, f"written; to start it: {later}", logs)
    for step in steps:
        ok, said = _run(*step)
        if not ok:
            return Installed(
                kind, path, False, f"written, but `{' '.join(step)}` failed ({said}); "
                f"once that works: {later}", logs,
            )  # fmt: skip
    note = "started, and starts again at each log-in"
    if kind == "systemd":
        note += f" (to start at boot without a log-in: loginctl enable-linger {_user()})"
    return Installed(kind, path, True, note, logs)


def uninstall(kind: str | None = None) -> tuple[list[Path], list[str]]:
    """Stop and unregister the service, remove its file: (files removed, notes)."""
    kind = kind or platform_kind()
    notes: list[str] = []
    steps: list[tuple[str, ...]]
    if kind == "systemd":
        path = systemd_dir() / UNIT
        steps = [("systemctl", "--user", "disable", "--now", UNIT)]
    elif kind == "launchd":
        path = launchd_dir() / f"{LABEL}.plist"
        uid = os.getuid() if hasattr(os, "getuid") else 0
        steps = [("launchctl", "bootout", f"gui/{uid}/{LABEL}")]
    else:
        path = windows_logs().parent / "fusionai-provider-task.xml"
        steps = [("schtasks", "/End", "/TN", TASK), ("schtasks", "/Delete", "/TN", TASK, "/F")]
    for step in steps:
        ok, said = _run(*step)
        if not ok:
            notes.append(f"`{' '.join(step)}`: {said}")
    removed = []
    if path.is_file():
        path.unlink()
        removed.append(path)
        if kind == "systemd":
            _run("systemctl", "--user", "daemon-reload")
    return removed, notes


def installed_file(kind: str | None = None) -> Path | None:
    kind = kind or platform_kind()
    if kind == "systemd":
        path = systemd_dir() / UNIT
    elif kind == "launchd":
        path = launchd_dir() / f"{LABEL}.plist"
    else:
        return None
    return path if path.is_file() else None


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:
        return "$USER"
