"""Catalogs for simulation: GPUs, networks and churn, each figure with its source.

GPU figures are vendor datasheet / architecture whitepaper values (dense, i.e. without
structured sparsity). For GeForce cards the FP16 tensor figure used for compute is the one
with FP32 accumulation, which is what PyTorch and onnxruntime use for fp16 matmuls; GeForce
Ampere/Ada run FP16-with-FP32-accumulate at half the FP16-accumulate rate (NVIDIA Ampere GA102
and Ada AD102 whitepapers, appendix tables). Datacenter parts run both at the same rate.
Network and churn figures are assumptions for studies, stated with where their order of
magnitude comes from; scenario files can override every one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from dag.cost import HardwareProfile

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GpuSpec:
    name: str
    fp16_tensor: float  # dense FP16 tensor FLOP/s (FP32 accumulate)
    bf16_tensor: float  # dense BF16 tensor FLOP/s (FP32 accumulate)
    fp32: float  # FP32 (non-tensor) FLOP/s
    memory: float  # bytes
    mem_bandwidth: float  # bytes/s
    power_w: float  # board power, watts
    price_usd: float  # launch price (MSRP), US dollars
    source: str


_AMPERE = "NVIDIA Ampere GA102 whitepaper (2020), tables 'GeForce RTX 30 series'"
_ADA = "NVIDIA Ada Lovelace (AD102) whitepaper v1.1 (2023), appendix tables"
_STREET_PRICE = "price: a typical 2023 street price, an assumption"

GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            "rtx3060",
            25.6 * TFLOPS,
            25.6 * TFLOPS,
            12.7 * TFLOPS,
            12 * GB,
            360 * GB,
            170,
            329,
            _AMPERE,
        ),
        GpuSpec(
            "rtx3070",
            40.6 * TFLOPS,
            40.6 * TFLOPS,
            20.3 * TFLOPS,
            8 * GB,
            448 * GB,
            220,
            499,
            _AMPERE,
        ),
        GpuSpec(
            "rtx3080",
            59.5 * TFLOPS,
            59.5 * TFLOPS,
            29.8 * TFLOPS,
            10 * GB,
            760 * GB,
            320,
            699,
            _AMPERE,
        ),
        GpuSpec(
            "rtx3090",
            71.0 * TFLOPS,
            71.0 * TFLOPS,
            35.6 * TFLOPS,
            24 * GB,
            936 * GB,
            350,
            1499,
            _AMPERE,
        ),
        GpuSpec(
            "rtx4070",
            58.4 * TFLOPS,
            58.4 * TFLOPS,
            29.1 * TFLOPS,
            12 * GB,
            504 * GB,
            200,
            599,
            _ADA,
        ),
        GpuSpec(
            "rtx4080",
            97.5 * TFLOPS,
            97.5 * TFLOPS,
            48.7 * TFLOPS,
            16 * GB,
            717 * GB,
            320,
            1199,
            _ADA,
        ),
        GpuSpec(
            "rtx4090",
            165.2 * TFLOPS,
            165.2 * TFLOPS,
            82.6 * TFLOPS,
            24 * GB,
            1008 * GB,
            450,
            1599,
            _ADA,
        ),
        GpuSpec(
            "a100-sxm-80gb",
            312 * TFLOPS,
            312 * TFLOPS,
            19.5 * TFLOPS,
            80 * GB,
            2039 * GB,
            400,
            15000,
            "NVIDIA A100 Tensor Core GPU datasheet (2021); " + _STREET_PRICE,
        ),
        GpuSpec(
            "h100-sxm",
            989.4 * TFLOPS,
            989.4 * TFLOPS,
            67 * TFLOPS,
            80 * GB,
            3350 * GB,
            700,
            30000,
            "NVIDIA H100 Tensor Core GPU datasheet (2023); " + _STREET_PRICE,
        ),
        GpuSpec(
            "h100-pcie",
            756 * TFLOPS,
            756 * TFLOPS,
            51 * TFLOPS,
            80 * GB,
            2000 * GB,
            350,
            25000,
            "NVIDIA H100 Tensor Core GPU datasheet (2023); " + _STREET_PRICE,
        ),
    )
}


@dataclass(frozen=True)
class Network:
    name: str
    up_median: float  # bytes/s
    down_median: float  # bytes/s
    spread: float  # sigma of the log-normal spread around the medians (0: all the same)
    rtt: float  # seconds, round trip to the middle of the network
    source: str
    # hops go through the swarm's p2p stack (its calibrated software costs apply), not a
    # GPU interconnect's collectives
    p2p: bool = True

    def draw(self, rng: random.Random) -> tuple[float, float]:
        """(upload, download) bytes/s for one peer."""
        if self.spread == 0:
            return self.up_median, self.down_median
        factor = math.exp(rng.gauss(0.0, self.spread))
        return self.up_median * factor, self.down_median * factor


MBIT = 1e6 / 8  # bytes/s in one Mbit/s

NETWORKS: dict[str, Network] = {
    n.name: n
    for n in (
        Network(
            "home-broadband",
            20 * MBIT,
            200 * MBIT,
            0.8,
            0.04,
            "assumption: medians of the order reported by the FCC Measuring Broadband America "
            "and Ookla Speedtest reports for US fixed broadband (asymmetric, upload 5-10x less "
            "than download); log-normal spread is an assumption",
        ),
        Network(
            "home-fiber",
            500 * MBIT,
            500 * MBIT,
            0.5,
            0.02,
            "assumption: symmetric consumer fiber plans (300 Mbit/s to 1 Gbit/s)",
        ),
        Network(
            "datacenter-infiniband",
            50 * GB,
            50 * GB,
            0.0,
            0.00002,
            "InfiniBand NDR, 400 Gbit/s per port (NVIDIA Quantum-2 datasheet)",
            p2p=False,
        ),
        Network(
            "nvlink4",
            450 * GB,
            450 * GB,
            0.0,
            0.000005,
            "NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s bidirectional per GPU, "
            "so 450 GB/s each way",
            p2p=False,
        ),
    )
}


@dataclass(frozen=True)
class Churn:
    """Providers alternate online sessions and offline gaps, both Weibull distributed; some
    sessions end for good, and newcomers join as a Poisson process."""

    name: str
    mean_session: float  # seconds online per session
    mean_offline: float  # seconds offline between sessions
    shape: float  # Weibull shape: < 1 means many short sessions and a few long ones
    source: str
    departure_fraction: float = 0.0  # share of sessions after which the provider never returns
    arrivals_per_peer_hour: float = 0.0  # new providers per hour, per provider at the start

    def __post_init__(self) -> None:
        if not 0.0 <= self.departure_fraction <= 1.0 or self.arrivals_per_peer_hour < 0:
            raise ValueError(
                f"churn {self.name}: departure_fraction must lie in [0, 1] and "
                "arrivals_per_peer_hour must not be negative"
            )

    def _draw(self, rng: random.Random, mean: float) -> float:
        if math.isinf(mean):
            return math.inf
        scale = mean / math.gamma(1 + 1 / self.shape)
        return rng.weibullvariate(scale, self.shape)

    def session(self, rng: random.Random) -> float:
        return self._draw(rng, self.mean_session)

    def offline(self, rng: random.Random) -> float:
        return self._draw(rng, self.mean_offline)


CHURN: dict[str, Churn] = {
    c.name: c
    for c in (
        Churn("none", math.inf, 0.0, 1.0, "no churn: providers stay for the whole run"),
        Churn(
            "volunteer",
            60 * 60.0,
            30 * 60.0,
            0.6,
            "assumption: Weibull session lengths with shape < 1 as measured in peer-to-peer "
            "systems (Stutzbach and Rejaie, 'Understanding churn in peer-to-peer networks', "
            "IMC 2006); one-hour mean session for gaming PCs is an assumption; so are one "
            "session in ten ending for good and newcomers arriving at the rate that keeps the "
            "swarm's size level (2/3 online x 1 session/h x 0.1 = 0.067 per provider-hour)",
            departure_fraction=0.1,
            arrivals_per_peer_hour=0.067,
        ),
        Churn(
            "gaming-evening",
            3 * 60 * 60.0,
            60 * 60.0,
            0.8,
            "assumption: machines contributed for evenings of a few hours; one session in 20 "
            "ends for good, balanced by newcomers (3/4 online x 1/3 session/h x 0.05)",
            departure_fraction=0.05,
            arrivals_per_peer_hour=0.0125,
        ),
    )
}


def churn_with_mean(mean_session_minutes: float) -> Churn:
    """The 'volunteer' churn shape with another mean session (the CLI's --churn)."""
    base = CHURN["volunteer"]
    return Churn(
        f"volunteer-{mean_session_minutes:g}min",
        mean_session_minutes * 60.0,
        base.mean_offline,
        base.shape,
        base.source,
        base.departure_fraction,
        base.arrivals_per_peer_hour,
    )


def profile(gpu: GpuSpec, upload: float, rtt: float, usable_memory: float = 1.0) -> HardwareProfile:
    """The cost model's view of one machine."""
    return HardwareProfile(
        name=gpu.name,
        flops={"float16": gpu.fp16_tensor, "bfloat16": gpu.bf16_tensor, "float32": gpu.fp32},
        memory_bytes=gpu.memory * usable_memory,
        mem_bandwidth=gpu.mem_bandwidth,
        net_bandwidth=upload,
        rtt=rtt,
    )
