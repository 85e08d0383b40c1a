"""The hardware check at join: trust measured hardware, not claimed.

A joining provider's profile claims FLOP/s; before the join is accepted the broker puts it a
check sized from that claim (`ir.challenge.sized`: about `check_s` seconds of matmul rounds
at the claimed speed, bounded in rows and rounds), over `/fusionai/challenge/1`: the provider
runs it with its own executor and commits to its answer; the broker times that exchange less
the round trip it measured just before (a ping), then takes the answer and recomputes
`CHECK_ROWS` rows of its choosing. A wrong answer, or none within the window and its slack,
refuses the join. A claim above `claim_factor` times what the check showed is capped there:
every speed figure of the profile (FLOP/s per dtype, memory bandwidth) is scaled down alike.

What it costs: at most `CONCURRENT` checks at once; the broker's own share is at most about
0.1 s of numpy per check (`CHECK_ROWS` rows through at most `MAX_ROUNDS` rounds, in a worker
thread; milliseconds for a CPU's claim); the provider's, about `check_s` seconds if its claim
is true and at most the window (plus one round) if not, in about 300 MB at most (freed once
the join is answered). The same provider process joining again with the same claim (a missed
heartbeat) is not checked again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from broker.config import BrokerConfig
from dag.cost import HardwareProfile
from ir.challenge import CHECK_ROWS, Work, sized, wrong_rows
from p2p import P2PError, RemoteError, RequestTimeout
from proto.challenge import CHALLENGE, MAX_WINDOW_S, Challenge, Committed, Reveal, Revealed
from proto.ping import PING, Ping

CONCURRENT = 2  # checks run at once; more joins wait their turn
SLACK_S = 10.0  # beyond the window, how long an answer may take (one round past it)
REMEMBERED = 4096  # providers whose last check is kept (to skip re-checking a re-join)

Request = Callable[..., Awaitable[Any]]  # `Host.request(peer, spec, message, timeout=...)`


class CheckFailed(Exception):
    """The provider failed its hardware check; the message says why and what to do."""


@dataclass(frozen=True)
class Checked:
    claimed: float  # float32 FLOP/s the profile claims for its executor
    shown: float  # float32 FLOP/s the check showed
    scale: float  # the profile's speed figures were multiplied by this (1: believed)
    rounds: int  # rounds of the check the provider finished
    seconds: float  # the timed exchange, less the round trip

    @property
    def capped(self) -> bool:
        return self.scale < 1.0


def claimed_flops(hw: HardwareProfile) -> float:
    """The figure the check is about: float32 FLOP/s (the best figure if none is given)."""
    return float(hw.flops.get("float32") or max(hw.flops.values(), default=0.0))


def capped(hw: HardwareProfile, scale: float) -> HardwareProfile:
    """`hw` with every speed figure multiplied by `scale` (at most 1)."""
    if scale >= 1.0:
        return hw
    return dataclasses.replace(
        hw,
        flops={k: v * scale for k, v in hw.flops.items()},
        mem_bandwidth=max(1.0, hw.mem_bandwidth * scale),
    )


class HardwareChecks:
    """`request`: the broker host's `request`; `rng`: seeds and the rows checked (a
    provider must not guess them); `clock`: seconds, for timing the exchange."""

    def __init__(
        self,
        config: BrokerConfig,
        request: Request,
        rng: random.Random,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.request = request
        self.rng = rng
        self.clock = clock
        self._slots = asyncio.Semaphore(CONCURRENT)
        # peer -> (its process's boot id, the speed figures it claimed, its check)
        self._known: OrderedDict[str, tuple[str, tuple[Any, ...], Checked]] = OrderedDict()

    @property
    def window_s(self) -> float:
        """How long a provider may compute: long enough to show 1 / `claim_factor` of its
        claim twice over, at least a second."""
        return min(MAX_WINDOW_S, max(1.0, 2 * self.config.claim_factor * self.config.check_s))

    async def check(
        self, peer: str, hw: HardwareProfile, boot: str
    ) -> tuple[HardwareProfile, Checked]:
        """`hw` as far as the check bears it out (capped), and the check's account; raises
        `CheckFailed` saying why the join is refused."""
        claim = (sorted(hw.flops.items()), hw.mem_bandwidth)
        known = self._known.get(peer)
        if known is not None and boot and known[:2] == (boot, claim):
            return capped(hw, known[2].scale), known[2]  # the same process, the same claim
        claimed = claimed_flops(hw)
        work = sized(claimed, self.config.check_s, self.rng.randbytes(16))
        async with self._slots:
            checked = await self._run(peer, work, claimed)
        self._known[peer] = (boot, claim, checked)
        self._known.move_to_end(peer)
        while len(self._known) > REMEMBERED:
            self._known.popitem(last=False)
        return capped(hw, checked.scale), checked

    async def _run(self, peer: str, work: Work, claimed: float) -> Checked:
        window = self.window_s
        ask = Challenge(
            seed=work.seed, rows=work.rows, rounds=work.rounds, width=work.width, window_s=window
        )
        try:
            rtt = await self._rtt(peer)
            start = self.clock()
            committed = await self.request(peer, CHALLENGE, ask, timeout=window + SLACK_S)
            elapsed = self.clock() - start
            revealed = await self.request(peer, CHALLENGE, Reveal(seed=work.seed), timeout=30.0)
        except RequestTimeout:
            raise CheckFailed(
                f"the hardware check took longer than {window + SLACK_S:.0f} s, though the "
                f"profile's {claimed / 1e9:.0f} GFLOP/s would do it in {self.config.check_s} s: "
                "measure again (fusionai provider start --reprofile) on a machine not busy "
                "with other work"
            ) from None
        except RemoteError as exc:
            raise CheckFailed(
                f"the provider did not take the broker's hardware check ({exc.code}: "
                f"{exc.message}): update fusionai on it"
            ) from None
        except P2PError as exc:
            raise CheckFailed(f"the hardware check could not reach the provider: {exc}") from None
        if not isinstance(committed, Committed) or not isinstance(revealed, Revealed):
            raise CheckFailed("the provider answered the hardware check out of turn")
        if hashlib.sha256(revealed.answer).digest() != committed.digest:
            raise CheckFailed("the hardware check's answer differs from what it committed to")
        rows = sorted(self.rng.sample(range(work.rows), min(CHECK_ROWS, work.rows)))
        wrong = await asyncio.to_thread(wrong_rows, work, committed.rounds, revealed.answer, rows)
        if wrong:
            raise CheckFailed(
                f"the hardware check's answer is wrong (row {wrong[0]} of {work.rows} after "
                f"{committed.rounds} rounds): this machine's executor computes wrong results; "
                "check its drivers and run fusionai provider start --reprofile"
            )
        busy = max(elapsed - rtt, elapsed / 2)  # a round trip cannot take more than half
        shown = work.flops(committed.rounds) / max(busy, 1e-6)
        scale = min(1.0, self.config.claim_factor * shown / claimed) if claimed > 0 else 1.0
        return Checked(claimed, shown, scale, committed.rounds, busy)

    async def _rtt(self, peer: str) -> float:
        """The round trip to `peer` now: the best of two pings."""
        best = float("inf")
        for nonce in range(2):
            start = self.clock()
            await self.request(peer, PING, Ping(nonce=nonce), timeout=10.0)
            best = min(best, self.clock() - start)
        return best
