"""Looking at the machine for `provider.stepaside`: which watched programs run, how busy
other programs keep the GPU, and how long ago the user last touched keyboard or mouse.

- Programs: psutil's process list, matched by name without case, with or without ".exe".
- GPU: NVIDIA's management library (the `nvidia-ml-py` package, `pynvml`), where it loads:
  the utilization samples of every process on each GPU but this one and its children; where
  a driver gives no per-process samples, the GPU's whole utilization while another program
  holds a context on it. Elsewhere (AMD, Intel, Apple) this machine cannot tell: None.
- Input: Windows `GetLastInputInfo`; macOS the HID system's idle time (`ioreg`); Linux under
  X11 the XScreenSaver extension (`libXss`). Elsewhere (Wayland, a console, a service with no
  display): None.

Each reading that fails once says why in a log line and is not tried again.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

from provider.stepaside import ComeBack, Policy, Sample, StepAside, StepAsideNow

log = logging.getLogger("fusionai.provider")


def _bare(name: str) -> str:
    name = name.strip().lower()
    return name[:-4] if name.endswith(".exe") else name


def running(wanted: Iterable[str], me: int | None = None) -> frozenset[str]:
    """Of the program names `wanted`, those running now (not counting this process)."""
    import psutil

    names = {_bare(w): w for w in wanted}
    if not names:
        return frozenset()
    me = os.getpid() if me is None else me
    found = set()
    for proc in psutil.process_iter(["name", "exe"]):
        if proc.pid == me:
            continue
        info = proc.info
        for candidate in (info.get("name"), os.path.basename(info.get("exe") or "")):
            if candidate and _bare(candidate) in names:
                found.add(names[_bare(candidate)])
    return frozenset(found)


def is_provider(cmdline: list[str]) -> bool:
    """Whether a command line runs `fusionai provider start` (or `-m cli.main provider ...`)."""
    words = [os.path.basename(w).lower() for w in cmdline]
    for i, word in enumerate(words[:-2]):
        if word in ("fusionai", "fusionai.exe", "cli.main") and words[i + 1 : i + 3] == [
            "provider",
            "start",
        ]:
            return True
    return False


class GpuWatch:
    """Other programs' use of NVIDIA GPUs, in percent of the busiest one."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.why = ""
        self._seen: dict[int, int] = {}  # device index -> last sample timestamp (µs)
        self._providers: dict[int, bool] = {}  # pid -> whether it is a FusionAI provider
        try:
            import pynvml

            pynvml.nvmlInit()
            self.devices = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            self.nvml = pynvml
        except Exception as exc:  # no package, no driver, no NVIDIA GPU
            self.why = f"no NVIDIA GPU use can be read ({type(exc).__name__}: {exc})"

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None

    def others_percent(self) -> float | None:
        if self.nvml is None:
            return None
        import psutil

        mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
        busiest = 0.0
        for i, handle in enumerate(self.devices):
            busiest = max(busiest, self._device(i, handle, mine))
        return busiest

    def _ours(self, pid: int, mine: set[int]) -> bool:
        """This provider, its children, or another provider on this machine (one per GPU,
        or a demo swarm): their GPU use is not the owner's."""
        if pid in mine:
            return True
        if pid not in self._providers:
            try:
                import psutil

                self._providers[pid] = is_provider(psutil.Process(pid).cmdline())
            except Exception:  # gone, or not ours to look at
                self._providers[pid] = False
        return self._providers[pid]

    def _device(self, i: int, handle: Any, mine: set[int]) -> float:
        nvml = self.nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._seen.get(i, 0))
            if samples:
                self._seen[i] = max(s.timeStamp for s in samples)
            return float(sum(s.smUtil for s in samples if not self._ours(s.pid, mine)))
        except nvml.NVMLError_NotFound:
            return 0.0  # no process used it since the last sample
        except nvml.NVMLError:
            pass  # no per-process samples on this driver: the whole GPU, if others are on it
        procs = [
            *nvml.nvmlDeviceGetComputeRunningProcesses(handle),
            *nvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
        ]
        if all(self._ours(p.pid, mine) for p in procs):
            return 0.0
        return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _windows_idle_s() -> float:
    class LastInput(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LastInput()
    info.cbSize = ctypes.sizeof(LastInput)
    windll: Any = ctypes.windll  # type: ignore[attr-defined]
    if not windll.user32.GetLastInputInfo(ctypes.byref(info)):
        raise OSError("GetLastInputInfo failed")
    return ((windll.kernel32.GetTickCount() - info.dwTime) & 0xFFFFFFFF) / 1000.0


def macos_idle_s(ioreg_output: str) -> float:
    """The HID system's idle time (nanoseconds in `ioreg -c IOHIDSystem -d 4`), seconds."""
    m = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', ioreg_output)
    if not m:
        raise ValueError("no HIDIdleTime in ioreg's output")
    return int(m[1]) / 1e9


def _macos_idle_s() -> float:
    out = subprocess.run(
        ["ioreg", "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True, timeout=5
    ).stdout
    return macos_idle_s(out)


class _XssInfo(ctypes.Structure):
    _fields_ = [
        ("window", ctypes.c_ulong),
        ("state", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("til_or_since", ctypes.c_ulong),
        ("idle", ctypes.c_ulong),
        ("event_mask", ctypes.c_ulong),
    ]


class _X11Idle:
    def __init__(self) -> None:
        display = os.environ.get("DISPLAY")
        if not display:
            raise OSError("no X11 display ($DISPLAY is not set; Wayland and consoles say nothing)")
        xlib, xss = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
        if not xlib or not xss:
            raise OSError("libX11 or libXss is not installed")
        self.x11, self.xss = ctypes.cdll.LoadLibrary(xlib), ctypes.cdll.LoadLibrary(xss)
        self.x11.XOpenDisplay.restype = ctypes.c_void_p
        self.x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self.x11.XDefaultRootWindow.restype = ctypes.c_ulong
        self.xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XssInfo)
        self.xss.XScreenSaverQueryInfo.argtypes = [
            ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_XssInfo),
        ]  # fmt: skip
        self.display = self.x11.XOpenDisplay(display.encode())
        if not self.display:
            raise OSError(f"cannot open X11 display {display!r}")
        self.info = self.xss.XScreenSaverAllocInfo()

    def __call__(self) -> float:
        root = self.x11.XDefaultRootWindow(self.display)
        if not self.xss.XScreenSaverQueryInfo(self.display, root, self.info):
            raise OSError("the X server has no screen-saver extension")
        return float(self.info.contents.idle) / 1000.0


def idle_reader() -> tuple[Any, str]:
    """(a function giving seconds since the user's last input, or None; why not)."""
    try:
        if sys.platform == "win32":
            _windows_idle_s()
            return _windows_idle_s, ""
        if sys.platform == "darwin":
            _macos_idle_s()
            return _macos_idle_s, ""
        reader = _X11Idle()
        reader()
        return reader, ""
    except Exception as exc:
        return None, f"the user's activity cannot be read here ({exc})"


class Watch:
    """Samples of this machine for the policy `config`."""

    def __init__(self, config: StepAside) -> None:
        self.config = config
        self.gpu = GpuWatch() if config.gpu_busy_percent > 0 else None
        self.idle: Any = None
        why_idle = ""
        if config.user_active_s > 0:
            self.idle, why_idle = idle_reader()
        self.unavailable = [w for w in (self.gpu.why if self.gpu else "", why_idle) if w]

    def sample(self) -> Sample:
        now = time.localtime()
        gpu: float | None = None
        idle: float | None = None
        if self.gpu is not None:
            try:
                gpu = self.gpu.others_percent()
            except Exception as exc:
                log.warning("reading GPU use failed, not tried again: %s", exc)
                self.gpu.close()
                self.gpu = None
        if self.idle is not None:
            try:
                idle = self.idle()
            except Exception as exc:
                log.warning("reading the user's activity failed, not tried again: %s", exc)
                self.idle = None
        return Sample(
            at=time.monotonic(),
            seconds_of_day=now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec,
            running=running(self.config.processes) if self.config.processes else frozenset(),
            gpu_percent=gpu,
            idle_s=idle,
        )

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()


async def watch_machine(
    config: StepAside,
    policy: Policy,
    aside: asyncio.Event,
    back: asyncio.Event,
    ended: asyncio.Event,
) -> None:
    """Look at the machine every `every_s` and set `aside` or `back` as `policy` says, until
    `ended`."""
    from provider.events import event

    if not config.watches:
        return
    watch = await asyncio.to_thread(Watch, config)
    event(
        "step_aside_policy",
        processes=list(config.processes),
        gpu_busy_percent=config.gpu_busy_percent,
        user_active_s=config.user_active_s,
        hours=[str(w) for w in config.hours],
        unavailable=watch.unavailable,
    )
    try:
        while not ended.is_set():
            change = policy.observe(await asyncio.to_thread(watch.sample))
            if isinstance(change, StepAsideNow):
                event("step_aside", reasons=list(change.reasons))
                back.clear()
                aside.set()
            elif isinstance(change, ComeBack):
                event("come_back", free_s=round(change.free_s, 1))
                aside.clear()
                back.set()
            try:
                await asyncio.wait_for(ended.wait(), config.every_s)
            except TimeoutError:
                pass
    finally:
        watch.close()
