"""What the decision core decides: actions the service carries out and the simulator models.

Frozen, tagged msgspec structs, so a run's decisions can be recorded and compared element by
element with a replay's (`broker.core.trace`).
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Action(msgspec.Struct, frozen=True, tag=True):
    pass


class Welcome(_Action, frozen=True):
    peer_id: str  # answer the join: you are in the backup pool


class AskToRejoin(_Action, frozen=True):
    peer_id: str  # a heartbeat from a provider we consider dead or never met


class ProviderLost(_Action, frozen=True):
    peer_id: str
    stage: str | None  # what it served, if it was active
    graceful: bool


class PromoteBackup(_Action, frozen=True):
    """A stage lost with `replacing` goes to `peer_id`, which has it loaded (warm)."""

    model: str
    peer_id: str
    stage: str
    replacing: str


class Replan(_Action, frozen=True):
    """No warm provider could take over `lost`'s stage of `model`: its blocks move to a cold
    spare or to its neighbours, or its replica is dissolved."""

    model: str
    lost: str
    reason: str


class AssignStage(_Action, frozen=True):
    """Tell `peer_id` to load unit `key` (position `pos` of `model`'s provider stages)."""

    peer_id: str
    model: str
    key: str
    pos: int
    role: str  # "active": serve it; "backup": keep it loaded and stand by


class PromoteStage(_Action, frozen=True):
    """`peer_id` has `key` loaded as a backup: serve it now."""

    peer_id: str
    key: str


class UnassignStage(_Action, frozen=True):
    peer_id: str
    key: str


class PlacementChanged(_Action, frozen=True):
    """Persist `model`'s placement (its JSON form; None: it has none any more)."""

    model: str
    placement: dict[str, Any] | None


class StartJob(_Action, frozen=True):
    job: str
    model: str
    shares: str | None  # the running job whose route it shares (SJF-BSBF), if any


class Notice(_Action, frozen=True):
    """Something for the event log (`kind` and its fields, as the log shows them)."""

    kind: str
    data: dict[str, Any]
    peer: str | None = None
    job: str | None = None


Action = (
    Welcome
    | AskToRejoin
    | ProviderLost
    | PromoteBackup
    | Replan
    | AssignStage
    | PromoteStage
    | UnassignStage
    | PlacementChanged
    | StartJob
    | Notice
)
