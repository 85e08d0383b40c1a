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
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sim.calibration import PackageTimes

SMALL = 64  # float32 values of the small payload
ROOT = Path(__file__).resolve().parents[1]


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


class _Proxy:
    """A TCP proxy on loopback to `port` that counts the bytes it passes, and delays each
    way by `delay_s` as a line does: each chunk leaves `delay_s` after it came, whatever
    follows it (holding each chunk the delay before reading the next charged messages sent
    back to back one delay each: a request on an open connection took two round trips)."""

    def __init__(self, port: int, delay_s: float = 0.0) -> None:
        self.port, self.moved, self.delay_s = port, 0, delay_s

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._splice, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _splice(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(2 * self.delay_s)  # (TCP's handshake: a round trip)
        r2, w2 = await asyncio.open_connection("127.0.0.1", self.port)
        await asyncio.gather(self._pipe(reader, w2), self._pipe(r2, writer), return_exceptions=True)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        line: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await line.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                w.write(data)
                await w.drain()

        out = asyncio.ensure_future(deliver())
        try:
            while data := await r.read(1 << 16):
                self.moved += len(data)
                line.put_nowait((time.monotonic() + self.delay_s, data))
            line.put_nowait(None)
            await out
        finally:
            out.cancel()
            w.close()

    def close(self) -> None:
        self.server.close()


async def _transport(count: int) -> tuple[float, float, float]:
    """What the transport adds to a message on the wire (stream, yamux and Noise framing):
    the small round trips' bytes through a counting proxy between two hosts, less the
    messages' encoded size, per message. And a new connection's set-up time (TCP,
    multistream, Noise, yamux, and the dialer's own wait) and what a protocol's first request
    waits more than its next (`_setups`), on loopback."""
    from p2p import Host
    from p2p.codec import encode_message
    from p2p.tensor import Tensor
    from p2p.testing import LOCAL, TENSOR, TensorMsg, serve_test_protocols

    msg = TensorMsg(Tensor.from_numpy(np.ones(SMALL, dtype=np.float32)))
    async with Host(LOCAL) as server:
        serve_test_protocols(server)
        proxy = _Proxy(int(server.addrs[0].split("/")[4]))
        addr = f"/ip4/127.0.0.1/tcp/{await proxy.start()}/p2p/{server.peer_id}"
        async with Host(LOCAL) as client:
            peer = await client.connect(addr)
            for _ in range(5):  # the connection's set-up is not a message's
                await client.request(peer, TENSOR, msg)
            await asyncio.sleep(0.2)
            before = proxy.moved
            for _ in range(count):
                await client.request(peer, TENSOR, msg)
            await asyncio.sleep(0.2)
            per_message = (proxy.moved - before) / (2 * count)
        proxy.close()
    return max(0.0, per_message - len(encode_message(msg))), *await _setups(0.0)


async def _setups(delay: float) -> tuple[float, float]:
    """Through a proxy delaying `delay` seconds each way (the medians of 3): a new
    connection's set-up, and what a protocol's first request on it waits more than its
    next (py-libp2p negotiates each protocol on a connection once, in two round trips)."""
    from p2p import Host
    from p2p.testing import ECHO_COMPUTE, ECHO_CONTROL, LOCAL, Echo, serve_test_protocols

    connects, firsts = [], []
    async with Host(LOCAL) as server:
        serve_test_protocols(server)
        proxy = _Proxy(int(server.addrs[0].split("/")[4]), delay)
        addr = f"/ip4/127.0.0.1/tcp/{await proxy.start()}/p2p/{server.peer_id}"
        for _ in range(3):
            async with Host(LOCAL) as client:
                start = time.perf_counter()
                peer = await client.connect(addr)
                connects.append(time.perf_counter() - start)
                # (the connection's first protocol; libp2p's identify, which follows a
                # connection, finishes meanwhile instead of failing noisily at the close)
                await client.request(peer, ECHO_CONTROL, Echo(b"x"))
                took = []
                for _ in range(2):  # another protocol's first request, then its next
                    start = time.perf_counter()
                    await client.request(peer, ECHO_COMPUTE, Echo(b"x"))
                    took.append(time.perf_counter() - start)
                firsts.append(took[0] - took[1])
                await asyncio.sleep(0.05 + 2 * delay)
        proxy.close()
    return statistics.median(connects), statistics.median(firsts)


async def _connect_rtts(delay_s: float = 0.05) -> tuple[float, float, float]:
    """How many round trips a new connection's set-up takes (TCP, multistream, Noise,
    yamux), and a protocol's first request more than its next: the medians through a proxy
    that delays every chunk `2 * delay_s` each way, less those through one delaying
    `delay_s`, over the round trip added (both long enough that the dialer's own least
    wait, `connect_s`, is not what they measure); and the set-up's time beyond its round
    trips (what they do not overlap: the two ends' handshake work)."""
    (connect, first), (connect2, first2) = await _setups(delay_s), await _setups(2 * delay_s)
    rtts = max(0.0, connect2 - connect) / (2 * delay_s)
    base = max(0.0, connect - rtts * 2 * delay_s)
    return rtts, max(0.0, first2 - first) / (2 * delay_s), base


async def _dead_dial() -> float:
    """How long a request to a peer that has gone takes to fail, as a session's client
    meets it (the median of 3): the peer's process killed (its kernel closes its
    connections), a stream to it broken (a chained step's), and the next request to it at
    once (the star way's), on loopback. (A host that closes itself instead lets the p2p
    layer drop the connection first: the request dials again and waits out the refusals,
    0.7 s here, which a client whose peer was killed does not.)"""
    import json
    import signal

    from p2p import Host
    from p2p.errors import P2PError
    from p2p.testing import ECHO_CONTROL, LOCAL, SINK, Chunk, Echo

    out = []
    for _ in range(3):
        server = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "p2p.testing", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            info = json.loads(await server.stdout.readline())
            async with Host(LOCAL) as client:
                addr = info["addrs"][0]
                peer = await client.connect(f"{addr}/p2p/{info['peer_id']}")
                await client.request(peer, ECHO_CONTROL, Echo(b"x"))
                stream = await client.open_stream(peer, SINK)
                await stream.send(Chunk(seq=0, data=b"x"))
                server.send_signal(signal.SIGKILL)
                try:
                    async with asyncio.timeout(30.0):
                        await stream.recv()  # (the sink answers only at the stream's end)
                except (P2PError, TimeoutError):
                    pass
                start = time.perf_counter()
                try:
                    await client.request(peer, ECHO_CONTROL, Echo(b"x"), timeout=30.0)
                except P2PError:
                    out.append(time.perf_counter() - start)
                else:
                    raise RuntimeError("a request to a killed host succeeded")
        finally:
            if server.returncode is None:
                server.kill()
            await server.wait()
    return statistics.median(out)


def _chain_bytes(package_name: str, hops: int, width: int) -> dict[str, Any]:
    """The encoded size of a chained step's messages for `hops` provider stages (the real
    messages, with real peer ids, session ids and signature): the step sent to each hop
    with no addresses in its route, what each address in it adds, a hop's answer back
    and what each further hop's record adds to it, the last hop's push of the outputs and
    the client's acceptance (`client.chained`, `provider.stepchain`). The step carries a
    tag a hop, the open the client's key for its provider."""
    import uuid

    from p2p.codec import encode_message
    from p2p.identity import Identity
    from p2p.tensor import encode
    from proto.forward import ChainAccepted, ForwardResult, HopDone
    from proto.session import (
        ROUTE_KEY_BYTES,
        ChainStep,
        ChainStepResult,
        SessionOpen,
        SessionStep,
        StepHop,
        route_tag,
        step_route_bytes,
    )

    ids = [Identity.ephemeral() for _ in range(hops + 1)]
    key = f"{package_name}/1"
    hidden = encode(np.ones((1, 1, width), dtype=np.float32), "native")
    inputs = {"hidden_states": hidden, "position_ids": encode(np.array([[7]]), "native")}
    chain, expires = uuid.uuid4().hex, time.time()

    def step(addrs: list[str]) -> int:
        route = [
            StepHop(i.peer_id, f"{package_name}/{k + 1}", uuid.uuid4().hex, list(addrs))
            for k, i in enumerate(ids[:hops])
        ]
        signed = step_route_bytes(chain, route, 7, expires)
        sig = ids[-1].sign(signed, domain="calibrate")
        tags = [route_tag(bytes(ROUTE_KEY_BYTES), signed)] * hops
        return len(encode_message(ChainStep(chain, ids[-1].peer_id, route, 0, 7, inputs,
                                            expires, sig, tags=tags)))  # fmt: skip

    def answer(n: int) -> int:
        done = [HopDone(ids[0].peer_id, f"{package_name}/1", 1.234) for _ in range(n)]
        return len(encode_message(ForwardResult({}, 1.234, done)))

    bare = step([])
    return {
        "step_bytes": bare,
        "addr_bytes": (step(["/ip4/203.0.113.101/tcp/4800"]) - bare) // hops,
        "answer_bytes": answer(1),
        "answer_hop_bytes": answer(2) - answer(1),
        "result_bytes": len(
            encode_message(ChainStepResult(chain, {"hidden_states_out": hidden}, 8))
        ),
        "accepted_bytes": len(encode_message(ChainAccepted(chain))),
        "star_bytes": len(encode_message(SessionStep(f"{chain}.1", key, inputs, 7))),
        "open_bytes": len(
            encode_message(SessionOpen(f"{chain}.1", key, route_key=bytes(ROUTE_KEY_BYTES)))
        ),
    }


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
    hops = sum(1 for st in pkg.manifest.stages if st.placement == "provider")
    return PackageTimes(
        model=pkg.manifest.name,
        provider_stages=hops,
        stage_step_s=statistics.median(steps),
        stage_token_s=max(0.0, many - one) / (long - 1),
        client_step_s=statistics.median(ends),
        hidden_bytes_per_token=int(info.activation_bytes_per_token),
        **_chain_bytes(pkg.manifest.name, hops, width),
    )


def calibrate(
    count: int = 400, mib: int = 4, executor: str | None = None, package: Path | None = None
) -> object:
    from provider.profile import measure
    from sim.calibration import VERSION, Calibration, MeasuredProfile

    large = mib * (1 << 20) // 4
    small_rtt = statistics.median(asyncio.run(_round_trips(SMALL, count)))
    large_rtt = statistics.median(asyncio.run(_round_trips(large, max(5, count // 20))))
    frame_bytes, connect_s, protocol_s = asyncio.run(_transport(min(count, 200)))
    connect_rtts, protocol_rtts, connect_base_s = asyncio.run(_connect_rtts())
    dead_dial_s = asyncio.run(_dead_dial())
    machine = measure(executor)
    e = machine.executors[0]
    profile = MeasuredProfile(
        machine.gpu or machine.cpu, e.executor, {k: v for k, v in e.flops.items() if v > 0},
        e.mem_bandwidth, e.memory_bytes,
    )  # fmt: skip
    times = None
    if package is not None:
        import msgspec

        times = _package_times(package, count)
        kind = e.executor if e.executor in ("ort", "torch") else "ort"
        from cli.calibrate_providers import provider_costs

        costs = provider_costs(package, msgspec.json.encode(machine), kind)
        times = msgspec.structs.replace(times, **costs)
    return Calibration(
        version=VERSION,
        machine=f"{machine.cpu} ({platform.system()} {platform.machine()})",
        measured_at=round(time.time(), 3),
        call_s=small_rtt / 4,
        frame_bytes=frame_bytes,
        connect_s=connect_s,
        connect_rtts=connect_rtts,
        connect_base_s=connect_base_s,
        protocol_s=protocol_s,
        protocol_rtts=protocol_rtts,
        dead_dial_s=dead_dial_s,
        wire_s_per_byte=max(0.0, large_rtt - small_rtt) / (4 * large * 4),
        stage_call_s=statistics.median(_executor_calls(count)),
        small_rtt_s=small_rtt,
        large_rtt_s=large_rtt,
        large_bytes=large * 4,
        samples=count,
        profile=profile,
        package=times,
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
