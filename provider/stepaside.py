"""Stepping aside for the machine's owner: when to pause serving and when to come back.

The provider runs on someone's own PC. When the owner needs it (a game starts, another
program keeps the GPU busy, the owner is at the keyboard, or it is one of the hours they
keep for themselves) the provider drains and leaves the broker's pool, and joins again once
the machine has been free for a while. This module is the decision alone, a pure state
machine over samples of the machine (`provider.watch` takes them):

    policy = Policy(StepAside(processes=("game.exe",), hours=(Window.parse("18:00-23:00"),)))
    change = policy.observe(sample)   # None, StepAsideNow(reasons) or ComeBack()

A cause must hold `busy_after_s` before the provider steps aside (the schedule acts at
once), and every cause must have been gone `idle_after_s` before it comes back; other
programs' GPU use counts as busy above `gpu_busy_percent` and as gone only below
`gpu_idle_percent`. So a short spike, or a game's loading screen, does not make it flap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DAY_S = 86400

_TIME = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


def _seconds(text: str) -> int:
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a time of day (HH:MM or HH:MM:SS)")
    h, mi, s = int(m[1]), int(m[2]), int(m[3] or 0)
    if h > 24 or mi > 59 or s > 59 or (h == 24 and (mi or s)):
        raise ValueError(f"{text!r} is not a time of day (00:00 to 24:00)")
    return h * 3600 + mi * 60 + s


@dataclass(frozen=True)
class Window:
    """A daily window of local time, [start, end); it may wrap past midnight."""

    start_s: int  # seconds after midnight
    end_s: int

    @classmethod
    def parse(cls, text: str) -> Window:
        """ "18:00-23:30", "22:00-06:00" (past midnight), "09:00:00-09:00:30"."""
        parts = text.split("-")
        if len(parts) != 2:
            raise ValueError(f"{text!r} is not a window of the day (HH:MM-HH:MM)")
        start, end = _seconds(parts[0]), _seconds(parts[1])
        if start == end:
            raise ValueError(f"{text!r} is empty: its start and end are the same time")
        return cls(start, end)

    def holds(self, seconds_of_day: float) -> bool:
        t = seconds_of_day % DAY_S
        if self.start_s < self.end_s:
            return self.start_s <= t < self.end_s
        return t >= self.start_s or t < self.end_s

    def __str__(self) -> str:
        def hms(s: int) -> str:
            h, rest = divmod(s, 3600)
            return f"{h:02d}:{rest // 60:02d}" + (f":{rest % 60:02d}" if rest % 60 else "")

        return f"{hms(self.start_s)}-{hms(self.end_s)}"


@dataclass(frozen=True)
class StepAside:
    """When the provider makes way for its owner (`provider start --step-aside-*`)."""

    enabled: bool = True  # watch the machine at all (`--no-step-aside`: never pause)
    processes: tuple[str, ...] = ()  # program names (games) whose running makes way for them
    gpu_busy_percent: float = 30.0  # other programs' GPU use above this is the owner's; 0: off
    gpu_idle_percent: float = 10.0  # ... and below this it is over (hysteresis)
    user_active_s: float = 0.0  # keyboard or mouse used within this many seconds; 0: off
    hours: tuple[Window, ...] = ()  # daily windows of local time kept for the owner
    busy_after_s: float = 5.0  # a cause must hold this long before stepping aside, seconds
    idle_after_s: float = 120.0  # all causes gone this long before joining again, seconds
    every_s: float = 2.0  # how often the machine is looked at, seconds

    def __post_init__(self) -> None:
        off = self.gpu_busy_percent == 0  # (then the idle line does not matter)
        if not (off or 0 <= self.gpu_idle_percent <= self.gpu_busy_percent <= 100):
            raise ValueError(
                "GPU thresholds need 0 <= idle <= busy <= 100 percent, got "
                f"idle {self.gpu_idle_percent:g} and busy {self.gpu_busy_percent:g}"
            )
        for name, value in (
            ("user_active_s", self.user_active_s),
            ("busy_after_s", self.busy_after_s),
            ("idle_after_s", self.idle_after_s),
        ):
            if not 0 <= value < 1e7:
                raise ValueError(f"{name} must be 0 or more seconds, got {value:g}")
        if not 0.05 <= self.every_s <= 3600:
            raise ValueError(f"every_s must be 0.05 to 3600 seconds, got {self.every_s:g}")
        for p in self.processes:
            if not p.strip() or len(p) > 255 or any(c in p for c in "/\\\0"):
                raise ValueError(f"{p!r} is not a program name (no folders: 'game.exe')")

    @property
    def watches(self) -> bool:
        """Whether anything is watched at all."""
        return self.enabled and bool(
            self.processes or self.gpu_busy_percent > 0 or self.user_active_s > 0 or self.hours
        )


@dataclass(frozen=True)
class Sample:
    """The machine as `provider.watch` saw it; None: this machine cannot tell."""

    at: float  # monotonic seconds
    seconds_of_day: float  # local time, seconds after midnight
    running: frozenset[str] = frozenset()  # the watched program names found running
    gpu_percent: float | None = None  # other programs' GPU use, percent (the busiest GPU)
    idle_s: float | None = None  # seconds since the user's last keyboard or mouse input


@dataclass(frozen=True)
class StepAsideNow:
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class ComeBack:
    free_s: float  # how long the machine had been free


Change = StepAsideNow | ComeBack


class Policy:
    """The state machine: `observe` each sample in time order; it answers when to change."""

    def __init__(self, config: StepAside) -> None:
        self.config = config
        self.aside = False
        self.reasons: tuple[str, ...] = ()  # why it is aside (or about to be)
        self._busy_since: float | None = None
        self._free_since: float | None = None
        self._gpu_hot = False

    def causes(self, sample: Sample) -> tuple[tuple[str, ...], bool]:
        """(the owner's reasons to have the machine now, whether one acts at once)."""
        c = self.config
        reasons: list[str] = []
        at_once = False
        for window in c.hours:
            if window.holds(sample.seconds_of_day):
                reasons.append(f"scheduled hours {window}")
                at_once = True
        reasons += [f"{name} is running" for name in sorted(sample.running)]
        if c.gpu_busy_percent > 0 and sample.gpu_percent is not None:
            limit = c.gpu_idle_percent if self._gpu_hot else c.gpu_busy_percent
            self._gpu_hot = sample.gpu_percent > limit
            if self._gpu_hot:
                reasons.append(f"other programs use the GPU ({sample.gpu_percent:.0f} %)")
        if c.user_active_s > 0 and sample.idle_s is not None and sample.idle_s < c.user_active_s:
            reasons.append(f"the user is active (input {sample.idle_s:.0f} s ago)")
        return tuple(reasons), at_once

    def observe(self, sample: Sample) -> Change | None:
        if not self.config.watches:
            return None
        reasons, at_once = self.causes(sample)
        if reasons:
            self._free_since = None
            if self.aside:
                self.reasons = reasons
                return None
            if self._busy_since is None:
                self._busy_since = sample.at
            if at_once or sample.at - self._busy_since >= self.config.busy_after_s:
                self.aside, self.reasons, self._busy_since = True, reasons, None
                return StepAsideNow(reasons)
            return None
        self._busy_since = None
        if not self.aside:
            return None
        if self._free_since is None:
            self._free_since = sample.at
        free = sample.at - self._free_since
        if free >= self.config.idle_after_s:
            self.aside, self.reasons, self._free_since = False, (), None
            return ComeBack(free)
        return None
