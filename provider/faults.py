"""Deterministic faults a provider can be told to inject (the hidden `--fault` option): what
the failover, verification and chaos tests use to make a provider die, lie, stall or drop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fault:
    """Deterministic faults for tests (hidden `--fault` option)."""

    die_at_step: int | None = None  # exit the process when serving this request (1-based)
    wrong_output: bool = False  # add 1 to every floating-point output
    slow_ms: float = 0.0  # sleep this long before each answer, milliseconds
    drop: bool = False  # never answer (the caller times out)
    on: str | None = None  # die-at-step, slow, drop: this stage key only (not wrong-output)

    @classmethod
    def parse(cls, text: str | None) -> Fault | None:
        if not text:
            return None
        values: dict[str, Any] = {}
        for part in text.split(","):
            name, _, value = part.strip().partition("=")
            if name == "die-at-step" and value.isdigit() and int(value) > 0:
                values["die_at_step"] = int(value)
            elif name == "wrong-output" and not value:
                values["wrong_output"] = True
            elif name == "slow" and value.replace(".", "", 1).isdigit():
                values["slow_ms"] = float(value)
            elif name == "drop" and not value:
                values["drop"] = True
            elif name == "on" and value:
                values["on"] = value
            else:
                raise ValueError(
                    f"unknown fault {part!r}; use die-at-step=N, wrong-output, slow=MS, drop "
                    f"and on=STAGE_KEY"
                )
        return cls(**values)
