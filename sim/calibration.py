"""The simulator's constants from micro-measurements (`fusionai sim calibrate`): a JSON file
of what one run measured on a machine, read back by `fusionai sim --calibration FILE`.

    call_s            software time at one end of a stage call's hop: framing, Noise
                      encryption, dispatch (from round trips of a few bytes between two hosts
                      on loopback: one round trip is two hops, four ends)
    frame_bytes       what the transport adds to a message on the wire (from the small round
                      trips' bytes through a counting proxy, less the messages' size)
    connect_s         a new connection's set-up on loopback (TCP, multistream, Noise, yamux
                      and the dialer's own wait: py-libp2p holds a dial 250 ms)
    connect_rtts      the round trips of that set-up (through a loopback proxy delaying
                      each way 50 and then 100 ms: the difference over the added round trip)
    connect_base_s    and its time beyond them (through the proxy delaying 50 ms: what its
                      round trips do not overlap, the two ends' handshake work)
    protocol_s        what a protocol's first request on a connection waits more than its
                      next, on loopback (py-libp2p negotiates each protocol once)
    protocol_rtts     and its round trips (as `connect_rtts`: two here)
    dead_dial_s       a request to a peer whose process has gone, made as soon as a stream
                      to it broke, until it fails (on loopback)
    link_extra_s      added by `python -m lab link --calibration FILE` (root): what one of
                      the lab's access links adds to each way beyond its configured delay
                      (UDP round trips through it, less its delay and the probes' own time;
                      the lab's predictions add it to each link's delay)
    link_rate_factor  and the rate it carries over its configured rate (TCP transfers up
                      and down it, in frame bytes; the lab's predictions scale each link's)
    wire_s_per_byte   and per byte (encode, encrypt, copy, decode: from round trips of a
                      few MiB, less the small ones')
    stage_call_s      one executor call's fixed time: onnxruntime running a 64 x 64 MatMul
                      on one row, whose arithmetic is negligible
    profile           this machine's measured executor: FLOP/s per dtype, memory bandwidth
                      and memory (the provider daemon's own measurement)
    package           with `--package DIR`: that package's calls timed in-process on one
                      thread: a provider stage's one-token step and its cost per prefill
                      token (`provider.serving`, as providers run it), the client's embedding
                      and head for a token, and the encoded size of a chained step's
                      messages (what lab scenarios are predicted from); and a provider
                      process's CPU per generated token (a real broker and provider on
                      loopback, the provider holding every stage: one hop of four messages;
                      and two providers at once, one holding every stage but one, free and
                      under CPU quotas)

Nothing here is set by hand or fitted to a scenario: each figure is a measurement's median.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from pathlib import Path
from typing import Annotated, Any

import msgspec

from sim.scenario import Scenario

VERSION = 4  # (3: with a provider's CPU per token with its tokens apart, no protocol's first
# request, a dead peer's request after the p2p layer dropped it; 2: two providers measured
# apart from the one, half the stages each)
QUOTA_PROBES = (0.15, 0.3, 0.45)  # CPU quotas (cores) a provider's cost is measured under
Seconds = Annotated[float, msgspec.Meta(ge=0, le=10)]
Positive = Annotated[float, msgspec.Meta(gt=0, le=1e18)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]


class MeasuredProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    executor: str
    flops: dict[str, Positive]  # FLOP/s per dtype
    mem_bandwidth: Positive  # bytes/s
    memory_bytes: Positive


class PackageTimes(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One package's calls, timed in-process on one thread (`calibrate --package`)."""

    model: str
    stage_step_s: Seconds  # a provider stage's one-token decode step (a session's)
    stage_token_s: Seconds  # each further token of a prefill on that stage
    client_step_s: Seconds  # the client's embedding and head for one token
    hidden_bytes_per_token: Annotated[int, msgspec.Meta(gt=0)]  # on the wire between stages
    # a chained step's messages, encoded (one token; the route as long as the package's
    # provider stages): the step each hop gets, with no addresses in its route; what each
    # address a provider announces adds; a hop's answer back and each further hop's part of
    # it; the outputs pushed to the client; the client's acceptance; a step sent the star
    # way (`SessionStep`, one token); a session's opening (`SessionOpen`)
    step_bytes: Bytes
    addr_bytes: Bytes
    answer_bytes: Bytes
    answer_hop_bytes: Bytes
    result_bytes: Bytes
    accepted_bytes: Bytes
    star_bytes: Bytes
    open_bytes: Bytes
    # a provider daemon's CPU seconds per generated token (from the CPU it used in long
    # generations less short ones), holding all `provider_stages` stages of the package (one
    # hop: the step in, its answer, the outputs pushed to the client, the acceptance); two
    # providers' at once, holding `provider_split_stages` of them each (the same four
    # messages each: the step in and its answer, the step on and its answer, or the push and
    # the acceptance); and theirs under each CPU quota of `QUOTA_PROBES` (cores, keyed "0.3")
    # in the lab's slices
    provider_token_cpu_s: Seconds | None = None
    provider_stages: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    provider_split_stages: list[Annotated[int, msgspec.Meta(ge=1, le=4096)]] = []
    provider_split_token_cpu_s: list[Seconds] = []
    provider_split_quota_token_cpu_s: dict[str, list[Seconds]] = {}
    # and the first's CPU per generation beyond its tokens (opening, prompt, closing); the
    # two's, each
    provider_session_cpu_s: Seconds | None = None
    provider_split_session_cpu_s: list[Seconds] = []

    def __post_init__(self) -> None:
        ks, n = self.provider_split_stages, len(self.provider_split_token_cpu_s)
        figures = [n, *(len(v) for v in self.provider_split_quota_token_cpu_s.values())]
        sessions = self.provider_split_session_cpu_s
        if any(f != len(ks) for f in figures) or (sessions and len(sessions) != len(ks)):
            raise ValueError("provider_split_*: one figure for each of provider_split_stages")
        if ks and (len(ks) < 2 or sum(ks) != self.provider_stages):
            raise ValueError("provider_split_stages: two or more providers split provider_stages")
        for quota in self.provider_split_quota_token_cpu_s:
            try:
                ok = 0 < float(quota) < 1
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"provider_split_quota_token_cpu_s: {quota!r} is not a quota")


class Calibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    machine: str
    measured_at: float  # Unix time
    call_s: Seconds
    frame_bytes: Annotated[float, msgspec.Meta(ge=0, le=1 << 20)]  # the transport's per message
    connect_s: Seconds  # a new connection's set-up, on loopback
    wire_s_per_byte: Annotated[float, msgspec.Meta(ge=0, le=1e-3)]
    stage_call_s: Seconds
    small_rtt_s: Seconds  # the medians the two constants come from
    large_rtt_s: Seconds
    large_bytes: Annotated[int, msgspec.Meta(gt=0)]
    samples: int
    profile: MeasuredProfile
    package: PackageTimes | None = None
    # round trips a new connection's set-up takes (beyond the p2p layer's own least time,
    # `connect_s`), and how long a request to a peer that has gone takes to fail once a
    # stream to it broke
    connect_rtts: Annotated[float, msgspec.Meta(ge=0, le=100)] | None = None
    connect_base_s: Seconds = 0.0  # (and the set-up's time beyond those round trips)
    dead_dial_s: Seconds | None = None
    # what a protocol's first request on a connection waits more than its next: on
    # loopback, and its round trips
    protocol_s: Seconds = 0.0
    protocol_rtts: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.0
    # what one of the lab's access links adds to each way beyond its configured delay, and
    # the rate it carries over its configured one (`lab.topology.link_reading`; None: not
    # measured, as without root)
    link_extra_s: Seconds | None = None
    link_rate_factor: Annotated[float, msgspec.Meta(gt=0, le=2)] | None = None

    def provider_costs(self) -> tuple[float, float, dict[float, float], float] | None:
        """As a provider daemon runs them: (a stage's one-token step, a provider's CPU at
        its end of a message, the factor each lab quota measured puts on its CPU (`quota_factor`),
        a stage's session beyond its tokens: its opening, prompt and closing), or None if not
        measured. The first two solve k s + 4 e for the two providers measured together (k
        their stages); where they hold as many, for the one holding every stage, measured
        apart, and their mean. Without the two, each message end costs `call_s`. A stage's
        session is the two's CPU per generation beyond its tokens over the stages (read with
        the rest, and read again with them: `with_split_readings`), else the one's."""
        t = self.package
        if t is None or t.provider_token_cpu_s is None:
            return None
        n, whole = t.provider_stages, t.provider_token_cpu_s
        # (a stage's session: the two's together where measured, read with the rest)
        session = sum(t.provider_split_session_cpu_s or [t.provider_session_cpu_s or 0.0]) / n
        ks, cpus = t.provider_split_stages, t.provider_split_token_cpu_s
        if not cpus:
            return max(0.0, whole - 4 * self.call_s) / n, self.call_s, {}, session
        pairs = list(zip(ks, cpus, strict=True))
        (k, more), (j, less) = max(pairs), min(pairs)
        if k == j:
            (k, more), less = (n, whole), sum(cpus) / len(cpus)
        stage = max(0.0, more - less) / (k - j)
        end = max(0.0, sum(c - i * stage for i, c in pairs) / len(pairs)) / 4
        factors = {  # (the two's CPU together: the one holding more stages weighs more)
            float(q): max(1.0, sum(capped) / sum(cpus))
            for q, capped in t.provider_split_quota_token_cpu_s.items()
            if sum(cpus) > 0
        }
        return stage, end, factors, session

    def apply(self, scenario: Scenario) -> Scenario:
        """`scenario` with the software's costs per hop and per call measured here."""
        return dataclasses.replace(
            scenario,
            call_s=self.call_s,
            wire_s_per_byte=self.wire_s_per_byte,
            stage_call_s=self.stage_call_s,
        )


class _Versioned(msgspec.Struct):
    version: int


def load(path: Path | str) -> Calibration:
    """A calibration file, checked (a clear `ValueError` otherwise)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read calibration {path}: {exc.strerror}") from None
    try:
        version = msgspec.json.decode(raw, type=_Versioned).version
        if version != VERSION:
            raise ValueError(
                f"{path}: calibration version {version}; this reads {VERSION}: run "
                "`fusionai sim calibrate` again"
            )
        return msgspec.json.decode(raw, type=Calibration)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"{path} is not a calibration file: {exc}") from None


def save(calibration: Calibration, path: Path | str) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(calibration)) + b"\n")


def with_link_reading(cal: Calibration, extra_s: float, rate_factor: float) -> Calibration:
    """`cal` with a reading of one of the lab's access links (`python -m lab link`): what it
    adds to each way beyond its configured delay, and the rate it carries over its configured
    one. Refused (ValueError) where out of range."""
    out = msgspec.structs.replace(cal, link_extra_s=extra_s, link_rate_factor=rate_factor)
    try:  # (replace does not validate)
        return msgspec.json.decode(msgspec.json.encode(out), type=Calibration)
    except msgspec.ValidationError as exc:
        raise ValueError(f"a link reading out of range: {exc}") from None


def split_reading(cal: Calibration) -> dict[str, Any]:
    """`cal`'s own reading of its two providers' CPU, as `cli.calibrate_providers.split_costs`
    answers (empty where it has none): what `with_split_readings` takes."""
    t = cal.package
    if t is None or not t.provider_split_token_cpu_s:
        return {}
    return {
        "provider_split_stages": list(t.provider_split_stages),
        "provider_split_token_cpu_s": list(t.provider_split_token_cpu_s),
        "provider_split_quota_token_cpu_s": {
            q: list(v) for q, v in t.provider_split_quota_token_cpu_s.items()
        },
        "provider_split_session_cpu_s": list(t.provider_split_session_cpu_s),
    }


def with_split_readings(cal: Calibration, readings: list[dict[str, Any]]) -> Calibration:
    """`cal` with its two providers' CPU per token (`PackageTimes.provider_split_*`) the
    median of `readings` (each `cli.calibrate_providers.split_costs`'s answer, taken at
    another time: this machine's speed drifts), figure by figure; empty readings (none
    measured) are left out."""
    taken = [r for r in readings if r]
    if cal.package is None or not taken:
        return cal
    splits = {tuple(r["provider_split_stages"]) for r in taken}
    if len(splits) != 1:
        raise ValueError(f"readings of different splits: {sorted(splits)}")

    def median(values: list[list[float]]) -> list[float]:
        return [statistics.median(v) for v in zip(*values, strict=True)]

    quotas = taken[0]["provider_split_quota_token_cpu_s"]
    key = "provider_split_session_cpu_s"  # (readings from before it was read lack it)
    times = msgspec.structs.replace(
        cal.package,
        provider_split_stages=list(taken[0]["provider_split_stages"]),
        provider_split_token_cpu_s=median([r["provider_split_token_cpu_s"] for r in taken]),
        provider_split_quota_token_cpu_s={
            q: median([r["provider_split_quota_token_cpu_s"][q] for r in taken]) for q in quotas
        },
        provider_split_session_cpu_s=median([s for r in taken if (s := r.get(key))]),
    )
    return msgspec.structs.replace(cal, package=times)


def quota_factor(factors: dict[float, float], share: float) -> float:
    """What a quota of `share` cores puts on a provider's CPU: interpolated between the
    quotas measured (`Calibration.provider_costs`), 1 without a quota, the nearest
    measurement's beyond them."""
    if share >= 1 or not factors:
        return 1.0
    points = [*sorted(factors.items()), (1.0, 1.0)]
    if share <= points[0][0]:
        return points[0][1]
    for (q0, f0), (q1, f1) in itertools.pairwise(points):
        if q0 <= share <= q1:
            return f0 + (f1 - f0) * (share - q0) / (q1 - q0)
    return 1.0
