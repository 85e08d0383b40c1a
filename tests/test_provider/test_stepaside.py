"""Stepping aside for the machine's owner: the policy's decisions (pure, in virtual time), the
programs seen running, and real processes: a provider steps aside for its scheduled hours and
comes back; a provider serving a generation steps aside when a game starts, the broker
promotes its backup, the generation ends with the local run's tokens, and it comes back."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import signal
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from provider.status import read as read_status
from provider.stepaside import ComeBack, Policy, Sample, StepAside, StepAsideNow, Window
from provider.watch import is_provider, macos_idle_s, running
from tests.procs import Proc, broker_command, provider_command, wait_until

pytestmark = pytest.mark.timeout(120)
IN_POOL = ("active", "backup")


def _at(t: float, **kw: object) -> Sample:
    return Sample(at=t, seconds_of_day=kw.pop("day", 12 * 3600.0), **kw)  # type: ignore[arg-type]


def test_a_game_makes_way_after_the_delay_and_the_provider_returns_after_the_quiet() -> None:
    policy = Policy(StepAside(processes=("game.exe",), busy_after_s=5, idle_after_s=60))
    game = frozenset({"game.exe"})
    assert policy.observe(_at(0, running=game)) is None  # a launcher's blink is not enough
    assert policy.observe(_at(4.9, running=game)) is None
    assert policy.observe(_at(5.0, running=game)) == StepAsideNow(("game.exe is running",))
    assert policy.observe(_at(30, running=game)) is None  # aside already
    assert policy.observe(_at(31)) is None  # the game quit: quiet from here
    assert policy.observe(_at(60, running=game)) is None  # ... it was only a restart
    assert policy.observe(_at(61)) is None
    assert policy.observe(_at(120.9)) is None
    assert policy.observe(_at(121)) == ComeBack(60)
    assert not policy.aside and policy.observe(_at(122)) is None


def test_gpu_use_has_two_thresholds_and_the_schedule_acts_at_once() -> None:
    policy = Policy(StepAside(gpu_busy_percent=30, gpu_idle_percent=10, busy_after_s=2,
                              idle_after_s=10))  # fmt: skip
    assert policy.observe(_at(0, gpu_percent=25)) is None  # under the busy line
    assert policy.observe(_at(1, gpu_percent=45)) is None
    change = policy.observe(_at(3, gpu_percent=40))
    assert isinstance(change, StepAsideNow) and "GPU (40 %)" in change.reasons[0]
    assert policy.observe(_at(10, gpu_percent=15)) is None  # above the idle line: still busy
    assert policy.observe(_at(19, gpu_percent=15)) is None
    assert policy.observe(_at(20, gpu_percent=5)) is None  # quiet from here
    assert policy.observe(_at(30, gpu_percent=9)) == ComeBack(10)
    evening = Policy(StepAside(hours=(Window.parse("22:00-06:00"),), busy_after_s=99))
    assert evening.observe(_at(0, day=21.5 * 3600)) is None
    assert evening.observe(_at(1, day=23 * 3600)) == StepAsideNow(("scheduled hours 22:00-06:00",))
    assert evening.observe(_at(2, day=5.9 * 3600)) is None  # past midnight: still its hours
    assert evening.observe(_at(3, day=6 * 3600)) is None  # over; quiet from here
    assert isinstance(evening.observe(_at(123, day=6 * 3600 + 120)), ComeBack)


def test_user_activity_counts_only_when_asked_and_bad_settings_are_refused() -> None:
    assert Policy(StepAside()).observe(_at(0, idle_s=0.0)) is None  # off by default
    active = Policy(StepAside(user_active_s=60, busy_after_s=0, gpu_busy_percent=0))
    assert active.observe(_at(0, idle_s=300)) is None
    assert isinstance(active.observe(_at(1, idle_s=2)), StepAsideNow)
    assert Policy(StepAside(enabled=False, processes=("g",))).observe(
        _at(0, running=frozenset({"g"}))
    ) is None  # fmt: skip
    for bad, message in [
        (lambda: Window.parse("25:00-26:00"), "not a time of day"),
        (lambda: Window.parse("18:00"), "not a window"),
        (lambda: Window.parse("18:00-18:00"), "empty"),
        (lambda: StepAside(gpu_busy_percent=10, gpu_idle_percent=20), "GPU thresholds"),
        (lambda: StepAside(idle_after_s=-1), "idle_after_s"),
        (lambda: StepAside(processes=("C:\\Games\\x.exe",)), "not a program name"),
    ]:
        with pytest.raises(ValueError, match=message):
            bad()
    assert str(Window.parse("9:05-9:05:30")) == "09:05-09:05:30"
    assert macos_idle_s('  |   "HIDIdleTime" = 2500000000\n') == 2.5


def test_a_program_is_seen_running_by_its_name_with_or_without_exe(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    game = tmp_path / "Standin-Game-Long-Name.exe"  # longer than Linux's 15-character names
    shutil.copy(sleep, game)
    assert running(["standin-game-long-name"]) == frozenset()
    proc = subprocess.Popen([str(game), "30"])
    try:
        wanted = ["standin-game-long-name", "other.exe"]
        assert wait_until("the game seen", lambda: running(wanted), 10) == {wanted[0]}
    finally:
        proc.kill()
        proc.wait()
    assert running(wanted) == frozenset()


def _clock(seconds_from_now: float) -> str:
    return (datetime.datetime.now() + datetime.timedelta(seconds=seconds_from_now)).strftime(
        "%H:%M:%S"
    )


def test_the_provider_steps_aside_for_its_scheduled_hours_and_comes_back(
    spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    broker = spawn(broker_command(tmp_path / "broker", heartbeat_s=0.5))
    addr = broker.wait_for("broker_started", timeout=30)["addrs"][0]
    window = f"{_clock(9)}-{_clock(11)}"  # after the provider has joined (~5 s here)
    options = ["--max-memory", "1", "--drain", "5", "--step-aside-hours", window]
    options += ["--rejoin-after", "0.5", "--step-aside-every", "0.5"]
    prov = spawn(provider_command(addr, tmp_path / "prov", *options))
    peer = prov.wait_for("listening", timeout=60)["peer_id"]
    # another provider's GPU use is not the owner's (several on one machine, or the demo)
    assert is_provider(psutil.Process(prov.proc.pid).cmdline())
    assert not is_provider(psutil.Process(broker.proc.pid).cmdline())
    assert is_provider(["/home/u/.local/bin/fusionai", "provider", "start", "--broker", "x"])
    assert not is_provider(["fusionai", "provider", "status"])
    joined = prov.wait_for("joined", timeout=30)
    aside = prov.wait_for("step_aside", timeout=30)
    assert aside["reasons"] == [f"scheduled hours {Window.parse(window)}"]
    assert aside["t"] > joined["t"], "the provider joined after its hours began: start later"
    prov.wait_for("drained")
    prov.wait_for("left")
    paused = prov.wait_for("paused")
    lost = broker.wait_for("provider_lost", lambda e: e["peer"] == peer, timeout=10)
    assert lost["graceful"] is True
    back = prov.wait_for("come_back", timeout=30)
    assert back["t"] - paused["t"] >= 1  # the rest of the window, then a quiet moment
    mark = broker.mark()
    prov.wait_for("resuming")
    prov.wait_for("joined", lambda e: e["t"] > back["t"], timeout=30)
    broker.wait_for("provider_joined", lambda e: e["peer"] == peer, timeout=30, since=mark)
    prov.signal(signal.SIGTERM)
    assert prov.wait(30) == 0


@pytest.fixture(scope="module")
def one_stage_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small random Llama with all its blocks in one provider stage: two providers give
    it an active provider and a warm backup."""
    pytest.importorskip("torch")
    from ir.export import build_package
    from tests.tiny_models import tiny_llama, tiny_tokenizer

    model = tiny_llama()
    out = tmp_path_factory.mktemp("llama1")
    tokenizer = tmp_path_factory.mktemp("llama1-tokenizer") / "tokenizer.json"
    tiny_tokenizer(tokenizer, model.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 1, out, name="tiny-llama-1", tokenizer_file=tokenizer)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_game_starting_mid_generation_hands_the_stage_to_the_backup(
    spawn: Callable[..., Proc], tmp_path: Path, one_stage_llama: Path
) -> None:
    """Each provider watches for its own stand-in game. The active one's game starts after
    a few tokens; it steps aside (drains, leaves, unloads), the broker promotes the backup,
    the client replays the session there and the tokens equal the local run's; the game
    quits and the provider joins again, taking the backup's place."""
    from client import AsyncClient
    from tests.test_broker.conftest import add_model, pools, wait_joined, wait_ready
    from tests.test_broker.test_gateway import local_greedy

    prompt, steps = "Models travel as ONNX", 24
    tokens, text = local_greedy(one_stage_llama, prompt, steps)
    broker = spawn(broker_command(tmp_path / "broker", heartbeat_s=0.5))
    started = broker.wait_for("broker_started", timeout=30)
    addr, http = started["addrs"][0], started["http"]
    procs: dict[str, Proc] = {}
    for name in ("game-a", "game-b"):
        options = ["--max-memory", "2", "--drain", "5", "--step-aside-for", name]
        options += ["--step-aside-after", "0.5", "--rejoin-after", "1", "--step-aside-every", "0.5"]
        prov = spawn(provider_command(addr, tmp_path / f"prov-{name}", *options))
        procs[prov.wait_for("listening", timeout=60)["peer_id"]] = prov
    wait_joined(http, procs)
    add_model(http, one_stage_llama)
    route = wait_ready(http, "tiny-llama-1", backups=1)
    active = route["stages"][0]["providers"][0]["peer_id"]
    backup = route["stages"][0]["backups"][0]
    backup = backup if isinstance(backup, str) else backup["peer_id"]
    game_name = "game-a" if procs[active] is next(iter(procs.values())) else "game-b"
    game = tmp_path / "games" / game_name
    game.parent.mkdir()
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, game)
    pieces: list[str] = []
    async with AsyncClient(http, cache_dir=tmp_path / "cache", timeout=20) as fa:
        stream = fa.generate(prompt, steps, temperature=0)
        played = None
        async for piece in stream:
            pieces.append(piece)
            if played is None and len(stream.result.tokens) >= 8:
                played = await asyncio.create_subprocess_exec(str(game), "60")  # a game starts
                procs[active].wait_for("paused", timeout=30)  # ... and the provider is gone
        result = stream.result
    assert played is not None
    assert result.tokens == tokens and "".join(pieces) == text  # as if nothing happened
    # (its session is gone, then its stage: the client moves on to the promoted backup)
    assert {f.peer for f in result.failovers} == {active} and result.route[0] == backup
    aside = procs[active].wait_for("step_aside")
    assert aside["reasons"] == [f"{game_name} is running"]
    broker.wait_for("stage_promoted", lambda e: e["peer"] == backup, timeout=10)
    played.kill()
    await played.wait()
    procs[active].wait_for("come_back", timeout=30)
    procs[active].wait_for("joined", lambda e: e["t"] > aside["t"], timeout=30)
    wait_until("the provider back in the pool", lambda: pools(http).get(active) in IN_POOL, 30)
    again = wait_ready(http, "tiny-llama-1", backups=1)  # both hold the stage again
    holders = {p["peer_id"] for p in again["stages"][0]["providers"]}
    holders |= {b if isinstance(b, str) else b["peer_id"] for b in again["stages"][0]["backups"]}
    assert holders == set(procs), (holders, pools(http))
    # the backup's work is on its books: every token of the replayed session and the rest
    name = "game-b" if game_name == "game-a" else "game-a"

    def counted() -> object:  # (the file is rewritten every 2 s)
        books = read_status(tmp_path / f"prov-{name}")
        enough = books is not None and books.run.tokens >= len(tokens)
        return books if enough and books.run.requests >= steps - 10 else None

    books = wait_until("the backup's status to count the work", counted, 10)
    assert books.run.online_s > 0 and books.run.serving_s > 0, books


def test_user_activity_is_read_from_a_real_x_server(tmp_path: Path) -> None:
    """Linux under X11: the XScreenSaver extension's idle time (Xvfb stands in for a desktop;
    with no display at all the reader says why it cannot tell)."""
    import os

    from provider.watch import idle_reader

    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    display = ":47"
    server = subprocess.Popen(["Xvfb", display, "-nolisten", "tcp"], stderr=subprocess.DEVNULL)
    old = os.environ.get("DISPLAY")
    try:
        os.environ.pop("DISPLAY", None)
        reader, why = idle_reader()
        assert reader is None and "$DISPLAY" in why
        os.environ["DISPLAY"] = display
        reader = wait_until("the X server", lambda: idle_reader()[0], 10)
        first = reader()
        wait_until("idle time to grow", lambda: reader() >= first + 0.5, 5)
    finally:
        os.environ.pop("DISPLAY", None)
        if old is not None:
            os.environ["DISPLAY"] = old
        server.kill()
        server.wait()
