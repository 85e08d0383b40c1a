"""A session's signed commitments to its outputs on one stage, made as its steps are answered.

Every `ir.toploc.CHUNK` tokens of a generation session (batch 1), the provider commits to
the hidden states it answered for them (the values as they went on the wire, read back as
float32: what the receiver holds) and to those it was given for them (a commitment of the
same kind, and their SHA-256), and signs that with its peer key
(`proto.session.Commitment`). A verifier that recomputes the stage over the session's tokens
in one pass then tells whether this provider ran the stage it was given on what it was
given, and whether what it was given is what the previous stage committed to sending; the
signature makes the commitment its own.
The last, partial chunk is committed when the session is closed.

A chained hop of a batch microbatch commits too (`hop_commitment`): to the SHA-256 of what it
was given and of what it sent on, and to what it sent on, `proto.forward.BATCH_CHUNK` tokens
of each sequence a commitment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ir.toploc import CHUNK, CommitmentError, Committer, commit_many, sequence_chunks
from proto.forward import BATCH_CHUNK, HopCommitment, hop_commitment_bytes
from proto.session import Commitment, commitment_bytes

Array = np.ndarray[Any, Any]
Sign = Callable[[bytes], bytes]  # the provider's signature over bytes (its commitment domain)


class Ledger:
    """One session's commitments on one stage: rows in, signed commitments out."""

    def __init__(self, session: str, stage: str, sign: Sign) -> None:
        self.session, self.stage, self.sign = session, stage, sign
        self.committer = Committer()
        self.given = Committer()  # of its inputs
        self.chunk = 0  # the chunk being filled
        self.rows = 0  # its rows so far
        self.inputs = hashlib.sha256()  # of its input rows so far
        self.broken = False  # outputs that cannot be committed to (NaN): no more commitments

    def add(self, inputs: Array, outputs: Array) -> list[Commitment]:
        """The next tokens' input and output rows (tokens, hidden), batch row 0; the
        commitments of the chunks they complete."""
        made: list[Commitment] = []
        if self.broken:
            return made
        inputs = np.ascontiguousarray(inputs, dtype=np.float32)
        outputs = np.asarray(outputs, dtype=np.float32)
        start = 0
        while start < len(outputs):
            take = min(CHUNK - self.rows, len(outputs) - start)
            self.inputs.update(inputs[start : start + take].tobytes())
            try:
                done = self.committer.add(outputs[start : start + take])
                given = self.given.add(inputs[start : start + take])
            except CommitmentError:
                self.broken = True
                return made
            self.rows += take
            start += take
            if done:
                made.append(self._signed(given[0], done[0]))
        return made

    def finish(self) -> list[Commitment]:
        """The last, partial chunk's commitment, if it holds any rows."""
        if self.broken or not self.rows:
            return []
        try:
            (data,), (given,) = self.committer.finish(), self.given.finish()
        except CommitmentError:
            return []
        return [self._signed(given, data)]

    def _signed(self, given: bytes, data: bytes) -> Commitment:
        unsigned = Commitment(
            self.session, self.stage, self.chunk, self.rows, self.inputs.digest(), given, data, b""
        )
        self.chunk, self.rows, self.inputs = self.chunk + 1, 0, hashlib.sha256()
        return msgspec.structs.replace(unsigned, signature=self.sign(commitment_bytes(unsigned)))


def hop_commitment(
    chain: str, hop: int, peer: str, stage: str, given: Array, sent: Array, sign: Sign
) -> HopCommitment | None:
    """A chained hop's signed commitment: `given` the hidden states it ran, `sent` those it
    passes on as the next hop (or the broker) receives them (None: outputs that cannot be
    committed to, NaN)."""
    given = np.ascontiguousarray(given, dtype=np.float32)
    sent = np.ascontiguousarray(sent, dtype=np.float32)
    try:
        data = commit_many(sequence_chunks(sent, BATCH_CHUNK))
    except CommitmentError:
        return None
    unsigned = HopCommitment(
        hashlib.sha256(given.tobytes()).digest(), hashlib.sha256(sent.tobytes()).digest(), data, b""
    )
    signed = sign(hop_commitment_bytes(chain, hop, peer, stage, unsigned))
    return msgspec.structs.replace(unsigned, signature=signed)
