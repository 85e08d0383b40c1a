"""How a batch job is cut into microbatches, and how many of them are kept in flight.

A microbatch crosses a chained route of n provider stages as a pipeline of 2n + 1 stations:
the n + 1 legs (the broker to stage 1, stage to stage, stage n back to the broker) and the n
stage computations. Each station handles one microbatch at a time: a connection sends one
large message at a time and a provider runs one request per compute slot. Once every station
has work the job runs at the pace of its slowest one; `stations + 1` microbatches in flight
keep them fed (one waiting at the slowest).

Filling and draining the pipeline costs about `stations - 1` microbatch-times of the slowest
station, so a job of M microbatches runs at M / (M + stations - 1) of that pace. Over home
links a leg is seconds a microbatch, so a large job cut into few large microbatches spends much
of its time filling and draining. The microbatch chosen is the largest (up to `largest`) that
gives the job at least `PER_STATION` * (stations - 1) microbatches (then M / (M + S - 1) >=
0.9), and no smaller than `SMALLEST`, below which each call's fixed costs (a round trip per
leg, a stage call) outweigh what pipelining gains.

Pure functions: the broker's job runner asks them when a job does not name its microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALLEST = 4  # sequences in a microbatch, at least
PER_STATION = 9  # microbatches per station beyond the first, at least (90 % of the pace)
MOST_IN_FLIGHT = 8  # a provider admits this many requests of one peer by default
# (`provider.config.ProviderConfig.per_peer`): more would be answered busy


@dataclass(frozen=True)
class Cut:
    microbatch: int  # sequences per microbatch
    in_flight: int  # microbatches of the job in the pipeline at once


def stations(stages: int, *, star: bool = False) -> int:
    """Pipeline stations of a route of `stages` provider stages: its legs and its stage
    computations (chained: n + 1 legs; star: each stage's there and back, 2n)."""
    return stages + (2 * stages if star else stages + 1)


def cut(
    sequences: int,
    stages: int,
    *,
    largest: int,
    in_flight: int | None = None,
    star: bool = False,
) -> Cut:
    """The microbatch and in-flight count for a job of `sequences` over `stages` provider
    stages; `largest` caps the microbatch, `in_flight` (when set) overrides the count."""
    if sequences < 1 or stages < 1 or largest < 1:
        raise ValueError("sequences, stages and largest must be >= 1")
    s = stations(stages, star=star)
    wanted = PER_STATION * (s - 1)
    size = max(min(sequences // wanted, largest), min(SMALLEST, largest))
    return Cut(size, in_flight if in_flight is not None else min(s + 1, MOST_IN_FLIGHT))
