"""The signed commitments a generation's providers make to their outputs, gathered as they come.

Each provider session (one stage, one provider, opened by this client) commits to every
`ir.toploc.CHUNK` tokens of its outputs (`proto.session.Commitment`): with its step answers,
along a chain with the last hop's result, and at its close for the last chunk. A commitment
is kept only if it names a session this client opened on that stage and is signed by the
provider it was opened on; a step answered again sends its commitments again, kept once.
`checkable()` is what a verifier takes (`POST /v1/verify`), with the session's tokens.
A session in use to the end must commit to every token it held, and every session's chunks
must be chunks of the generation (`withheld()`): a provider that sends no commitments, not
all, or malformed ones would otherwise escape the check on what it left out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ir.toploc import CHUNK
from ir.toploc import covered as chunks_cover
from p2p import verify
from proto.session import COMMITMENT_DOMAIN, Commitment, commitment_bytes

log = logging.getLogger("fusionai.client")


@dataclass
class Opened:
    peer: str
    stage: str
    chunks: dict[int, Commitment] = field(default_factory=dict)
    held: int = 0  # tokens it held when the generation ended (0: given up on before)
    answered: bool = True  # its close was answered (the close brings the chunks not yet sent)

    @property
    def covered(self) -> int | None:
        """Tokens its commitments cover, from the first; None when they are not what the
        broker takes (`broker.commitcheck`): chunks 0, 1, ... of `CHUNK` tokens, the last
        possibly fewer, no more than it held."""
        tokens = chunks_cover({n: c.tokens for n, c in self.chunks.items()})
        return None if tokens is None or (self.held and tokens > self.held) else tokens


class Commitments:
    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], Opened] = {}  # (session id, stage) -> where,
        # and its chunks (a session id names one session per stage)
        self.refused = 0  # commitments not kept: unsigned, forged, or for a stranger's session

    def opened(self, sid: str, peer: str, stage: str) -> None:
        """Session `sid` of `stage` is open on `peer`: its commitments are expected."""
        self.sessions.setdefault((sid, stage), Opened(peer, stage))

    def add(self, commitments: Iterable[Commitment]) -> None:
        for c in commitments:
            opened = self.sessions.get((c.session, c.stage))
            signed = commitment_bytes(c)
            if (
                opened is None
                or c.chunk < 0
                or not verify(opened.peer, signed, c.signature, domain=COMMITMENT_DOMAIN)
            ):
                self.refused += 1
                log.warning("a commitment for session %s was refused", c.session)
                continue
            opened.chunks.setdefault(c.chunk, c)

    def ended(self, sid: str, stage: str, held: int) -> None:
        """Session `sid` of `stage` was in use to the end, holding `held` tokens: its
        commitments (the close brings the last) are to cover them all."""
        opened = self.sessions.get((sid, stage))
        if opened is not None:
            opened.held = held

    def unanswered(self, sid: str, stage: str) -> None:
        """The close of session `sid` of `stage` was not answered."""
        opened = self.sessions.get((sid, stage))
        if opened is not None:
            opened.answered = False

    def withheld(self, fed: int) -> list[tuple[str, Opened, str]]:
        """(session id, where and what, why) of the sessions whose commitments cannot all be
        checked, for a generation that fed `fed` tokens: those in use to the end that do not
        cover every token they held, and any whose chunks are not chunks of it."""
        out = []
        for (sid, _), o in self.sessions.items():
            tokens = o.covered
            if tokens is None or tokens > fed:
                why = f"its commitments are not chunks 0, 1, ... of {CHUNK} of the {fed} tokens"
            elif tokens < o.held:
                why = f"it committed to {tokens} of the {o.held} tokens it held"
                if not o.answered:
                    why += " (its session's close, which brings the last, was not answered)"
            else:
                continue
            out.append((sid, o, f"{why}: what it computed cannot all be checked"))
        return out

    def checkable(self, fed: int) -> list[tuple[str, Opened]]:
        """(session id, where and what) of the sessions that committed to something the
        broker can check, in the order they were opened."""
        return [
            (sid, o)
            for (sid, _), o in self.sessions.items()
            if o.chunks and (tokens := o.covered) is not None and tokens <= fed
        ]
