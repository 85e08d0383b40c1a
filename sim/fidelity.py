"""The simulator's prediction of a lab scenario (`sim.labscenario`): what `python -m lab
scenario` will measure, from the calibration's micro-measurements and nothing else.

Placement: the broker's decision core (`broker.core.Core`, as the broker runs it) is told of
each provider joining, with the profile the broker would see (the calibrated machine's FLOP/s
times the provider's CPU share, its memory limit, its access link) and then of the model; its
`AssignStage` actions are the placement.

A token (decode step) goes as the client library sends it when a session runs alone on its
client: chained, client -> stage 1 -> ... -> stage n -> client, each network hop costing both
access links' one-way delays, the bytes over the slower link, and the software's time at both
ends (`call_s` + bytes x `wire_s_per_byte`); each stage its calibrated one-token step;
consecutive stages on one provider hop without the network. Sessions at once: exact mean-value
analysis of the closed network they form (each client one session; each provider a queue whose
demand per token is its stage calls and its ends of the hops; the rest pure delay), and no more
tokens a second than each provider's CPU quota allows (quota / its CPU time per token).

The first token: the library's first step opens each stage in turn (ask the broker which
provider, open a session there, send the prompt's hidden states and wait for them back), then
the head. A failover stall (a provider killed mid-generation): the client sees the connection
drop (the victim's one-way delay), reports it and asks the broker for the stage again (two
round trips to the broker), opens a session on the backup and replays the history into it (two
round trips to the backup and a prefill of the prompt and the tokens so far), and the step
then finishes the star way from that stage on.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from broker.core import CoreConfig
from broker.core.actions import AssignStage
from broker.core.events import ModelAdded, ProviderJoined
from dag.cost import HardwareProfile
from dag.model import ModelSpec
from sim.calibration import Calibration, PackageTimes
from sim.driver import Driver
from sim.labscenario import FIGURES, LabProvider, LabScenario

CLIENT = "client"
MEMORY_BYTES = 2 * 1024**3  # the lab's providers run with --max-memory 2
PACKET_BYTES = 1500  # Ethernet's MTU: the unit the links' shapers pass on


@dataclass(frozen=True)
class Placed:
    stage: int  # manifest index
    provider: str
    backup: str | None


def hardware(p: LabProvider, cal: Calibration) -> HardwareProfile:
    """What the broker sees of `p`: the calibrated executor at `p`'s CPU share."""
    share = min(p.cpu, float(p.threads))
    return HardwareProfile(
        name=p.name,
        flops={k: v * share for k, v in cal.profile.flops.items()},
        memory_bytes=float(MEMORY_BYTES),
        mem_bandwidth=cal.profile.mem_bandwidth * share,
        net_bandwidth=p.link.bytes_s,
        rtt=2 * p.delay_ms / 1e3,  # to the broker, on the Internet with no delay of its own
    )


def place(
    s: LabScenario, model: str, spec: ModelSpec, indices: Sequence[int], cal: Calibration,
    core: CoreConfig,
) -> list[Placed]:  # fmt: skip
    """The decision core's placement of the model on the scenario's providers."""
    driver = Driver(core)
    for p in s.lab.provider:
        driver.handle(
            ProviderJoined(p.name, hardware(p, cal), 0.0, executor="ort", memory_bytes=MEMORY_BYTES)
        )
    keys = tuple(f"{model}/{i}" for i in indices)
    actions = driver.handle(ModelAdded(model, spec, keys, 0.0))
    active: dict[int, str] = {}
    backup: dict[int, str] = {}
    for a in actions:
        if isinstance(a, AssignStage):
            (active if a.role == "active" else backup).setdefault(a.pos, a.peer_id)
    if len(active) != len(keys):
        raise ValueError(f"the decision core placed {len(active)} of {len(keys)} stages")
    return [Placed(indices[i], active[i], backup.get(i)) for i in range(len(keys))]


class Model:
    """The scenario's network and software costs, for one placement."""

    def __init__(self, s: LabScenario, cal: Calibration, placed: list[Placed]) -> None:
        if cal.package is None:
            raise ValueError("the calibration has no package timings: run `fusionai sim "
                             "calibrate --package DIR` with the scenario's package")  # fmt: skip
        self.s, self.cal, self.placed = s, cal, placed
        self.t: PackageTimes = cal.package
        self.providers = {p.name: p for p in s.lab.provider}

    def delay(self, x: str) -> float:
        link = self.s.lab.client if x == CLIENT else self.providers[x].link
        return link.delay_ms / 1e3

    def rate(self, x: str) -> float:
        return (self.s.lab.client if x == CLIENT else self.providers[x].link).bytes_s

    def end(self, nbytes: float) -> float:
        return self.cal.call_s + nbytes * self.cal.wire_s_per_byte

    def hop(self, a: str, b: str, nbytes: float) -> float:
        """One message from `a` to `b` (each a provider or the client) over the Internet."""
        if a == b:
            return 0.0
        # out of a's home, then into b's: packets pipeline through the two shapers
        slow, fast = sorted((self.rate(a), self.rate(b)))
        wire = nbytes / slow + min(nbytes, PACKET_BYTES) / fast
        return self.delay(a) + self.delay(b) + wire + 2 * self.end(nbytes)

    def rtt(self, a: str, b: str, there: float, back: float) -> float:
        return self.hop(a, b, there) + self.hop(b, a, back)

    def broker_rtt(self) -> float:
        """A small request to the broker and its answer (HTTP, the connection open)."""
        return 2 * self.delay(CLIENT) + 2 * self.cal.call_s

    # ---- a token ---------------------------------------------------------------------------

    def chain(self) -> list[str]:
        return [CLIENT, *(p.provider for p in self.placed), CLIENT]

    def token_alone(self) -> float:
        """One decode step of a session alone on the swarm: the chained trip."""
        b = self.t.hidden_bytes_per_token
        path = self.chain()
        trips = sum(self.hop(x, y, b) for x, y in itertools.pairwise(path))
        return self.t.client_step_s + len(self.placed) * self.t.stage_step_s + trips

    def demands(self) -> dict[str, float]:
        """Seconds per token each queue serves: each provider's CPU (its stage steps, its ends
        of hops) and each access link's way up and down (the bytes it carries)."""
        b = self.t.hidden_bytes_per_token
        out: dict[str, float] = {}

        def add(key: str, seconds: float) -> None:
            out[key] = out.get(key, 0.0) + seconds

        path = self.chain()
        for p in self.placed:
            add(p.provider, self.t.stage_step_s)
        for x, y in itertools.pairwise(path):
            if x != y:
                for end in (x, y):
                    if end != CLIENT:
                        add(end, self.end(b))
                add(f"up:{x}", b / self.rate(x))
                add(f"down:{y}", b / self.rate(y))
        return out

    def token(self, sessions: int) -> tuple[float, float]:
        """(seconds per token of each session, tokens per second of all) with `sessions`
        running at once: mean-value analysis, capped by the providers' quotas."""
        demand = self.demands()
        delay = max(0.0, self.token_alone() - sum(demand.values()))
        queue = dict.fromkeys(demand, 0.0)
        x = 0.0
        for n in range(1, sessions + 1):
            resid = {k: d * (1 + queue[k]) for k, d in demand.items()}
            x = n / (delay + sum(resid.values()))
            queue = {k: x * r for k, r in resid.items()}
        cap = min(
            min(self.providers[k].cpu, 1.0) / d
            for k, d in demand.items()
            if d > 0 and k in self.providers
        )
        x = min(x, cap)
        return sessions / x, x

    # ---- the first token, a failover -------------------------------------------------------

    def prefill(self, tokens: int) -> float:
        return self.t.stage_step_s + max(0, tokens - 1) * self.t.stage_token_s

    def first_token(self, prompt_tokens: int) -> float:
        """The first step: each stage opened in turn (the broker's pick, an open, the prompt's
        hidden states there and back), then the head."""
        b = self.t.hidden_bytes_per_token * prompt_tokens
        out = self.t.client_step_s
        for p in self.placed:
            out += self.broker_rtt()
            out += self.rtt(CLIENT, p.provider, 64, 64)  # open
            out += self.rtt(CLIENT, p.provider, b, b) + self.prefill(prompt_tokens)
        return out

    def stall(self, victim: str, history: int) -> float | None:
        """The gap a kill of `victim` puts in a session's tokens (None: no backup)."""
        stages = [i for i, p in enumerate(self.placed) if p.provider == victim]
        if not stages:
            return None
        first = stages[0]
        backup = self.placed[first].backup
        if backup is None:
            return None
        b = self.t.hidden_bytes_per_token
        out = self.hop(victim, CLIENT, 64) + 2 * self.broker_rtt()
        out += self.rtt(CLIENT, backup, 64, 64)  # open
        out += self.rtt(CLIENT, backup, b * history, b) + self.prefill(history)  # replay
        for p in self.placed[first + 1 :]:  # the step goes on the star way
            out += self.rtt(CLIENT, p.provider, b, b) + self.t.stage_step_s
        return out + self.t.client_step_s


def predict(
    s: LabScenario, model: str, spec: ModelSpec, indices: Sequence[int], cal: Calibration,
    core: CoreConfig, prompt_tokens: int, generated: int,
) -> dict[str, object]:  # fmt: skip
    """The lab scenario's figures as the simulator predicts them (`sim.labscenario.FIGURES`;
    None where it predicts nothing: a spread (p90), a stall without a kill). `generated`: the
    tokens each generation gives (greedy, it may end before `output_tokens`)."""
    placed = place(s, model, spec, indices, cal, core)
    m = Model(s, cal, placed)
    w = s.lab.workload
    per_token, _ = m.token(w.sessions)
    ttft = m.first_token(prompt_tokens)
    generation = ttft + (generated - 1) * per_token
    stalls = []
    for e in s.lab.event:
        done = max(1, int((e.at_s - ttft) / per_token) % generated)  # tokens so far
        stall = m.stall(e.provider, prompt_tokens + done)
        if stall is not None and e.action == "freeze":  # no drop: the step's deadline passes
            stall += w.step_timeout_s - m.hop(e.provider, CLIENT, 64)
        stalls.append(stall)
    known = [x for x in stalls if x is not None]
    figures = {
        "throughput_tokens_s": round(w.sessions * generated / generation, 3),
        "ttft_ms_p50": round(1e3 * ttft, 3),
        "token_ms_p50": round(1e3 * per_token, 3),
        "token_ms_p90": None,
        "generation_s_p50": round(generation, 4),
        "failover_stall_ms": round(1e3 * sorted(known)[len(known) // 2], 3) if known else None,
    }
    assert set(figures) == set(FIGURES)
    return {
        "scenario": s.name,
        "source": "sim",
        "figures": figures,
        "placement": [
            {"stage": p.stage, "providers": [p.provider], "backups": [p.backup] if p.backup else []}
            for p in placed
        ],
        "calibration": {"machine": cal.machine, "measured_at": cal.measured_at},
    }
