"""Shadow steps of a generation session (`verify=True`): each stage's step runs also on a
second provider holding the stage, and the answers are compared. Disagreeing answers go to
the broker, which probes both; one it quarantines is replaced (history replayed) and the step
run again. Part of `GenerationSession` (`client.session`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from client.errors import VerificationError
from client.replay import Lost, Mismatch, joined
from ir.checks import agree
from p2p import P2PError, RemoteError, RequestTimeout

if TYPE_CHECKING:
    from client.session import GenerationSession, _Stage

log = logging.getLogger("fusionai.client")
Array = np.ndarray[Any, Any]
T = TypeVar("T")


async def checked_step(
    session: GenerationSession, pos: int, stage: _Stage, feeds: dict[str, Array], expect: int
) -> Array:
    """A step run on the stage's provider and, at the same time, on a shadow session on
    a second one. Disagreeing answers go to the broker, which probes the provider; one
    it quarantines is replaced (history replayed) and the step run again."""
    hidden: Array | None = None
    second: Array | None = None
    for _ in range(session.max_attempts):  # (each time: what is not known yet)
        if stage.peer is None:  # known before the shadow picks a provider other than it
            stage.peer = await session.router.pick(pos, set(session.distrusted))
        hidden, second = await asyncio.gather(
            session._step(pos, stage, feeds, expect) if hidden is None else _known(hidden),
            _shadow_step(session, pos, stage, feeds, expect) if second is None else _known(second),
        )
        assert hidden is not None
        if stage.shadow is not None and stage.shadow[0] == stage.peer:
            drop_shadow(session, stage)  # the step failed over onto the checker: check again
            second = None
            continue
        if second is None:
            session.unchecked += 1
            return hidden
        ok, diff = agree(hidden, second, session.rtol, session.atol)
        if ok:
            session.checked += 1
            return hidden
        assert stage.peer is not None and stage.shadow is not None
        peers = (stage.peer, stage.shadow[0])
        why = f"answers for {stage.key} differ by {diff:.3g} between {peers[0]} and {peers[1]}"
        log.warning("session %s: %s", session.id, why)
        wrong = [p for p in peers if await session.router.distrust(pos, stage.key, p, why)]
        if not wrong:
            raise VerificationError(f"{why}, and the broker's probes found neither wrong")
        session.distrusted.update(wrong)
        if peers[0] in wrong:
            session._abandon(stage)
            stage.peer, hidden = None, None
        if peers[1] in wrong:
            drop_shadow(session, stage)
            second = None
    raise VerificationError(f"stage {stage.key}: no two providers agreed")


async def _shadow_step(
    session: GenerationSession, pos: int, stage: _Stage, feeds: dict[str, Array], expect: int
) -> Array | None:
    """The step on the stage's shadow session (opened, with the history replayed, on a
    provider other than the one serving it); None when no one can check it."""
    if stage.shadow is not None and stage.shadow[0] == stage.peer:
        drop_shadow(session, stage)  # the primary moved to it: a check needs another
    try:
        if stage.shadow is None:
            avoid = session.distrusted | ({stage.peer} if stage.peer else set())
            peer = await session.router.checker(pos, avoid)
            if peer is None:
                return None
            stage.opens += 1
            sid = f"{session.id}.{stage.opens}"
            await session._call(peer, session._opening(stage, sid, peer, check=True))
            stage.shadow = (peer, sid)
            if stage.history:
                await session._request(stage, peer, joined(stage.history), sid, past=0)
        peer, sid = stage.shadow
        out = await session._request(stage, peer, feeds, sid)
        hidden = out.outputs.get("hidden_states_out")
        if out.past_len != expect or hidden is None:
            raise Mismatch(f"its shadow session holds {out.past_len}, not {expect}")
        return hidden.to_numpy()
    except (RemoteError, RequestTimeout, P2PError, Lost, Mismatch, ValueError) as exc:
        log.info("session %s: no shadow step for %s (%s)", session.id, stage.key, exc)
        drop_shadow(session, stage)
        return None


def drop_shadow(session: GenerationSession, stage: _Stage) -> None:
    if stage.shadow is not None:
        session.abandoned.append((stage.shadow[0], stage.key, stage.shadow[1]))
        stage.shadow = None


async def _known(value: T) -> T:
    return value
