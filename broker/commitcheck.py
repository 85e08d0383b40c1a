"""Checking a generation's signed commitments by running it again (`POST
/v1/models/{name}/verify`).

A client sends the tokens a generation fed (its prompt, then each generated token but the
last) and, per provider session, the commitments that session's provider signed
(`proto.session.Commitment`: every 32 tokens of its stage's outputs). The broker checks each
signature against the provider named, runs the model over the tokens in one prefill pass (its
own copy of every stage's validated ONNX file, on onnxruntime, the hidden states put through
the package's wire between stages as the swarm sends them), and compares each session's
commitments with its stage's rows, within the tolerance of the stage's output dtype
(`ir.toploc.TOLERANCES`, measured across onnxruntime and torch, fp32 and fp16).

A stage's wrong outputs are the next stages' inputs, so only the first stage of the route
whose commitments fail is judged: its providers are quarantined (the broker's own run is the
confirmation; `Verifier.quarantine` takes them out of the pool and redoes their recent batch
work), the later stages are "not judged". A commitment whose signature does not check names
nobody: the request is refused. The check costs one prefill of the whole model here, one at
a time; a client samples which generations it sends (`AsyncClient(verify_share=...)`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.errors import NotFound
from broker.events import EventLog
from broker.jobkinds import JobError
from broker.models import ModelStore, StoredModel
from broker.verify import Verifier
from client.stages import ClientStageError
from ir.executors.ort import OrtExecutor
from ir.pipeline import LocalPipeline
from ir.toploc import TOLERANCES, Check, Tolerance, check_rows, covered
from p2p import verify
from p2p.tensor import through_wire
from proto.api.swarm import CommittedSession, SessionVerdict, Verdict, VerifyRequest
from proto.session import COMMITMENT_DOMAIN, commitment_bytes

log = logging.getLogger("fusionai.broker")
Array = np.ndarray[Any, Any]
MODELS_KEPT = 2  # models whose stages stay loaded for checks (least recently used dropped)


class CommitmentChecks:
    def __init__(self, models: ModelStore, verifier: Verifier, events: EventLog) -> None:
        self.models = models
        self.verifier = verifier
        self.events = events
        self._executors: OrderedDict[bytes, list[OrtExecutor]] = OrderedDict()
        self._lock = asyncio.Lock()  # one recomputation at a time: each is a whole prefill

    async def verify(self, name: str, body: VerifyRequest) -> Verdict:
        stored = self.models.models.get(name)
        if stored is None:
            raise NotFound(f"no model named {name!r}")
        client = await asyncio.to_thread(self.models.client, name)
        try:
            ids, _ = await asyncio.to_thread(client.pad, [body.tokens])
        except ClientStageError as exc:
            raise JobError("tokens", str(exc)) from None
        async with self._lock:  # (signatures, the prefill and the comparisons: off the loop)
            judged = await asyncio.to_thread(self._compare, stored, ids, body)
        first_stage = stored.manifest.stages[stored.units[0]]
        dtype = next(o.dtype for o in first_stage.outputs if o.name == "hidden_states_out")
        tolerance = TOLERANCES.get(dtype, TOLERANCES["float16"])
        findings = judge([(pos, given, made) for pos, _, _, given, made in judged], tolerance)
        verdicts, guilty = [], []
        for (_, key, s, _, made), found in zip(judged, findings, strict=True):
            verdicts.append(_verdict(s, key, found.ok, made, found.reason))
            if found.guilty and s.peer not in guilty:
                guilty.append(s.peer)
                self.verifier.quarantine(s.peer, f"its commitments to {key}: {found.reason}")
        ok = not any(v.ok is False for v in verdicts)
        self.events.emit(
            "generation_verified", model=name, ok=ok, tokens=len(body.tokens),
            sessions=len(verdicts), quarantined=guilty,
        )  # fmt: skip
        return Verdict(name, ok, verdicts, guilty)

    def _compare(
        self, stored: StoredModel, ids: Array, body: VerifyRequest
    ) -> list[tuple[int, str, CommittedSession, Check, Check]]:
        """Each session (its stage's position and key, then how the broker's run compares with
        what it committed to being given and to answering), in the order of positions;
        JobError for commitments not signed by the provider named, or not a run's chunks."""
        keys = [stored.unit_key(i) for i in stored.units]
        sessions = []
        for s in body.sessions:
            pos = keys.index(_stage_of(s, keys))
            sessions.append((pos, s, _covered(s, len(body.tokens))))
        rows = self._rows(stored, ids)
        judged = []
        for pos, s, n in sorted(sessions, key=lambda p: p[0]):
            chunks = sorted(s.commitments, key=lambda c: c.chunk)
            given = check_rows(rows[pos][:n], [c.input_data for c in chunks])
            made = check_rows(rows[pos + 1][:n], [c.data for c in chunks])
            judged.append((pos, keys[pos], s, given, made))
        return judged

    def _rows(self, stored: StoredModel, ids: Array) -> list[Array]:
        """The rows (tokens, hidden) each provider stage is given for `ids` and, last, the last
        stage's outputs: the embedding's output, then each stage's, in one pass."""
        seen: list[Array] = []

        def hop(hidden: Array) -> Array:  # the embedding's output, then each stage's
            sent = through_wire(hidden, stored.manifest.wire)
            seen.append(np.asarray(sent[0], dtype=np.float32))
            return sent

        pipe = LocalPipeline(stored.manifest, self._stages(stored), hop=hop)
        pipe.step(ids, 0, pipe.new_cache())
        return seen

    def _stages(self, stored: StoredModel) -> list[OrtExecutor]:
        """Every stage of the model loaded (kept for the next check of the same version)."""
        key = stored.manifest_bytes
        runs = self._executors.get(key)
        if runs is None:
            runs = [  # (checks come now and then: idle threads sleep, not spin)
                OrtExecutor(stored.directory / s.file, inputs=s.inputs, spinning=False)
                for s in stored.manifest.stages
            ]
            self._executors[key] = runs
            while len(self._executors) > MODELS_KEPT:
                self._executors.popitem(last=False)
        self._executors.move_to_end(key)
        return runs


@dataclass(frozen=True)
class Finding:
    ok: bool | None  # None: not judged
    guilty: bool = False  # its own outputs are wrong (it is quarantined)
    reason: str = ""


def judge(sessions: list[tuple[int, Check, Check]], tolerance: Tolerance) -> list[Finding]:
    """A finding per session, given as (its stage's position, how the broker's run compares
    with what it committed to being given, and with what it committed to answering), in the
    order of positions. Walking the route from its first stage: a session whose input
    commitments differ from the broker's run was given something else than the stage before
    it committed to sending (or says so falsely), and nobody can be told guilty; one whose
    inputs agree but outputs differ computed something else, and is guilty. The stages after
    the first where either happens are not judged."""
    out: list[Finding] = []
    broken: int | None = None
    for pos, given, made in sessions:
        if broken is not None and pos > broken:
            out.append(Finding(None, reason=f"not judged: stage {broken} of the route failed"))
        elif not given.within(tolerance):
            broken = pos
            why = (
                f"what it says it was given differs from what the stage before it committed "
                f"to sending ({_off(given, tolerance)}): it or that stage's provider "
                "misreports the hand-over"
            )
            out.append(Finding(False, reason=why))
        elif not made.within(tolerance):
            broken = pos
            why = f"its outputs differ from the broker's run ({_off(made, tolerance)})"
            out.append(Finding(False, guilty=True, reason=why))
        else:
            out.append(Finding(True))
    return out


def _off(check: Check, tolerance: Tolerance) -> str:
    return (
        f"{check.mismatches} values of a chunk off in sign or exponent, mantissas "
        f"{check.mantissa_mean:.3g} apart on average; tolerance {tolerance.mismatches} and "
        f"{tolerance.mantissa_mean}"
    )


def _stage_of(session: CommittedSession, keys: list[str]) -> str:
    """The stage a session's commitments are for, each signed by the provider named."""
    first = session.commitments[0]
    for c in session.commitments:
        if (c.stage, c.session) != (first.stage, first.session):
            raise JobError("sessions", "one entry's commitments are of one provider session")
        if not verify(session.peer, commitment_bytes(c), c.signature, domain=COMMITMENT_DOMAIN):
            raise JobError("sessions", f"a commitment is not signed by {session.peer}")
    if first.stage not in keys:
        raise JobError("sessions", f"{first.stage!r} is not a provider stage of this model")
    return first.stage


def _covered(session: CommittedSession, tokens: int) -> int:
    """The tokens a session's commitments cover, from the first: chunks 0, 1, ... of CHUNK
    tokens, the last possibly fewer (JobError if they are not that, or run past `tokens`)."""
    numbers = {c.chunk: c.tokens for c in session.commitments}
    total = covered(numbers) if len(numbers) == len(session.commitments) else None
    if total is None:
        raise JobError("sessions", "a session's commitments are chunks 0, 1, ... of 32 tokens")
    if total > tokens:
        raise JobError("sessions", f"commitments to {total} tokens of a {tokens}-token run")
    return total


def _verdict(
    s: CommittedSession, stage: str, ok: bool | None, check: Check, reason: str
) -> SessionVerdict:
    mean = check.mantissa_mean
    return SessionVerdict(
        peer_id=s.peer,
        stage=stage,
        session=s.commitments[0].session,
        chunks=len(s.commitments),
        ok=ok,
        mismatches=check.mismatches,
        mantissa_mean=round(mean, 4) if np.isfinite(mean) else None,
        reason=reason,
    )
