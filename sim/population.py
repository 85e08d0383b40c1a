"""Who is in a simulated swarm: the providers at the start and the newcomers over the run, each
with a GPU drawn from the scenario's mix and a home connection drawn from its network model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from dag.cost import HardwareProfile
from sim.catalog import GPUS, NETWORKS, profile
from sim.scenario import Scenario


@dataclass
class Population:
    initial: list[str] = field(default_factory=list)  # online at the start
    arrivals: list[tuple[float, str]] = field(default_factory=list)  # (second, newcomer)
    profiles: dict[str, HardwareProfile] = field(default_factory=dict)
    download: dict[str, float] = field(default_factory=dict)  # bytes/s each can download
    power: dict[str, float] = field(default_factory=dict)  # watts each GPU draws serving


def draw(scenario: Scenario, rng: random.Random) -> Population:
    """The scenario's providers; newcomers arrive as a Poisson process over the run, drawn up
    front so the seed fixes them."""
    network = NETWORKS[scenario.network]
    names, weights = zip(*sorted(scenario.gpus.items()), strict=True)
    out = Population()

    def recruit(i: int) -> str:
        gpu = GPUS[rng.choices(names, weights)[0]]
        up, down = network.draw(rng)
        peer = f"{gpu.name}-{i}"
        software = network.p2p  # (a GPU interconnect's hops do not go through our stack)
        out.profiles[peer] = replace(
            profile(gpu, up, network.rtt),
            call_s=scenario.call_s if software else 0.0,
            wire_s_per_byte=scenario.wire_s_per_byte if software else 0.0,
            # (a datacenter's GPUs run their kernels back to back: no Python call per stage)
            stage_call_s=scenario.stage_call_s if software else 0.0,
        )
        out.download[peer] = down
        out.power[peer] = gpu.power_w
        return peer

    out.initial = [recruit(i) for i in range(scenario.peers)]
    rate = scenario.peers * scenario.churn.arrivals_per_peer_hour / 3600.0
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= scenario.hours * 3600.0:
            break
        out.arrivals.append((t, recruit(scenario.peers + len(out.arrivals))))
    return out
