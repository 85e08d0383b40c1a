"""`fusionai sim calibrate`: the simulator's constants, measured on this machine in one run.

Two p2p hosts in this process (the real stack: TCP on loopback, Noise, yamux, the codec) echo
tensors on a compute handler, as a stage call carries hidden states: round trips of 64
float32 values and of `--mib` MiB. One round trip is two hops, each with a sending and a
receiving end, so the software's time at one end of a hop is the small round trip over 4
(`call_s`), and its time per byte the difference of the large and small round trips over
4 x the large payload (`wire_s_per_byte`). One executor call's fixed time (`stage_call_s`) is
onnxruntime running a 64 x 64 MatMul on one row, on one thread. The machine's profile is the
provider daemon's own measurement (`provider.profile.measure`). Medians throughout; nothing
set by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SMALL = 64  # float32 values of the small payload


async def _round_trips(values: int, count: int) -> list[float]:
    from p2p import Host
    from p2p.tensor import Tensor
    from p2p.testing import LOCAL, TENSOR, TensorMsg, serve_test_protocols

    msg = TensorMsg(Tensor.from_numpy(np.ones(values, dtype=np.float32)))
    async with Host(LOCAL) as server, Host(LOCAL) as client:
        serve_test_protocols(server)
        peer = await client.connect(server.addrs[0])
        for _ in range(min(20, count)):  # warm: the stream opened, buffers grown
            await client.request(peer, TENSOR, msg)
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            await client.request(peer, TENSOR, msg)
            samples.append(time.perf_counter() - start)
    return samples


def _executor_calls(count: int) -> list[float]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ir.executors.ort import OrtExecutor

    weight = numpy_helper.from_array(np.eye(SMALL, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "call",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SMALL])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SMALL])], [weight],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    executor = OrtExecutor(model, threads=1)
    feeds = {"x": np.ones((1, SMALL), dtype=np.float32)}
    for _ in range(20):
        executor.run(feeds)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        executor.run(feeds)
        samples.append(time.perf_counter() - start)
    return samples


def calibrate(count: int = 400, mib: int = 4, executor: str | None = None) -> object:
    from provider.profile import measure
    from sim.calibration import VERSION, Calibration, MeasuredProfile

    large = mib * (1 << 20) // 4
    small_rtt = statistics.median(asyncio.run(_round_trips(SMALL, count)))
    large_rtt = statistics.median(asyncio.run(_round_trips(large, max(5, count // 20))))
    machine = measure(executor)
    e = machine.executors[0]
    profile = MeasuredProfile(
        machine.gpu or machine.cpu, e.executor, {k: v for k, v in e.flops.items() if v > 0},
        e.mem_bandwidth, e.memory_bytes,
    )  # fmt: skip
    return Calibration(
        version=VERSION,
        machine=f"{machine.cpu} ({platform.system()} {platform.machine()})",
        measured_at=round(time.time(), 3),
        call_s=small_rtt / 4,
        wire_s_per_byte=max(0.0, large_rtt - small_rtt) / (4 * large * 4),
        stage_call_s=statistics.median(_executor_calls(count)),
        small_rtt_s=small_rtt,
        large_rtt_s=large_rtt,
        large_bytes=large * 4,
        samples=count,
        profile=profile,
    )


def run(args: argparse.Namespace) -> int:
    from sim.calibration import Calibration, save

    if args.count < 20 or not 1 <= args.mib <= 64:
        print("error: --count is at least 20, --mib 1 to 64", file=sys.stderr)
        return 2
    print("measuring round trips and this machine's profile ...", file=sys.stderr, flush=True)
    out = calibrate(args.count, args.mib, args.executor)
    assert isinstance(out, Calibration)
    save(out, Path(args.out))
    print(
        f"{args.out}: call_s {out.call_s * 1e3:.3f} ms a hop's end, "
        f"{out.wire_s_per_byte * 1e9:.3f} ns a byte, an executor call "
        f"{out.stage_call_s * 1e3:.3f} ms ({out.profile.executor} on {out.machine})"
    )
    return 0
