"""`/fusionai/challenge/1`: the broker checks a joining provider's hardware (broker asks).

While a join is being decided, the broker sends a `Challenge` sized from the FLOP/s the
provider claims (`ir.challenge`: rounds of a sign-step matmul from `seed`); the provider runs
it with the executor it serves stages with, on its device, and answers `Committed`: how many
rounds it finished before `window_s` ran out, and the SHA-256 of its answer. The broker times
that exchange. Then it asks `Reveal` for the answer itself (untimed), checks it against the
commitment, and recomputes a few rows of its own choosing: a wrong answer refuses the join,
and claims far above what the check showed are capped. A provider answers only its broker.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from p2p.codec import Message, ProtocolSpec

MAX_WINDOW_S = 10.0  # the longest window a broker may ask for; seconds
Seed = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


class Challenge(Message, frozen=True, tag="Challenge/1"):
    seed: Seed  # fresh random bytes: every matrix of the check is derived from them
    rows: Annotated[int, msgspec.Meta(ge=1, le=8192)]
    rounds: Annotated[int, msgspec.Meta(ge=1, le=1024)]  # at most this many rounds
    width: Annotated[int, msgspec.Meta(ge=1, le=512)]  # the matrices' width (`ir.challenge`)
    window_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_WINDOW_S)]  # start no round after


class Committed(Message, frozen=True, tag="Committed/1"):
    rounds: int  # rounds finished (the answer is theirs)
    digest: bytes  # SHA-256 of the answer: one little-endian int16 per row


class Reveal(Message, frozen=True, tag="Reveal/1"):
    seed: Seed  # the challenge whose answer to send


class Revealed(Message, frozen=True, tag="Revealed/1"):
    answer: bytes  # one little-endian int16 per row


CHALLENGE = ProtocolSpec(
    "/fusionai/challenge/1", request=(Challenge, Reveal), response=(Committed, Revealed)
)
