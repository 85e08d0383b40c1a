"""Job kinds: what each kind of job the broker runs provides (`JobKind`), and what the job
runner and the kinds share. The runner (`broker/jobs.py`) owns the lifecycle every kind has:
queued -> placed -> running -> succeeded, failed or cancelled, in SQLite, started when the
decision core says; a kind (`broker/embedjobs.py`, `broker/finetune/`) checks a submission
and builds its graph, runs a job to its end, and presents its results. The composition root
(`broker/service.py`) registers the kinds; the runner imports none of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from broker.errors import Conflict
from broker.schema import JobRow

T = TypeVar("T")
TERMINAL = ("succeeded", "failed", "cancelled")
ACTIVE = ("placed", "running")
NOMINAL_FLOPS = 1e11  # FLOP/s used only to rank jobs by size (SJF); not a prediction


class JobError(ValueError):
    """A job request is invalid; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


_PATH = re.compile(r"^(.*?)(?: - at `\$([^`]*)`)?$", re.S)
_NAMED = re.compile(r"field `([^`]+)`")


def refusal(exc: msgspec.ValidationError) -> JobError:
    """A decoding error as a `JobError` naming the top-level field at fault."""
    match = _PATH.match(str(exc))
    message, path = (match.group(1), match.group(2) or "") if match else (str(exc), "")
    named = _NAMED.search(message)  # "Object contains unknown field `x`", "... missing ..."
    if named and not path:
        path = "." + named.group(1)
    field = re.split(r"[.\[]", path.lstrip("."), maxsplit=1)[0] if path else ""
    where = path.lstrip(".") or "body"
    return JobError(field or "body", message if where == field else f"{where}: {message}")


def convert(value: Any, kind: type[T]) -> T:
    """Parsed JSON as `kind` (a `proto.api` struct); `JobError` naming the field at fault."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise refusal(exc) from None


class JobFailed(Exception):
    """The job cannot go on; the message says why (it becomes the job's error)."""


class NotReady(Conflict):
    """The job has no results yet."""


@dataclass(frozen=True)
class Ref:
    """What running a microbatch needs to know of its job (or interactive request)."""

    id: str
    model: str


@dataclass(frozen=True)
class Prepared:
    """A checked submission, ready to be stored and queued."""

    model: str
    request: dict[str, Any]  # stored as the job's request (JSON)
    graph: bytes  # the job graph (`dag.wire` JSON)
    units: int  # microbatches, or optimizer steps
    flops: float  # the whole job's work: the queue ranks jobs by it
    event: dict[str, Any] = field(default_factory=dict)  # fields of its "job_queued" event


class JobKind(Protocol):
    """One kind of job."""

    name: str  # the submission's "kind"
    request: type[Any]  # its body's struct (`proto.api.jobs`): the shape and limits of fields

    async def prepare(self, request: Any) -> Prepared:
        """Check a submission, already decoded as `request` (`JobError` naming the field;
        `NotFound` for its model)."""
        ...

    async def run(self, job: JobRow) -> None:
        """Run the job to its end (`JobFailed` when it cannot go on); results are stored as
        they come, so a job run again after a restart redoes only what was missing."""
        ...

    def results(self, job: JobRow, offset: int, limit: int) -> Any:
        """The job's results from `offset`, a `proto.api.jobs` struct (`NotReady` when it has
        none yet)."""
        ...
