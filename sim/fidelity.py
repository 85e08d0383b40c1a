"""The simulator's model of a lab scenario (`sim.labscenario`): what `python -m lab scenario`
will measure, from the calibration's micro-measurements and nothing else (`sim.labpredict`
runs a session's timeline over it).

Placement: the broker's decision core's, on the profiles the broker would see
(`sim.labplace`).

A token (decode step) goes as the client library sends it when a session runs alone on its
client: chained, client -> stage 1 -> ... -> stage n -> client (`client.chained`). Its
messages are the calibrated encodings of the real ones (the step with its signed route, each
hop's answer back, the outputs pushed to the client); on a link each costs the transport's
measured framing and TCP/IP's headers per segment, and an acknowledgement comes back. A
network hop costs both access links' one-way delays, the bytes over the slower link, and the
software's time at both ends (at a provider, a message end as provider daemons were measured
to spend it, `Calibration.provider_costs`; at the client `call_s`; both plus bytes x
`wire_s_per_byte`); each stage a daemon's measured one-token step. A provider's CPU under a
quota costs the factor measured for it, and its part of a token runs at the quota's pace: the
first slice (`QUOTA_SLICE_S`) at full speed, the rest at its share (measured with busy loops:
8 ms of work took 23.3 ms at 0.3 of a core and 43.4 ms at 0.15). Nothing is added for a
provider that waited before a token: the calibration's readings come from a running pipeline,
each provider waiting for the other before each of its tokens, so that cost is in them (a
reading of one provider with its tokens 40 ms apart on an otherwise quiet machine put 0.6 to
1.9 ms more on each token, which the lab's providers did not spend: in the latency scenario,
tokens 140 ms apart, 3.9 to 5.3 ms a token with their sessions' openings and prompts, where
the readings predict 3.8 to 4.6 without it and 5.5 to 6.0 with it). Sessions at once: exact
mean-value analysis of the closed network they form (each client one session; each provider's
CPU, at its quota's pace, and each access link's way up and down a queue; the rest pure delay,
with the time each stage step waits for the other sessions to join its batch, `Model.gather`;
a link shares itself among its transfers, a CPU serves one at a time: `Model.mva`).

The first token: the library's first step opens each stage in turn (ask the broker which
provider, open a session there, send the prompt's hidden states and wait for them back), then
the head. A link is shared by the transfers on it (TCP's flows: processor sharing), a
provider's CPU runs its requests one at a time (first come, first served): among running
sessions the prompt's transfers are stretched by the others' on each link and its work waits
for each CPU's queue; sessions that start together share a bottleneck link to the end (all
finish when it has carried every first step) or queue at a bottleneck CPU. A failover stall (a
provider killed mid-generation): see `Model.stall`; the tokens after it take the route with
the victim's stages on their backups, and the first chained step connects the providers new
to each other.
"""

from __future__ import annotations

import itertools
import math

from sim.calibration import Calibration, PackageTimes, quota_factor
from sim.labplace import Placed, paced, split
from sim.labscenario import LabScenario

CLIENT = "client"
# What the links' shapers count, by the protocols' definitions: a packet is at most the
# Ethernet MTU; TCP carries at most MTU - 52 bytes in it (IPv4 20, TCP 20 with its 12 of
# timestamps); each packet adds those 52 and Ethernet's 14; each message is answered by an
# acknowledgement the other way, a packet of headers only.
PACKET_BYTES = 1500
SEGMENT_BYTES = PACKET_BYTES - 52
HEADER_BYTES = 52 + 14
# The addresses a provider announces (`provider.membership`): its LAN one, and behind a
# router the public one it got there (a UPnP mapping, a relay port); its chained steps'
# routes carry them, without its peer id or its loopback one (`proto.session.hop_addrs`).
ANNOUNCED = 2
# A promotion (`proto` `Promote`: a stage's key) and its answer: some 64 bytes each, whose
# time on the wire is negligible beside a message end's.
PROMOTE_BYTES = 64


class Model:
    """The scenario's network and software costs, for one placement."""

    def __init__(self, s: LabScenario, cal: Calibration, placed: list[Placed]) -> None:
        if cal.package is None:
            raise ValueError("the calibration has no package timings: run `fusionai sim "
                             "calibrate --package DIR` with the scenario's package")  # fmt: skip
        self.s, self.cal, self.placed = s, cal, placed
        self.t: PackageTimes = cal.package
        self.providers = {p.name: p for p in s.lab.provider}
        # a stage's step and a message's end as a provider daemon runs them, and what a
        # quota adds to its CPU, where measured (else the in-process step and `call_s`)
        costs = cal.provider_costs() or (self.t.stage_step_s, cal.call_s, {}, 0.0)
        self.stage_s, self.provider_end_s, self.quota_factors, self.session_s = costs

    # ---- the parts -------------------------------------------------------------------------

    def delay(self, x: str) -> float:
        """One way through `x`'s access link: its configured delay, and what the lab's links
        were measured to add to it (`Calibration.link_extra_s`)."""
        link = self.s.lab.client if x == CLIENT else self.providers[x].link
        return link.delay_ms / 1e3 + (self.cal.link_extra_s or 0.0)

    def rate(self, x: str) -> float:
        """`x`'s access link's rate, bytes a second: its configured one, as far as the lab's
        links were measured to carry it (`Calibration.link_rate_factor`)."""
        link = self.s.lab.client if x == CLIENT else self.providers[x].link
        return link.bytes_s * (self.cal.link_rate_factor or 1.0)

    def share(self, x: str) -> float:
        """The cores `x` may use: a provider's quota (the client's machine is not capped)."""
        return 1.0 if x == CLIENT else min(self.providers[x].cpu, 1.0)

    def stretch(self, x: str, work: float) -> float:
        """The wall time of `work` seconds of CPU run at once on `x`: a provider's quota
        lets the first slice run at full speed, the rest at its share."""
        return work if x == CLIENT else paced(work, self.share(x))

    def on_link(self, nbytes: float) -> float:
        """The bytes a message of `nbytes` puts on a link: the transport's framing, then
        TCP's segments' headers."""
        wire = nbytes + self.cal.frame_bytes
        return wire + math.ceil(wire / SEGMENT_BYTES) * HEADER_BYTES

    def cpu(self, x: str, seconds: float) -> float:
        """CPU seconds `x` spends on what takes `seconds` on a provider without a quota."""
        return seconds if x == CLIENT else seconds * quota_factor(self.quota_factors, self.share(x))

    def stage(self, x: str) -> float:
        """`x`'s CPU for one stage's one-token step."""
        return self.cpu(x, self.stage_s)

    def end(self, x: str, nbytes: float) -> float:
        """`x`'s CPU time to send or receive a message (at the calibrated machine's speed)."""
        fixed = self.cal.call_s if x == CLIENT else self.provider_end_s
        return self.cpu(x, fixed + nbytes * self.cal.wire_s_per_byte)

    def hop(self, a: str, b: str, nbytes: float) -> float:
        """One message from `a` to `b` (each a provider or the client) over the Internet."""
        if a == b:
            return 0.0
        # out of a's home, then into b's: packets pipeline through the two shapers
        size = self.on_link(nbytes)
        slow, fast = sorted((self.rate(a), self.rate(b)))
        wire = size / slow + min(size, PACKET_BYTES) / fast
        return self.delay(a) + self.delay(b) + wire + self.end(a, nbytes) + self.end(b, nbytes)

    def rtt(self, a: str, b: str, there: float, back: float) -> float:
        return self.hop(a, b, there) + self.hop(b, a, back)

    def to_broker(self, x: str) -> float:
        """A small message between `x` and the broker, one way: the broker is on the
        Internet (no access link of its own), the connection open."""
        return self.delay(x) + self.cal.call_s

    def broker_rtt(self) -> float:
        """A small request to the broker and its answer (HTTP, the connection open)."""
        return 2 * self.to_broker(CLIENT)

    # ---- a token ---------------------------------------------------------------------------

    def route(self) -> list[tuple[str, int]]:
        """The chain's providers in order, each with how many stages it runs in a row."""
        return list(split(self.placed))

    def pairs(self) -> list[tuple[str, str]]:
        """The providers next to each other on the chain (each sends the step to the next)."""
        route = [x for x, _ in self.route()]
        return list(itertools.pairwise(route))

    def rechain(self, before: Model) -> float:
        """What the first chained step on this route takes more than the next, after steps
        on `before`'s: each pair of providers new to each other on it connects (the sender
        asks its peer for a punch too, a round trip) and negotiates the chain's protocol;
        a new first hop's chain protocol from the client, and a new last hop's push of the
        outputs to the client, are each a protocol's first request (`first_use`)."""
        new = set(self.pairs()) - set(before.pairs())
        out = sum(self.connect(a, b) + self.rtt(a, b, 64, 64) + self.first_use(a, b)
                  for a, b in new)  # fmt: skip
        first, last = self.route()[0][0], self.route()[-1][0]
        if first != before.route()[0][0]:
            out += self.first_use(CLIENT, first)
        if last != before.route()[-1][0]:
            out += self.first_use(last, CLIENT)
        return out

    def messages(self) -> list[tuple[str, str, float, bool]]:
        """A chained step's messages: (from, to, bytes, on the token's path). The step goes
        along the route, the last hop pushes the outputs to the client, each hop's answer
        (with its and the later hops' records) goes back to its sender, the client accepts."""
        t, route = self.t, self.route()
        step = t.step_bytes + t.addr_bytes * ANNOUNCED * len(self.placed)
        out: list[tuple[str, str, float, bool]] = []
        senders = [CLIENT, *(x for x, _ in route)]
        for i, (x, _) in enumerate(route):
            out.append((senders[i], x, step, True))
            later = sum(n for _, n in route[i:])
            out.append((x, senders[i], t.answer_bytes + (later - 1) * t.answer_hop_bytes, False))
        out.append((route[-1][0], CLIENT, t.result_bytes, True))
        out.append((CLIENT, route[-1][0], t.accepted_bytes, False))
        return out

    def acked_alone(self) -> list[bool]:
        """For each of `messages()`: whether its receiver acknowledges it in a segment of its
        own. TCP delays an acknowledgement (Linux: 40 ms at least) to carry it on the next
        data back, and a reply sent at once carries it: the client's acceptance of the
        outputs, and where one provider holds the whole route, its push of the outputs and
        its answer to the acceptance. The rest wait for the chain's other hops or for the next
        token (an answer), and go alone."""
        route = self.route()
        alone = len(route) > 1
        out = []
        for i in range(len(route)):
            out += [alone or i + 1 < len(route), True]  # the step to hop i, its answer
        return [*out, False, alone]  # the push of the outputs, the client's acceptance

    def token_alone(self) -> float:
        """One decode step of a session alone on the swarm: the chained trip, each
        provider's part of it (its stages, its ends of the step's messages) at its quota."""
        path = [(a, b, n) for a, b, n, on in self.messages() if on]
        trips = sum(self.hop(a, b, n) for a, b, n in path)
        work = {x: k * self.stage(x) for x, k in self.route()}
        for a, b, n in path:
            for x in (a, b):
                if x != CLIENT:
                    work[x] += self.end(x, n)
        slowed = sum(self.stretch(x, w) - w for x, w in work.items())
        stages = sum(self.stage(p.provider) for p in self.placed)
        return self.t.client_step_s + stages + trips + slowed

    def demands(self) -> dict[str, float]:
        """Seconds per token each queue serves: each provider's CPU (its stage steps and its
        ends of messages) and each access link's way up and down (the bytes it carries, and
        the acknowledgements coming back)."""
        out: dict[str, float] = {}

        def add(key: str, seconds: float) -> None:
            out[key] = out.get(key, 0.0) + seconds

        for p in self.placed:
            add(p.provider, self.stage(p.provider))
        for (a, b, n, _), alone in zip(self.messages(), self.acked_alone(), strict=True):
            for x in (a, b):
                if x != CLIENT:
                    add(x, self.end(x, n))
            add(f"up:{a}", self.on_link(n) / self.rate(a))
            add(f"down:{b}", self.on_link(n) / self.rate(b))
            if alone:  # (else it rides the reply)
                add(f"up:{b}", HEADER_BYTES / self.rate(b))
                add(f"down:{a}", HEADER_BYTES / self.rate(a))
        # a provider serves its CPU demand at its quota's pace
        return {k: self.stretch(k, d) if k in self.providers else d for k, d in out.items()}

    def gather(self, sessions: int, period: float) -> float:
        """What a token's stage steps wait for each other's sessions (`provider.batching`): a
        step that finds no run gathering leads one and waits the window for the stage's
        other recently active sessions; those arriving in it (each of the others with the
        window's share of its token's period) join it and wait the rest, half on average."""
        if sessions <= 1:
            return 0.0
        window = self.s.lab.batch_window_ms / 1e3
        joining = (sessions - 1) * min(1.0, window / period)
        return len(self.placed) * (window + joining * window / 2) / (1 + joining)

    def mva(self, sessions: int) -> tuple[float, dict[str, float], dict[str, float]]:
        """Mean-value analysis of `sessions` closed loops: (tokens per second of all, the
        mean queue at each queue, each CPU's utilisation); the batches' gathering a delay at
        each population. A link shares itself among its transfers (processor sharing:
        exact). A provider's CPU serves one request at a time, each about as long as the last
        (first come, first served, constant service): one arriving while another is served
        waits for the rest of that one, half a demand on average, where the exponential
        analysis charges a whole one (the residual-time correction for such queues)."""
        demand = self.demands()
        delay = max(0.0, self.token_alone() - sum(demand.values()))
        queue = dict.fromkeys(demand, 0.0)
        busy = dict.fromkeys(demand, 0.0)  # a CPU's utilisation
        x = 0.0
        for n in range(1, sessions + 1):
            cap = 1 / max(demand.values())  # (no more than the busiest queue serves)
            resid = {k: d * (1 + queue[k] - busy[k] / 2) for k, d in demand.items()}
            cycle = base = delay + sum(resid.values())
            for _ in range(4):  # (the wait depends on the period it lengthens: a fixed point)
                cycle = base + self.gather(n, cycle)
            x = min(n / cycle, cap)
            queue = {k: x * r for k, r in resid.items()}
            busy = {k: x * d if k in self.providers else 0.0 for k, d in demand.items()}
        return x, queue, busy

    def token(self, sessions: int) -> tuple[float, float]:
        """(seconds per token of each session, tokens per second of all) with `sessions`
        running at once: no more tokens a second than each provider's quota allows."""
        x, _, _ = self.mva(sessions)
        return sessions / x, x

    # ---- the first token, a failover -------------------------------------------------------

    def served(self, x: str, there: float, back: float, work: float) -> float:
        """A request of `there` bytes from the client to `x` and its answer of `back`,
        with `work` CPU seconds on `x` between them; `x`'s part at its quota's pace."""
        ends = self.end(x, there) + self.end(x, back)
        return self.rtt(CLIENT, x, there, back) + self.stretch(x, ends + work) - ends

    def star_step(self, x: str, tokens: int) -> float:
        """A step of `tokens` sent to `x` the star way and its outputs back."""
        extra = self.t.hidden_bytes_per_token * (tokens - 1)
        there, back = self.t.star_bytes + extra, self.t.result_bytes + extra
        work = self.cpu(x, self.stage_s + max(0, tokens - 1) * self.t.stage_token_s)
        return self.served(x, there, back, work)

    def opening(self, x: str) -> float:
        """A session opened on `x` (and, later, closed: what a session costs a provider
        beyond its tokens, `Calibration.provider_costs`)."""
        return self.served(x, self.t.open_bytes, self.t.accepted_bytes, self.cpu(x, self.session_s))

    def first_demands(self, x: str, tokens: int) -> dict[str, float]:
        """What a first step's request to `x` (its opening, then the prompt's step) asks of
        each queue it passes."""
        extra = self.t.hidden_bytes_per_token * (tokens - 1)
        there = (self.t.open_bytes, self.t.star_bytes + extra)
        back = (self.t.accepted_bytes, self.t.result_bytes + extra)
        work = self.cpu(
            x, self.session_s + self.stage_s + max(0, tokens - 1) * self.t.stage_token_s
        )
        work += sum(self.end(x, n) for n in (*there, *back))
        return {
            x: self.stretch(x, work),
            f"up:{CLIENT}": sum(self.on_link(n) for n in there) / self.rate(CLIENT),
            f"down:{x}": sum(self.on_link(n) for n in there) / self.rate(x),
            f"up:{x}": sum(self.on_link(n) for n in back) / self.rate(x),
            f"down:{CLIENT}": sum(self.on_link(n) for n in back) / self.rate(CLIENT),
        }

    def first_token(self, prompt_tokens: int, sessions: int = 1, ahead: int | None = None) -> float:
        """The first step: each stage opened in turn (the broker's pick, an open, the prompt's
        hidden states there and back), then the head; behind the other sessions.

        A link shares itself among the transfers on it (TCP's flows), a provider's CPU runs
        its requests one at a time. So with the other `sessions - 1` running, the prompt's
        transfers on a link share it with the others there (`shared_stretch`, their mean
        number there the mean-value analysis's: the arrival theorem), and its work waits at
        each CPU, once for all its stages there, for the others' tokens there, the one in
        service half done (as in `mva`). With the sessions starting together (`ahead`: those
        started before this one), where a link is the first steps' bottleneck, they share it
        to the end and all finish together: when it has carried every session's first step,
        or after one session's demands when that is longer (the asymptotic bounds); where a
        CPU is, this one's waits at each stage's busiest queue for the first steps of those
        ahead."""
        alone = self.t.client_step_s
        for p in self.placed:
            alone += (
                self.broker_rtt()
                + self.opening(p.provider)
                + self.star_step(p.provider, prompt_tokens)
            )
        firsts = [self.first_demands(p.provider, prompt_tokens) for p in self.placed]
        total: dict[str, float] = {}
        for first in firsts:
            for k, d in first.items():
                total[k] = total.get(k, 0.0) + d
        if ahead is not None:
            neck = max(total, key=lambda k: total[k])
            if neck not in self.providers:  # a link: shared by all
                served = sum(total.values())
                return alone - served + max(served, sessions * total[neck])
            return alone + ahead * sum(max(first.values()) for first in firsts)
        others = max(0, sessions - 1)
        x, queue, busy = self.mva(others)
        out = alone + sum(b / x * (queue[k] - b / 2) for k, b in busy.items() if b > 0)
        for first in firsts:
            for k, d in first.items():
                if k not in self.providers:
                    out += (shared_stretch(others, queue.get(k, 0.0)) - 1) * d
        return out

    def connect(self, a: str, b: str) -> float:
        """A new connection from `a` to `b`: its set-up's round trips (`connect_rtts`) and
        its ends' work beyond them (`connect_base_s`), or the p2p layer's own least set-up
        time (`connect_s`) where that is longer."""
        rtt = 2 * (self.delay(a) + self.delay(b))
        if self.cal.connect_rtts is None:
            return self.cal.connect_s + rtt
        return max(self.cal.connect_s, self.cal.connect_base_s + self.cal.connect_rtts * rtt)

    def first_use(self, a: str, b: str) -> float:
        """What `a`'s first request of a protocol to `b` waits more than its next (the p2p
        layer negotiates each protocol on a connection once): its round trips and time."""
        return self.cal.protocol_s + self.cal.protocol_rtts * 2 * (self.delay(a) + self.delay(b))

    def promotion(self, backup: str) -> float:
        """The broker's request to `backup` to serve a stage it holds, and its answer,
        `backup`'s ends at its quota's pace."""
        ends = 2 * self.end(backup, PROMOTE_BYTES)
        return 2 * self.to_broker(backup) + self.stretch(backup, ends)

    def dead_dial(self) -> float:
        """A request to a killed provider from a peer that has seen its connection drop: it
        fails where it is made, after the p2p layer's own time (`dead_dial_s`)."""
        return self.cal.dead_dial_s or 0.0

    def stall(self, victim: str, history: int) -> float | None:
        """The gap a kill of `victim` puts in a session's tokens after the kill (None: no
        backup). The chained step breaks: where the victim is first on the route, the client
        sees its connection drop (the victim's kernel closes it); else the hop before it does,
        its request to the victim fails, and it tells the client. The step then goes the star
        way: the stages before the victim's, then the client's own request to the victim fails
        the same way; it reports the failure (the broker promotes the backup), asks for the
        stage, connects to the backup, opens a session there, replays the history (a later
        stage first fetches its chained inputs from the provider now serving the stage before
        it: the backup, where the victim served that one too) and sends the step; each of the
        victim's further stages the same (no call to the victim again); the stages after them
        the star way."""
        stages = [i for i, p in enumerate(self.placed) if p.provider == victim]
        if not stages or self.placed[stages[0]].backup is None:
            return None
        first, now = stages[0], promoted(self.placed, victim)
        if first == 0:
            out = self.delay(victim) + self.delay(CLIENT)
        else:
            before = self.placed[first - 1].provider
            out = self.delay(victim) + self.delay(before) + self.dead_dial()
            out += self.hop(before, CLIENT, self.t.answer_bytes)
        out += sum(self.star_step(p.provider, 1) for p in self.placed[:first])
        out += self.dead_dial() + self.broker_rtt()  # (and the report)
        done: set[str] = set()
        seen = self.delay(victim)  # (the broker sees the victim's connection drop)
        ready: dict[str, float] = {}  # when the broker last promoted a stage on each backup
        way = self.to_broker(CLIENT)
        for i, p in enumerate(self.placed[first:], first):
            if p.provider != victim:
                out += self.star_step(p.provider, 1)
                continue
            backup = p.backup or victim
            # the broker names the backup once it has confirmed the stage (its requests to a
            # provider go one after another)
            ready[backup] = ready.get(backup, seen) + self.promotion(backup)
            out = max(out + way, ready[backup]) + way
            if backup not in done:  # (and the session protocol's first request there)
                out += self.connect(CLIENT, backup) + self.first_use(CLIENT, backup)
                done.add(backup)
            if i > 0:  # its chained inputs, kept by the provider now before it
                width = self.t.hidden_bytes_per_token * history
                out += self.rtt(CLIENT, now[i - 1].provider, self.t.open_bytes, width)
            out += self.opening(backup) + self.star_step(backup, history)
            out += self.star_step(backup, 1)
        return out + self.t.client_step_s


def shared_stretch(others: int, mean: float) -> float:
    """How much longer a long transfer takes on a link shared with `others` sessions', `mean`
    of them on it on average (each with probability `mean / others`, independently): it gets
    `1 / (1 + k)` of the link while `k` are there, so `1 / E[1 / (1 + K)]`, K binomial. (One
    plus the mean overstates it: the share is convex in K.)"""
    if others <= 0 or mean <= 0:
        return 1.0
    p = min(1.0, mean / others)
    share = (1 - (1 - p) ** (others + 1)) / ((others + 1) * p)
    return 1 / share


def promoted(placed: list[Placed], victim: str) -> list[Placed]:
    """The placement once `victim` is gone: its stages on their backups, with none behind."""
    return [
        Placed(p.stage, p.backup, None) if p.provider == victim and p.backup else p for p in placed
    ]
