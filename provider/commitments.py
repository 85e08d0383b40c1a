"""A session's signed commitments to its outputs on one stage, made as its steps come.

Every `ir.toploc.CHUNK` tokens of a generation session (batch 1), the provider commits to
the hidden states it answered for them (the values as they went on the wire, read back as
float32: what the receiver holds) and to those it was given for them (a commitment of the
same kind, and their SHA-256), and signs that with its peer key
(`proto.session.Commitment`). A verifier that recomputes the stage over the session's tokens
in one pass then tells whether this provider ran the stage it was given on what it was
given, and whether what it was given is what the previous stage committed to sending; the
signature makes the commitment its own.
A chunk's commitment is worked out in the process's commitment thread (`worker()`), off the
step's path; each answer carries those finished since the one before, and the close the rest
(the last, partial chunk's included).

A chained hop of a batch microbatch commits too (`hop_commitment`): to the SHA-256 of what it
was given and of what it sent on, and to what it sent on, `proto.forward.BATCH_CHUNK` tokens
of each sequence a commitment.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from ir.toploc import CHUNK, CommitmentError, commit_many, sequence_chunks
from proto.forward import BATCH_CHUNK, HopCommitment, hop_commitment_bytes
from proto.session import Commitment, commitment_bytes

Array = np.ndarray[Any, Any]
log = logging.getLogger("fusionai.provider")
Sign = Callable[[bytes], bytes]  # the provider's signature over bytes (its commitment domain)
Job = tuple[int, int, list[Array], list[Array]]  # a chunk: number, tokens, input, output rows


class Ledger:
    """One session's commitments on one stage: rows in, signed commitments out.

    A chunk's commitment is worked out off the step's path: in `defer`'s worker when one is
    given (the provider's: `worker()`), while the session's next tokens travel through the
    other stages; each answer then carries the commitments finished since the one before,
    and the close the rest, working out itself those still waiting. Without `defer` (or
    with `MAX_QUEUED` chunks waiting already), a chunk's commitment comes with the answer
    that completes it."""

    def __init__(self, session: str, stage: str, sign: Sign, defer: Executor | None = None) -> None:
        self.session, self.stage, self.sign, self.defer = session, stage, sign, defer
        self.chunk = 0  # the chunk being filled
        self.outputs: list[Array] = []  # its rows so far
        self.given: list[Array] = []
        self.rows = 0
        self.pending: list[tuple[Future[Commitment | None], Job]] = []  # chunks being
        # committed, in order
        self.broken = False  # outputs that cannot be committed to (NaN): no more commitments

    def add(self, inputs: Array, outputs: Array) -> list[Commitment]:
        """The next tokens' input and output rows (tokens, hidden), batch row 0; the
        commitments finished since the last call."""
        inputs = np.array(inputs, dtype=np.float32, order="C")  # (copies: kept until their
        outputs = np.array(outputs, dtype=np.float32, order="C")  # chunk is committed)
        start = 0
        while start < len(outputs) and not self.broken:
            take = min(CHUNK - self.rows, len(outputs) - start)
            self.given.append(inputs[start : start + take])
            self.outputs.append(outputs[start : start + take])
            self.rows += take
            start += take
            if self.rows == CHUNK:
                self._close()
        return self._finished(wait=False)

    def finish(self) -> list[Commitment]:
        """Every commitment not yet handed out, the last, partial chunk's included (those
        still waiting for the commitment thread worked out here, not behind other sessions')."""
        if self.rows and not self.broken:
            self._close()
        return self._finished(wait=True)

    def cancel(self) -> None:
        """The session is gone: its chunks waiting for the commitment thread are not worked
        out there. Safe from any thread, without the session's lock (the list is only read)."""
        for future, _ in list(self.pending):
            future.cancel()

    def _close(self) -> None:
        job = (self.chunk, self.rows, self.given, self.outputs)
        self.chunk, self.rows, self.given, self.outputs = self.chunk + 1, 0, [], []
        future: Future[Commitment | None] | None = None
        if self.defer is not None:
            future = _submit(self.defer, self._signed, job)
        if future is None:  # (on the step's path: no thread, or its queue is full)
            future = Future()
            future.set_result(self._signed(*job))
        self.pending.append((future, job))

    def _finished(self, wait: bool) -> list[Commitment]:
        made: list[Commitment] = []
        while self.pending and (wait or self.pending[0][0].done()):
            future, job = self.pending.pop(0)
            done = self._signed(*job) if future.cancel() else future.result()
            if done is None:  # (NaN in a chunk: none from it on)
                self.broken = True
                self.cancel()
                self.pending.clear()
            else:
                made.append(done)
        return made

    def _signed(
        self, chunk: int, rows: int, given: list[Array], outputs: list[Array]
    ) -> Commitment | None:
        given_rows = np.concatenate(given)
        try:
            data, input_data = commit_many([np.concatenate(outputs), given_rows])  # (one pass)
            digest = hashlib.sha256(given_rows.tobytes()).digest()
            unsigned = Commitment(
                self.session, self.stage, chunk, rows, digest, input_data, data, b""
            )
            signature = self.sign(commitment_bytes(unsigned))
        except CommitmentError:
            return None
        except Exception:  # (signing failed: no commitment can be made, none is claimed)
            log.exception(
                "session %s: chunk %d of %s not committed", self.session, chunk, self.stage
            )
            return None
        return msgspec.structs.replace(unsigned, signature=signature)


MAX_QUEUED = 256  # chunks waiting for (or in) the commitment thread, beyond which they are worked
# out on the step's path (each holds its rows: 2 x 32 x hidden floats)
_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()
_queued = 0


def worker() -> Executor:
    """The process's one thread that works out sessions' commitments, shared by all its
    sessions (made on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(1, thread_name_prefix="commitments")
        return _worker


def _submit(
    executor: Executor, fn: Callable[..., Commitment | None], job: Job
) -> Future[Commitment | None] | None:
    """`fn(*job)` in `executor`, unless `MAX_QUEUED` chunks are waiting or running already
    (None)."""
    global _queued
    with _worker_lock:
        if _queued >= MAX_QUEUED:
            return None
        _queued += 1
    future = executor.submit(fn, *job)
    future.add_done_callback(_counted_off)  # (run, or cancelled)
    return future


def _counted_off(_: Future[Commitment | None]) -> None:
    global _queued
    with _worker_lock:
        _queued -= 1


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
