"""Checks of chained batch work against the hops' signed commitments.

On a chained route the broker sees the hidden states going in and the result coming out,
not what passes between providers. Each hop signs an account of its work
(`proto.forward.HopCommitment`): the SHA-256 of what it was given and of what it sent on, and
TOPLOC commitments (`ir.toploc`) of what it sent on. The hops' answers carry them back along
the route, through the hops before them. For a chain with a hop due a spot check
(`Verifier.due`: one in 1/fraction of each provider's tasks of each stage, unpredictable to
it), the broker:

- checks each signature against the hop's provider (a bad one may be a provider earlier on
  the route that altered an account it passed back: nobody can be named);
- links the hashes: the first hop's input is what the broker sent, each hop's input is what
  the hop before it says it sent, the last hop's output is what arrived (a break is a
  misreported hand-over between two providers: nothing signed says which one lies);
- runs the route's stages from the start, each fed the previous run's output through the
  package's wire in the stage's own dtype, and compares each hop's commitments with its run
  within the tolerance of the stage's output dtype (`ir.toploc.TOLERANCES`; a commitment that
  is not one, or of another count, mismatches every value): the first hop that differs is
  quarantined (`Verifier.quarantine` redoes its recent work, and the microbatch, which used
  it, is redone).

The run of a hop is asked first of another provider holding the stage (a backup standing by
first, not told whose work it checks; `Verifier.second_opinion`), else made by the broker.
When that provider's answer does not reproduce the hop's commitments, the broker confirms
with its own run before anyone is quarantined, and judges that provider's answer too.

Every hop compared counts as a check of its provider (`result_checked` with `by:
"commitments"`). The chain itself runs unbroken. Where nothing can be judged (an account
missing or unsigned, a broken hash link), the due checks are owed, and the due hops, the hop
without an account and both sides of a broken link run their next due task alone, checked by
a second opinion on an answer the broker sees: an account left out, or a wrong one, escapes no
check. A check that cannot finish (within the route's deadline) is owed too. Checks run one
at a time, in the order the chains ended; the CPU part runs off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import numpy as np

from broker.events import EventLog
from broker.models import ModelStore, StoredModel
from broker.verify import BROKER, Verifier
from ir.checks import agree
from ir.toploc import TOLERANCES, Check, CommitmentError, K, check, sequence_chunks
from p2p import Tensor, verify
from p2p.tensor import encode, through_wire
from proto.forward import BATCH_CHUNK, Forward, HopDone, hop_commitment_bytes
from proto.session import COMMITMENT_DOMAIN

log = logging.getLogger("fusionai.broker")
Array = np.ndarray[Any, Any]


def _sha(array: Array) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).digest()


def compare(ours: Array, chunks: list[bytes]) -> Check:
    """The broker's run of a hop (as sent on) against the hop's commitments, chunk by chunk.
    Commitments of another count, or one that is not a commitment (signed by the hop all the
    same), count as chunks with every value mismatched."""
    parts = sequence_chunks(ours, BATCH_CHUNK)
    if len(parts) != len(chunks):
        return Check(K, 0, 0, len(parts))
    total = Check(0, 0, 0, 0)
    for part, commitment in zip(parts, chunks, strict=True):
        try:
            total += check(part, commitment)
        except CommitmentError:
            total += Check(K, 0, 0)
    return total


class ChainChecks:
    def __init__(self, verifier: Verifier, models: ModelStore, events: EventLog) -> None:
        self.verifier, self.models, self.events = verifier, models, events
        # (stage key, provider): hops of a chain that could not be judged (due, without a
        # valid account, or beside a broken hash link): their next due task runs alone,
        # checked by a second opinion (`broker/embedjobs.py`)
        self.alone: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()  # one check at a time, in the order the chains ended

    async def check(
        self,
        model: str,
        chain: str,
        run: list[tuple[int, str, int]],
        sent: Array,
        mask: Array,
        hops: list[HopDone],
        result: Array,
        numbers: list[int],
    ) -> None:
        """Check the chain `chain` that ran `run` ((stage position, provider, its task number
        if due a check else 0), in order) on the hidden states `sent`, with answers `hops`,
        and whose result here is `result`; `numbers`: every hop's task number (a hop found
        wrong was caught at that one of its tasks of the stage). A check that cannot be
        finished (the broker cannot run a stage, the model went away, it took longer than
        the route's deadline, the job was cancelled) is owed: the due tasks' next ones are."""
        stored = self.models.models.get(model)
        keys = [stored.unit_key(stored.units[pos]) for pos, _, _ in run] if stored else []
        try:
            async with self._lock:  # (one at a time, in the order the chains ended)
                if stored is None:
                    raise KeyError(f"no model {model!r}")
                deadline = self.verifier.config.request_timeout_s * (len(run) + 1)
                judged = self._check(stored, keys, chain, run, (sent, mask, result), hops, numbers)
                await asyncio.wait_for(judged, deadline)
        except BaseException as exc:
            for (_, peer, nth), key in zip(run, keys, strict=False):
                if nth:
                    self.verifier.owe(key, peer)
            if isinstance(exc, Exception):
                log.warning("a check of chain %s could not be finished: %r", chain, exc)
                return
            raise

    async def _check(
        self,
        stored: StoredModel,
        keys: list[str],
        chain: str,
        run: list[tuple[int, str, int]],
        arrays: tuple[Array, Array, Array],
        hops: list[HopDone],
        numbers: list[int],
    ) -> None:
        """`check`'s work: `arrays` are the hidden states sent, the mask and the result."""
        sent, mask, result = arrays
        model = stored.name
        wire = stored.manifest.wire
        started = time.perf_counter()
        route = [(peer, key) for (_, peer, _), key in zip(run, keys, strict=True)]
        if [(h.peer, h.stage) for h in hops] != route:
            return self._skipped(run, keys, "the hops' answers are not the route's")
        accounts = []
        for i, h in enumerate(hops):
            c = h.committed
            if c is None:
                why = f"hop {i} ({h.peer}) committed to nothing"
                return self._skipped(run, keys, why, i)
            signed = hop_commitment_bytes(chain, i, h.peer, h.stage, c)
            if not verify(h.peer, signed, c.signature, domain=COMMITMENT_DOMAIN):
                why = f"hop {i}'s account is not signed by its provider"
                return self._skipped(run, keys, why, i)
            accounts.append(c)
        x = through_wire(sent, wire)  # (fed in its own dtype; hashed and compared as float32)
        ends = await asyncio.to_thread(lambda: (_sha(x), _sha(result)))
        links = [ends[0], *(c.output_sha256 for c in accounts), ends[1]]
        for i, c in enumerate(accounts):
            if c.input_sha256 != links[i]:
                source = "the broker" if i == 0 else f"hop {i - 1}"
                return self._handover(run, keys, i, f"hop {i} was given other than {source} sent")
        if links[-2] != links[-1]:
            return self._handover(run, keys, len(run), "the last hop sent other than arrived")
        last = max(i for i, (_, _, nth) in enumerate(run) if nth)
        for i, (pos, peer, _) in enumerate(run[: last + 1]):
            info = stored.manifest.stages[stored.units[pos]]
            dtype = next(o.dtype for o in info.outputs if o.name == "hidden_states_out")
            tolerance = TOLERANCES.get(dtype, TOLERANCES["float16"])
            wanted = {t.name: t.dtype for t in info.inputs}
            given = (("hidden_states", x), ("attention_mask", mask))
            feeds = {k: np.asarray(v, dtype=wanted[k]) for k, v in given if k in wanted}
            ours, who = await self._recompute(model, pos, keys[i], peer, feeds, wire)
            found = await asyncio.to_thread(compare, ours, accounts[i].chunks)
            if not found.within(tolerance) and who != BROKER:  # confirmed by the broker
                second, theirs, who = who, ours, BROKER
                ours = through_wire(await self.verifier.run_local(model, pos, feeds), wire)
                found = await asyncio.to_thread(compare, ours, accounts[i].chunks)
                self._judge_second(second, theirs, ours, keys[i])
            ok = found.within(tolerance)
            self.verifier.record(peer, ok)
            if who != BROKER:  # (another provider's run reproduced the hop's commitments)
                self.verifier.record(who, True)
            if not ok:
                self.verifier.quarantine(
                    peer,
                    f"its commitments to {keys[i]} differ from the broker's run "
                    f"({found.mismatches} values of a chunk off in sign or exponent, mantissas "
                    f"{found.mantissa_mean:.3g} apart; tolerance {tolerance.mismatches} and "
                    f"{tolerance.mantissa_mean})",
                    numbers[i],
                )
                return
            self.events.emit(
                "result_checked",
                peer=peer,
                stage=keys[i],
                against=who,
                by="commitments",
                mantissa=round(found.mantissa_mean, 4),
                seconds=round(time.perf_counter() - started, 4),
            )
            x = ours

    async def _recompute(
        self, model: str, pos: int, key: str, peer: str, feeds: dict[str, Array], wire: str
    ) -> tuple[Array, str]:
        """Stage `pos` run on `feeds` by another provider holding it (a backup standing by
        first, not told whose work it checks), else by the broker: its output as the next
        hop would receive it, and who ran it."""
        inputs = {
            k: encode(v, wire) if k == "hidden_states" else Tensor.from_numpy(v)
            for k, v in feeds.items()
        }
        made, who = await self.verifier.second_opinion(model, pos, key, peer, Forward(key, inputs))
        return through_wire(made, wire), who

    def _judge_second(self, who: str, theirs: Array, ours: Array, key: str) -> None:
        """The provider `who` that recomputed a hop for the broker, against its own run."""
        config = self.verifier.config
        good, diff = agree(theirs, ours, config.verify_rtol, config.verify_atol)
        self.verifier.record(who, good)
        if not good:
            self.verifier.quarantine(
                who,
                f"its answer for {key} differs from the broker's by {diff:.3g} (tolerance "
                f"{config.verify_atol:g} + {config.verify_rtol:g} x scale)",
                self.verifier.answered_stage.get((who, key), 0),
            )

    def _skipped(
        self,
        run: list[tuple[int, str, int]],
        keys: list[str],
        why: str,
        *suspects: int,
    ) -> None:
        """This chain's hops could not be checked (`why`): each due check is owed, and the
        due hops and the `suspects` (a hop whose account was missing or unsigned, or the two
        sides of a broken hash link) run their provider's next due task of the stage alone,
        for a second opinion, so that no account, or a wrong one, escapes no check."""
        for i, ((_, peer, nth), key) in enumerate(zip(run, keys, strict=True)):
            if nth or i in suspects:
                self.alone.add((key, peer))
                self.verifier.owe(key, peer)
                self.events.emit("check_skipped", peer=peer, stage=key, reason=why)
        log.warning("a chained microbatch could not be checked: %s", why)

    def _handover(
        self, run: list[tuple[int, str, int]], keys: list[str], at: int, why: str
    ) -> None:
        """The hashes of hop `at - 1`'s output and hop `at`'s input differ (the broker's own
        ends: -1 and len(run)): one of the two misreports, and nothing signed says which."""
        before = run[at - 1][1] if at > 0 else BROKER
        after = run[at][1] if at < len(run) else BROKER
        stage = keys[min(at, len(keys) - 1)]
        self.events.emit("handover_misreported", peer=after, to=before, stage=stage, reason=why)
        self._skipped(run, keys, why, at - 1, at)
