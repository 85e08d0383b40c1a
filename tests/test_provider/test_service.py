"""The provider as a service: the systemd unit, launchd agent and Task Scheduler task that
`fusionai provider install-service` writes, checked against their formats, and the unit's
command line run as systemd runs it, joining a real broker; `fusionai provider status`."""

from __future__ import annotations

import json
import os
import plistlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from provider import service
from tests.procs import ROOT, Proc, broker_command, fusionai, wait_until

pytestmark = pytest.mark.timeout(120)

BROKER = "/ip4/127.0.0.1/tcp/7370/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
# Words a unit file or a Windows command line must carry through unchanged: spaces, quotes,
# a backslash, and systemd's specifier and variable characters.
AWKWARD = ['my game "deluxe".exe', "50%", "$HOME", "C:\\Games\\", "a\\b c"]


def _spec(tmp_path: Path) -> service.ServiceSpec:
    argv = (sys.executable, "-m", "cli.main", "provider", "start", "--broker", BROKER)
    argv += tuple(w for name in AWKWARD for w in ("--step-aside-for", name))
    return service.ServiceSpec(
        argv=argv, workdir=tmp_path, env={"FUSIONAI_THREADS": "1"}, stop_timeout_s=20.5
    )


def _unit_fields(text: str) -> dict[str, list[str]]:
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            fields.setdefault(key, []).append(value)
    return fields


def _systemd_words(value: str) -> list[str]:
    """A unit's command line as systemd splits it: shell-like quoting, `%%` and `$$` for a
    literal % and $."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(value)]


def test_the_systemd_unit_reads_back_as_the_command_it_was_given(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    fields = _unit_fields(service.systemd_unit(spec))
    assert _systemd_words(fields["ExecStart"][0]) == list(spec.argv)
    envs = dict(_systemd_words(e)[0].split("=", 1) for e in fields["Environment"])
    assert envs == {"FUSIONAI_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    assert _systemd_words(fields["WorkingDirectory"][0]) == [str(tmp_path)]
    assert fields["KillSignal"] == ["SIGTERM"] and fields["TimeoutStopSec"] == ["21"]
    assert fields["Restart"] == ["on-failure"] and fields["WantedBy"] == ["default.target"]
    with pytest.raises(service.ServiceError, match="line break"):
        service.systemd_unit(service.ServiceSpec(argv=("a\nb",), workdir=tmp_path))


def _verify(unit: Path, tmp_path: Path) -> str:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--user", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
    )
    return f"rc={done.returncode} {done.stdout}{done.stderr}".strip()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not here")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / service.UNIT
    unit.write_text(service.systemd_unit(_spec(tmp_path)))
    assert _verify(unit, tmp_path) == "rc=0"
    # The check can fail: systemd reports an unknown key and a bad value (and goes on).
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("Restart=on-failure", "Restart=often\nNapTime=1"))
    said = _verify(broken, tmp_path)
    assert "restart specifier" in said and "Unknown key 'NapTime'" in said


def test_the_launchd_agent_is_a_property_list_running_the_command(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    agent = plistlib.loads(service.launchd_plist(spec))
    assert agent["Label"] == service.LABEL and agent["ProgramArguments"] == list(spec.argv)
    assert agent["RunAtLoad"] is True and agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["EnvironmentVariables"]["FUSIONAI_THREADS"] == "1"
    assert agent["WorkingDirectory"] == str(tmp_path) and agent["ExitTimeOut"] == 21
    assert agent["StandardErrorPath"].endswith("provider.stderr.log")


# The Task Scheduler schema (version 1.2) for the elements the task uses: each element's
# allowed children, and the values its simple types allow.
T = "{" + service.TASK_NS + "}"
BOOL = re.compile(r"^(true|false)$")
DURATION = re.compile(r"^P(?!$)(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?$")
SCHEMA: dict[str, set[str]] = {
    "Task": {"RegistrationInfo", "Triggers", "Settings", "Data", "Principals", "Actions"},
    "RegistrationInfo": {
        "URI",
        "SecurityDescriptor",
        "Source",
        "Date",
        "Author",
        "Version",
        "Description",
        "Documentation",
    },
    "Triggers": {
        "BootTrigger",
        "RegistrationTrigger",
        "IdleTrigger",
        "TimeTrigger",
        "EventTrigger",
        "LogonTrigger",
        "SessionStateChangeTrigger",
        "CalendarTrigger",
    },
    "LogonTrigger": {
        "Enabled",
        "StartBoundary",
        "EndBoundary",
        "ExecutionTimeLimit",
        "Repetition",
        "Delay",
        "UserId",
    },
    "Principals": {"Principal"},
    "Principal": {
        "UserId",
        "GroupId",
        "DisplayName",
        "LogonType",
        "RunLevel",
        "ProcessTokenSidType",
        "RequiredPrivileges",
    },
    "Settings": {
        "AllowStartOnDemand",
        "RestartOnFailure",
        "MultipleInstancesPolicy",
        "DisallowStartIfOnBatteries",
        "StopIfGoingOnBatteries",
        "AllowHardTerminate",
        "StartWhenAvailable",
        "NetworkProfileName",
        "RunOnlyIfNetworkAvailable",
        "WakeToRun",
        "Enabled",
        "Hidden",
        "DeleteExpiredTaskAfter",
        "IdleSettings",
        "NetworkSettings",
        "ExecutionTimeLimit",
        "Priority",
        "RunOnlyIfIdle",
        "UseUnifiedSchedulingEngine",
        "DisallowStartOnRemoteAppSession",
    },
    "IdleSettings": {"Duration", "WaitTimeout", "StopOnIdleEnd", "RestartOnIdle"},
    "RestartOnFailure": {"Interval", "Count"},
    "Actions": {"Exec", "ComHandler", "SendEmail", "ShowMessage"},
    "Exec": {"Command", "Arguments", "WorkingDirectory"},
}
LOGON_TYPES = {"S4U", "Password", "InteractiveToken", "InteractiveTokenOrPassword", "Group",
               "ServiceAccount", "None"}  # fmt: skip
VALUES: dict[str, Callable[[str], object]] = {
    "Enabled": BOOL.match,
    "Hidden": BOOL.match,
    "AllowStartOnDemand": BOOL.match,
    "DisallowStartIfOnBatteries": BOOL.match,
    "StopIfGoingOnBatteries": BOOL.match,
    "AllowHardTerminate": BOOL.match,
    "StartWhenAvailable": BOOL.match,
    "RunOnlyIfNetworkAvailable": BOOL.match,
    "WakeToRun": BOOL.match,
    "RunOnlyIfIdle": BOOL.match,
    "StopOnIdleEnd": BOOL.match,
    "RestartOnIdle": BOOL.match,
    "ExecutionTimeLimit": DURATION.match,
    "Interval": DURATION.match,
    "LogonType": lambda v: v in LOGON_TYPES,
    "RunLevel": lambda v: v in {"LeastPrivilege", "HighestAvailable"},
    "MultipleInstancesPolicy": lambda v: v in {"Parallel", "Queue", "IgnoreNew", "StopExisting"},
    "Priority": lambda v: v.isdigit() and 0 <= int(v) <= 10,
    "Count": lambda v: v.isdigit() and 1 <= int(v) <= 255,  # unsignedByte, at least 1
    "Command": bool,
    "Date": lambda v: bool(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$", v)),
}


def _check_task(element: ET.Element, path: str = "Task") -> None:
    name = element.tag.removeprefix(T)
    assert element.tag.startswith(T), f"{path}: {element.tag} is outside the task namespace"
    children = [c.tag.removeprefix(T) for c in element]
    if name in SCHEMA:
        assert set(children) <= SCHEMA[name], f"{path}: {set(children) - SCHEMA[name]}"
        assert len(children) == len(set(children)) or name in ("Triggers", "Actions")
    elif children:
        raise AssertionError(f"{path} has children the schema does not give it: {children}")
    if name in VALUES:
        assert VALUES[name]((element.text or "").strip()), f"{path}: {element.text!r}"
    for child in element:
        _check_task(child, f"{path}/{child.tag.removeprefix(T)}")


def _windows_split(line: str) -> list[str]:
    """A command line as the C runtime's parser splits it (backslashes before a quote)."""
    words, word, quoted, i, started = [], "", False, 0, False
    while i < len(line):
        c = line[i]
        if c == "\\":
            n = len(line[i:]) - len(line[i:].lstrip("\\"))
            if i + n < len(line) and line[i + n] == '"':
                word += "\\" * (n // 2)
                if n % 2:
                    word += '"'
                    i += n + 1
                else:
                    i += n
                started = True
                continue
            word += "\\" * n
            i += n
            started = True
            continue
        if c == '"':
            quoted, started = not quoted, True
        elif c == " " and not quoted:
            if started:
                words.append(word)
            word, started = "", False
        else:
            word += c
            started = True
        i += 1
    if started:
        words.append(word)
    return words


def test_the_windows_task_follows_the_task_scheduler_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    spec = service.ServiceSpec(argv=_spec(tmp_path).argv, workdir=tmp_path)
    done = service.install(spec, enable=False, kind="task")
    assert done.path == tmp_path / "local" / "fusionai" / "fusionai-provider-task.xml"
    raw = done.path.read_bytes()
    assert raw.startswith(b"\xff\xfe")  # UTF-16 with its byte-order mark, as schtasks reads
    root = ET.fromstring(raw.decode("utf-16").split("?>", 1)[1])
    assert root.tag == f"{T}Task" and root.get("version") == "1.2"
    _check_task(root)
    exec_ = root.find(f"{T}Actions/{T}Exec")
    assert exec_ is not None
    assert exec_.findtext(f"{T}Command") == spec.argv[0]
    assert _windows_split(exec_.findtext(f"{T}Arguments") or "") == list(spec.argv[1:])
    with pytest.raises(service.ServiceError, match="environment"):
        service.task_xml(_spec(tmp_path))  # a task cannot set variables: refused, not lost


def _broker(spawn: Callable[..., Proc], tmp_path: Path) -> tuple[Proc, str, str]:
    proc = spawn(broker_command(tmp_path / "broker", heartbeat_s=0.5))
    started = proc.wait_for("broker_started", timeout=30)
    return proc, started["addrs"][0], started["http"]


def _user_systemd() -> str | None:
    """Why there is no systemd user instance to run the unit under, or None if there is."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed"
    done = subprocess.run(
        ["systemctl", "--user", "is-system-running"], capture_output=True, text=True, timeout=30
    )
    state = done.stdout.strip()
    if state in ("running", "degraded"):
        return None
    return f"no systemd user instance here (systemctl --user: {(done.stderr or state).strip()})"


def test_install_service_writes_a_unit_whose_command_joins_a_broker_and_drains(
    spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    """Where no systemd user instance runs (this machine: no systemd at all), the unit is
    written all the same, the command says it could not be started and why, and the unit's
    command line, run as systemd would run it (its environment only, its working directory,
    SIGTERM to stop), is a provider that joins the broker and reports its status."""
    broker, addr, _ = _broker(spawn, tmp_path)
    home, data = tmp_path / "home", tmp_path / "data"
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    options = ["--broker", addr, "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0"]
    options += ["--max-memory", "2", "--drain", "5", "--json", "--step-aside-for", "no such game"]
    done = subprocess.run(
        fusionai("provider", "install-service", *options),
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    unit = home / ".config" / "systemd" / "user" / service.UNIT
    assert unit.is_file(), done.stdout + done.stderr
    why = _user_systemd()
    if why is not None:
        assert done.returncode == 1 and "failed" in done.stdout, done.stdout
    fields = _unit_fields(unit.read_text())
    argv = _systemd_words(fields["ExecStart"][0])
    assert argv[:5] == [sys.executable, "-m", "cli.main", "provider", "start"]
    assert argv[argv.index("--data-dir") + 1] == str(data.resolve())
    workdir = _systemd_words(fields["WorkingDirectory"][0])[0]
    assert Path(workdir) == ROOT  # a checkout: `-m cli.main` runs this very code
    unit_env = [_systemd_words(e)[0] for e in fields.get("Environment", [])]
    # systemd starts it with no environment but its own few variables and the unit's
    prov = spawn(["env", "-i", f"--chdir={workdir}", f"HOME={home}", "PATH=/usr/bin:/bin",
                  *unit_env, *argv])  # fmt: skip
    peer = prov.wait_for("listening", timeout=60)["peer_id"]
    broker.wait_for("provider_joined", lambda e: e.get("peer") == peer, timeout=60)

    def status() -> dict[str, object]:
        out = subprocess.run(
            fusionai("provider", "status", "--data-dir", str(data), "--json"),
            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
        )  # fmt: skip
        answer: dict[str, object] = json.loads(out.stdout)
        return answer

    seen = wait_until("a status with pool and reach", lambda: (
        (s := status())["pool"] and s["reach"] and s) or None, timeout=30)  # fmt: skip
    assert seen["running"] is True and seen["state"] == "serving", seen
    assert seen["peer_id"] == peer and seen["pool"] == "backup", seen
    assert seen["reach"] == "direct" and seen["service"] == str(unit), seen
    prov.signal(signal.SIGTERM)  # the unit's KillSignal
    assert prov.wait(timeout=float(fields["TimeoutStopSec"][0])) == 0
    prov.wait_for("drained")
    broker.wait_for("provider_lost", lambda e: e.get("peer") == peer, timeout=10)
    stopped = status()
    assert stopped["running"] is False and stopped["state"] == "stopped"
    total = stopped["total"]
    assert isinstance(total, dict) and total["online_s"] > 0
    text = subprocess.run(
        fusionai("provider", "status", "--data-dir", str(data)),
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    ).stdout  # fmt: skip
    assert "not running" in text and "h in the pool" in text and peer in text
    gone = subprocess.run(
        fusionai("provider", "uninstall-service"),
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    assert gone.returncode == 0 and not unit.exists(), gone.stdout + gone.stderr


def test_the_installed_unit_runs_under_a_systemd_user_instance(
    spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    """Where a systemd user instance runs: install-service starts the unit, whose provider
    joins the broker; uninstall-service stops it (it leaves the pool) and removes it."""
    why = _user_systemd()
    if why is not None:
        pytest.skip(f"{why}; the unit's command line is run as systemd would run it instead")
    if service.installed_file() is not None:
        pytest.skip(f"this user already has a provider service ({service.installed_file()})")
    broker, addr, _ = _broker(spawn, tmp_path)
    options = ["--broker", addr, "--data-dir", str(tmp_path / "data"), "--max-memory", "2"]
    options += ["--listen", "/ip4/127.0.0.1/tcp/0", "--drain", "5"]
    done = subprocess.run(
        fusionai("provider", "install-service", *options),
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        joined = broker.wait_for("provider_joined", timeout=60)
    finally:
        subprocess.run(fusionai("provider", "uninstall-service"), timeout=60, cwd=ROOT)
    broker.wait_for("provider_lost", lambda e: e.get("peer") == joined["peer"], timeout=60)
