"""Helpers for tests and benchmarks: small protocols, handlers, a peer in its own process, and
an in-memory network of hosts (`MemoryNetwork`, `p2p.memory`) for tests in one process.

python -m p2p.testing   # serve the test protocols; prints {"peer_id", "addrs"} as JSON,
                        # then serves until its standard input closes
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from dataclasses import dataclass
from typing import Any

from p2p.codec import Message, ProtocolSpec
from p2p.config import HostConfig
from p2p.host import Host
from p2p.memory import MemoryHost, MemoryNetwork
from p2p.stream import Stream
from p2p.tensor import Tensor

__all__ = ["MemoryHost", "MemoryNetwork"]  # (and the helpers below)

LOCAL = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))


class Echo(Message, frozen=True, tag="Echo/1"):
    data: bytes = b""
    n: int = 0
    thread: str = ""


class TensorMsg(Message, frozen=True, tag="TensorMsg/1"):
    tensor: Tensor


class Chunk(Message, frozen=True, tag="Chunk/1"):
    seq: int
    data: bytes = b""


ECHO_CONTROL = ProtocolSpec("/fusionai/test-echo-control/1", Echo, Echo)
ECHO_COMPUTE = ProtocolSpec("/fusionai/test-echo-compute/1", Echo, Echo)
TENSOR = ProtocolSpec(
    "/fusionai/test-tensor/1", TensorMsg, TensorMsg, max_message_bytes=128 * 1024 * 1024
)
SINK = ProtocolSpec("/fusionai/test-sink/1", Chunk, Chunk, max_message_bytes=2 * 1024 * 1024)


async def echo_control(peer_id: str, msg: Echo) -> Echo:
    """Control handler: answers n + 1; raises for a negative n."""
    if msg.n < 0:
        raise ValueError(f"n must not be negative, got {msg.n}")
    return Echo(data=msg.data, n=msg.n + 1, thread=threading.current_thread().name)


def echo_compute(peer_id: str, msg: Echo) -> Echo:
    """Compute handler: answers n + 2; raises for a negative n."""
    if msg.n < 0:
        raise ValueError(f"n must not be negative, got {msg.n}")
    return Echo(data=msg.data, n=msg.n + 2, thread=threading.current_thread().name)


def tensor_echo(peer_id: str, msg: TensorMsg) -> TensorMsg:
    return msg


async def sink(stream: Stream) -> None:
    """Stream handler: reads chunks to the end, answers Chunk(seq=count, data=b"") with the
    number of payload bytes received in `seq`."""
    total = 0
    async for chunk in stream:
        total += len(chunk.data)
    await stream.send(Chunk(seq=total))


def serve_test_protocols(host: Host) -> None:
    host.add_control_handler(ECHO_CONTROL, echo_control)
    host.add_compute_handler(ECHO_COMPUTE, echo_compute)
    host.add_compute_handler(TENSOR, tensor_echo)
    host.add_stream_handler(SINK, sink)


async def _serve_until_stdin_closes() -> None:
    async with Host(LOCAL) as host:
        serve_test_protocols(host)
        serve_raw_echo(host)
        print(json.dumps({"peer_id": host.peer_id, "addrs": host.addrs}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


# ---- probes that speak to a host the way a hostile or broken peer would ------------------------


def dial_with_security(addr: str, security: str, timeout: float = 10.0) -> str:
    """Dial `addr` from a throwaway libp2p host offering only `security` ("noise",
    "plaintext" or "secio"); returns "connected" or the error. Blocking: runs its own trio
    loop in the calling thread, so call it from a worker thread (`asyncio.to_thread`)."""
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.security.secio import transport as secio

    kp = create_new_key_pair()
    options = {
        "noise": {
            TProtocol(NOISE_ID): NoiseTransport(
                kp, noise_privkey=create_x25519_key_pair().private_key
            )
        },
        "plaintext": {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)},
        "secio": {TProtocol(secio.ID): secio.Transport(kp)},
    }

    async def attempt() -> str:
        host = new_host(key_pair=kp, sec_opt=options[security])
        try:
            async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                with trio.fail_after(timeout):
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                return "connected"
        except Exception as error:
            exc: BaseException = error
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            chain = [exc, *([exc.__cause__] if exc.__cause__ else [])]
            return " <- ".join(f"{type(e).__name__}: {e}" for e in chain)
        finally:
            await host.close()

    result: str = trio.run(attempt)
    return result


@dataclass(frozen=True)
class RawExchange:
    data: bytes  # every byte the peer sent back
    reset: bool  # the peer reset the stream (cut us off) rather than closing it


async def send_raw(
    host: Host, peer_id: str, protocol_id: str, data: bytes, timeout: float = 10.0
) -> RawExchange:
    """Open a raw stream of `protocol_id` from `host` to `peer_id`, write `data`, close our
    side, and return what the peer sends back before closing (or before `timeout`)."""
    import trio
    from libp2p.custom_types import TProtocol
    from libp2p.network.stream.exceptions import StreamEOF, StreamReset
    from libp2p.peer.id import ID

    runtime, core = host._running()

    async def exchange() -> RawExchange:
        got = bytearray()
        reset = False
        with trio.move_on_after(timeout):
            stream = await core._lp.new_stream(ID.from_base58(peer_id), [TProtocol(protocol_id)])
            try:
                await stream.write(data)
                await stream.close_write()
                while True:
                    chunk = await stream.read(1 << 20)
                    if not chunk:
                        break
                    got += chunk
            except StreamEOF:
                pass
            except StreamReset:
                reset = True
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await stream.reset()
                    except Exception:
                        pass
        return RawExchange(bytes(got), reset)

    return await runtime.run(exchange)


RAW_ECHO = "/fusionai/test-raw-echo/1"  # plain libp2p: 4-byte length, payload, echoed back


def serve_raw_echo(host: Host) -> None:
    """Serve RAW_ECHO on `host` with a plain py-libp2p handler (no framing, no facade)."""
    import struct

    from libp2p.custom_types import TProtocol

    runtime, core = host._running()

    async def echo(stream: Any) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = await stream.read(1 << 20)
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= 4:
                    (size,) = struct.unpack_from("!I", buf)
                    if len(buf) < 4 + size:
                        break
                    await stream.write(bytes(buf[: 4 + size]))
                    del buf[: 4 + size]
        except Exception:
            return

    runtime.run_blocking(core._lp.set_stream_handler, TProtocol(RAW_ECHO), echo)


def raw_rtt_samples(addr: str, size: int, count: int) -> list[float]:
    """Round trips (seconds) of `size`-byte messages to RAW_ECHO at `addr`, measured inside
    trio with a plain py-libp2p host configured like ours (Noise, yamux) on one long-lived
    stream: the baseline our facade is compared with. Blocking; runs its own trio loop."""
    import struct
    import time

    import multiaddr
    import trio
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from p2p._libp2p import make_host
    from p2p.identity import Identity

    async def measure() -> list[float]:
        host = make_host(Identity.ephemeral())
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [TProtocol(RAW_ECHO)])
                message = struct.pack("!I", size) + b"\x01" * size
                samples = []
                for _ in range(count):
                    start = time.perf_counter()
                    await stream.write(message)
                    got = 0
                    while got < len(message):
                        got += len(await stream.read(1 << 20))
                    samples.append(time.perf_counter() - start)
                await stream.reset()
                return samples
            finally:
                await host.close()

    result: list[float] = trio.run(measure)
    return result


if __name__ == "__main__":
    asyncio.run(_serve_until_stdin_closes())
