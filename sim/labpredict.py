"""The lab scenario's figures as the simulator predicts them: one session's timeline over the
model of the swarm's parts (`sim.fidelity.Model`), its rounds, tokens and churn events."""

from __future__ import annotations

from collections.abc import Sequence

from broker.core import CoreConfig
from dag.model import ModelSpec
from sim.calibration import Calibration
from sim.fidelity import CLIENT, Model, promoted
from sim.labplace import place, stability
from sim.labscenario import FIGURES, LabScenario, percentile


def predict(
    s: LabScenario, model: str, spec: ModelSpec, indices: Sequence[int], cal: Calibration,
    core: CoreConfig, prompt_tokens: int, generated: int,
) -> dict[str, object]:  # fmt: skip
    """The lab scenario's figures as the simulator predicts them (`sim.labscenario.FIGURES`;
    None where it predicts nothing: a spread (p90), a stall without a kill). `generated`: the
    tokens each generation gives (greedy, it may end before `output_tokens`).

    Every session runs alike, so one session's timeline stands for all: its rounds one after
    another, each a first token then `generated - 1` gaps, at the pace of `sessions` at once;
    a churn event puts its failover stall in the gap it falls in, and the tokens after it
    take the route with the victim's stages on their backups."""
    placed = place(s, model, spec, indices, cal, core)
    w = s.lab.workload
    m = Model(s, cal, placed)
    events = sorted(s.lab.event, key=lambda e: e.at_s)
    t, gaps, took, stalls, ttfts, rechain = 0.0, [], [], [], [], 0.0
    for r in range(w.rounds):
        if r == 0:  # the sessions start together: one waits for none, the next for one, ...
            firsts = [m.first_token(prompt_tokens, w.sessions, i) for i in range(w.sessions)]
        else:
            firsts = [m.first_token(prompt_tokens, w.sessions)] * w.sessions
        ttfts += firsts
        ttft = sorted(firsts)[len(firsts) // 2]  # (the timeline's session: the median one)
        t += ttft
        spent = ttft
        for i in range(1, generated):
            gap, stalled = m.token(w.sessions)[0] + rechain, False
            rechain = 0.0
            while events and events[0].at_s <= t + gap:
                e = events.pop(0)
                victim = e.victim([p.provider for p in m.placed])
                stall = m.stall(victim, prompt_tokens + i)
                if stall is None:  # (no backup: the victim was not serving, or none stands by)
                    continue
                if e.action == "freeze":  # no drop: the step's deadline passes first
                    stall += w.step_timeout_s - m.hop(victim, CLIENT, 64)
                # (the gap it falls in began before it: by half a token, on average)
                stall += gap / 2
                gap, stalled = stall, True
                stalls.append(stall)
                after = Model(s, cal, promoted(m.placed, victim))
                rechain = after.rechain(m)
                m = after
            if not stalled:  # (the lab's token gaps leave the stalls out too)
                gaps.append(gap)
            t += gap
            spent += gap
        took.append(spent)
    gaps.sort()
    figures = {
        "throughput_tokens_s": round(w.sessions * generated * w.rounds / sum(took), 3),
        "ttft_ms_p50": round(1e3 * (percentile(ttfts, 0.5) or 0.0), 3),  # (as the lab's)
        "token_ms_p50": round(1e3 * gaps[len(gaps) // 2], 3) if gaps else None,
        "token_ms_p90": None,
        "generation_s_p50": round(sorted(took)[len(took) // 2], 4),
        "failover_stall_ms": round(1e3 * sorted(stalls)[len(stalls) // 2], 3) if stalls else None,
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
        "placement_stability": stability(s, model, spec, indices, cal, core, placed),
        "calibration": {"machine": cal.machine, "measured_at": cal.measured_at},
    }
