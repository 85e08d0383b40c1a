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
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sim.calibration import PackageTimes

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


def _package_times(package: Path, count: int) -> PackageTimes:
    """A provider stage's decode step and prefill cost per token, as `provider.serving` runs
    them on one thread, and the client's embedding and head for a token."""
    from client.stages import ClientStages
    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from p2p.tensor import Tensor
    from proto.session import SessionOpen, SessionStep
    from provider.serving import Server
    from provider.stage import LoadedStage
    from sim.calibration import PackageTimes

    pkg = load_package(package)
    info = next(s for s in pkg.manifest.stages if s.placement == "provider")
    executor = OrtExecutor(
        pkg.models[info.index], inputs=info.inputs, outputs=info.outputs, threads=1
    )
    key = f"{pkg.manifest.name}/{info.index}"
    server = Server(kv_budget_bytes=1 << 30)
    server.add(LoadedStage(key, info, executor, "active"))
    width = info.activation_bytes_per_token // 4

    def feeds(first: int, n: int) -> dict[str, Tensor]:
        return {
            "hidden_states": Tensor.from_numpy(np.ones((1, n, width), dtype=np.float32)),
            "position_ids": Tensor.from_numpy(np.arange(first, first + n, dtype=np.int64)[None]),
        }

    def prefill(sid: str, n: int) -> float:
        server.session("calibrate", SessionOpen(session=sid, stage=key))
        start = time.perf_counter()
        server.session("calibrate", SessionStep(session=sid, stage=key, inputs=feeds(0, n)))
        return time.perf_counter() - start

    long = 33
    prefill("warm", long)
    one = statistics.median(prefill(f"one{i}", 1) for i in range(20))
    many = statistics.median(prefill(f"many{i}", long) for i in range(20))
    prefill("decode", 16)
    steps = []
    for i in range(min(count, 200)):
        start = time.perf_counter()
        server.session(
            "calibrate", SessionStep(session="decode", stage=key, inputs=feeds(16 + i, 1))
        )
        steps.append(time.perf_counter() - start)
    client = ClientStages(package)
    ids = np.array([[1]], dtype=np.int64)
    hidden = client.embed(ids)
    client.head(hidden, np.ones_like(ids))
    ends = []
    for _ in range(50):
        start = time.perf_counter()
        client.head(client.embed(ids), np.ones_like(ids))
        ends.append(time.perf_counter() - start)
    return PackageTimes(
        model=pkg.manifest.name,
        stage_step_s=statistics.median(steps),
        stage_token_s=max(0.0, many - one) / (long - 1),
        client_step_s=statistics.median(ends),
        hidden_bytes_per_token=int(info.activation_bytes_per_token),
    )


def calibrate(
    count: int = 400, mib: int = 4, executor: str | None = None, package: Path | None = None
) -> object:
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
        package=None if package is None else _package_times(package, count),
    )


def run(args: argparse.Namespace) -> int:
    from sim.calibration import Calibration, save

    if args.count < 20 or not 1 <= args.mib <= 64:
        print("error: --count is at least 20, --mib 1 to 64", file=sys.stderr)
        return 2
    print("measuring round trips and this machine's profile ...", file=sys.stderr, flush=True)
    package = Path(args.package) if args.package else None
    if package is not None and not (package / "manifest.json").is_file():
        print(f"error: {package} is not a model package (no manifest.json)", file=sys.stderr)
        return 2
    out = calibrate(args.count, args.mib, args.executor, package)
    assert isinstance(out, Calibration)
    save(out, Path(args.out))
    print(
        f"{args.out}: call_s {out.call_s * 1e3:.3f} ms a hop's end, "
        f"{out.wire_s_per_byte * 1e9:.3f} ns a byte, an executor call "
        f"{out.stage_call_s * 1e3:.3f} ms ({out.profile.executor} on {out.machine})"
    )
    return 0
