"""Sending a finished generation to the broker to be checked against its providers'
commitments (`POST /v1/models/{name}/verify`, `broker/commitcheck.py`).

The providers of a generation's stages sign commitments to their outputs as they go
(`client/commitments.py` gathers them). For a sampled share of its generations
(`AsyncClient(verify_share=...)`), the client sends the broker the tokens the generation fed
and those commitments; the broker runs the model over the tokens in one pass and
quarantines a provider whose commitments it does not reproduce. The text has been delivered
by then: a failed check cannot take it back, so the generation's record says so
(`Generation.verified` False, `verdict`) and a `GenerationWarning` is issued. The broker sees
the tokens of the generations sent: a client that must keep them from it sends none (0).
"""

from __future__ import annotations

import logging
import warnings

from client.core import ClientCore
from client.errors import FusionAIError
from client.routing import quote_part
from client.session import GenerationSession
from client.types import Generation
from proto.api.swarm import CommittedSession, SessionVerdict, Verdict, VerifyRequest

log = logging.getLogger("fusionai.client")


class GenerationWarning(UserWarning):
    """A generation's text came from a provider whose work the broker did not reproduce."""


def verify_request(session: GenerationSession) -> VerifyRequest | None:
    """What the broker needs to check a closed `session`: the tokens it fed and each provider
    session's commitments (None: nothing was committed)."""
    sessions = [
        CommittedSession(o.peer, [o.chunks[i] for i in sorted(o.chunks)])
        for _, o in session.commitments.checkable(len(session.fed))
    ]
    if not sessions or not session.fed:
        return None
    return VerifyRequest(tokens=list(session.fed), sessions=sessions)


def with_withheld(
    model: str, session: GenerationSession, verdict: Verdict | None
) -> Verdict | None:
    """`verdict` (the broker's, None: none came) failed for each provider session whose
    commitments cannot all be checked (`Commitments.withheld`): one in use to the end that
    did not commit to every token it held, or one whose chunks are not chunks of this
    generation (those are not sent to the broker, which would refuse the whole request).
    Nothing signed shows the broker what was withheld, so no one is quarantined for it."""
    withheld = [
        SessionVerdict(
            peer_id=o.peer,
            stage=o.stage,
            session=sid,
            chunks=len(o.chunks),
            ok=False,
            mismatches=0,
            mantissa_mean=None,
            reason=why,
        )
        for sid, o, why in session.commitments.withheld(len(session.fed))
    ]
    if not withheld:
        return verdict
    if verdict is None:
        return Verdict(model, False, withheld, [])
    return Verdict(model, False, [*verdict.sessions, *withheld], verdict.quarantined)


def failed_check(model: str, verdict: Verdict) -> str:
    """What a failed check found, in a sentence."""
    wrong = "; ".join(f"{v.peer_id}: {v.reason}" for v in verdict.sessions if v.ok is False)
    caught = f" (quarantined now: {', '.join(verdict.quarantined)})" if verdict.quarantined else ""
    return (
        f"the broker did not reproduce the providers' work on this generation of {model}"
        f"{caught}: {wrong}"
    )


async def verify_generation(
    core: ClientCore, model: str, session: GenerationSession, result: Generation
) -> None:
    """Have the broker check `session`'s commitments; the verdict goes into `result`."""
    body = verify_request(session)
    verdict: Verdict | None = None
    if body is not None:
        try:
            path = f"/v1/models/{quote_part(model)}/verify"
            verdict = await core._call("POST", path, Verdict, body)
        except FusionAIError as exc:
            log.warning("the broker could not check a generation of %s: %s", model, exc)
    verdict = with_withheld(model, session, verdict)
    if verdict is None:
        return
    result.verified, result.verdict = verdict.ok, verdict
    if not verdict.ok:
        warnings.warn(failed_check(model, verdict), GenerationWarning, stacklevel=2)
