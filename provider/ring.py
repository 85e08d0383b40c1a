"""A pre-training replica's ring links over the p2p layer (`dag.collective.Links`), and the
helpers its state transfer uses."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dag.collective import CollectiveError
from p2p import ErrorCode, Host, P2PError, Refused, Tensor
from proto.pretrain import RING, RingChunk
from proto.snapshot import Holder

Array = np.ndarray[Any, Any]
MAX_WAITING = 256  # ring chunks held for a run before its step asks for them
RING_TIMEOUT_S = 120.0
ATTEMPTS, CALLS = 256, 16  # a step's attempts, and all-reduces in one attempt (round ids)
STEP_ROUNDS = ATTEMPTS * CALLS


def round_base(step: int, attempt: int) -> int:
    """The first round id of a step's attempt (its all-reduces take the next ones)."""
    return (step * ATTEMPTS + attempt) * CALLS


class RingLinks:
    """One run's ring links (`dag.collective.Links`): chunks from the previous replica wait
    in boxes by tag until the step asks for them; `fail` wakes every waiting step."""

    def __init__(self, host: Host, job: str) -> None:
        self.host, self.job = host, job
        self.boxes: dict[tuple[int, int, int], asyncio.Future[Array]] = {}
        self.floor = 0  # rounds below this are of an earlier attempt: dropped
        self.failed = ""
        self.next = ""  # the next replica's peer id
        self.sent = 0  # bytes sent

    def reset(self, floor: int, nxt: str) -> None:
        """A step's attempt starts at round `floor`: chunks of earlier attempts and of rounds
        beyond the next step's go."""
        self.floor, self.failed, self.next = floor, "", nxt
        for tag in [t for t in self.boxes if not self._window(t[0])]:
            del self.boxes[tag]

    def _window(self, round_id: int) -> bool:
        """Rounds of this attempt or later, up to the next step's (a neighbour may be a step
        ahead of us: it has started the next step before we heard of it)."""
        return self.floor <= round_id < (self.floor // STEP_ROUNDS + 2) * STEP_ROUNDS

    def _box(self, tag: tuple[int, int, int]) -> asyncio.Future[Array]:
        box = self.boxes.get(tag)
        if box is None:
            if len(self.boxes) >= MAX_WAITING:
                raise Refused(ErrorCode.BUSY, "too many ring chunks are waiting here")
            box = self.boxes[tag] = asyncio.get_running_loop().create_future()
        return box

    def put(self, tag: tuple[int, int, int], data: Array) -> None:
        if tag[0] < self.floor:
            return  # an aborted attempt's chunk
        if not self._window(tag[0]):
            raise Refused(ErrorCode.REFUSED, f"ring round {tag[0]} is not this step's or the next")
        box = self._box(tag)
        if box.done():
            raise Refused(ErrorCode.REFUSED, f"ring chunk {tag} came twice")
        box.set_result(data)

    def fail(self, reason: str) -> None:
        self.failed = reason
        for box in self.boxes.values():
            if not box.done():
                box.set_exception(CollectiveError(reason))

    async def send(self, tag: tuple[int, int, int], data: Array) -> None:
        if self.failed:
            raise CollectiveError(self.failed)
        chunk = RingChunk(
            job=self.job, round=tag[0], phase=tag[1], chunk=tag[2], data=Tensor.from_numpy(data)
        )
        try:
            await self.host.request(self.next, RING, chunk, timeout=RING_TIMEOUT_S)
        except P2PError as exc:
            raise CollectiveError(f"cannot send to replica {self.next[:12]}: {exc}") from None
        self.sent += data.nbytes

    async def recv(self, tag: tuple[int, int, int]) -> Array:
        if self.failed:
            raise CollectiveError(self.failed)
        box = self._box(tag)
        try:
            return await asyncio.wait_for(asyncio.shield(box), RING_TIMEOUT_S)
        except TimeoutError:
            raise CollectiveError(
                f"the previous replica sent nothing for {RING_TIMEOUT_S:.0f} s"
            ) from None
        finally:
            self.boxes.pop(tag, None)


def split_parts(state: dict[str, Array], limit: int) -> list[dict[str, Array]]:
    """`state` in parts of at most `limit` bytes each (an array bigger than that alone)."""
    parts: list[dict[str, Array]] = [{}]
    size = 0
    for name in sorted(state):
        a = state[name]
        if parts[-1] and size + a.nbytes > limit:
            parts.append({})
            size = 0
        parts[-1][name] = a
        size += a.nbytes
    return parts


async def dial(host: Host, holder: Holder) -> None:
    """Be connected to `holder` (by one of its addresses) unless we are already."""
    if host.is_connected(holder.peer):
        return
    errors = []
    for addr in holder.addrs:
        full = addr if "/p2p/" in addr else f"{addr}/p2p/{holder.peer}"
        try:
            await asyncio.wait_for(host.connect(full), 10.0)
            return
        except (P2PError, OSError, TimeoutError) as exc:
            errors.append(f"{addr}: {exc}")
    if holder.addrs:
        raise CollectiveError(f"cannot reach {holder.peer[:12]}: {'; '.join(errors)}")
