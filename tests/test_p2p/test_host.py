"""Two real hosts exchange typed requests over libp2p (Noise + yamux) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from p2p import (
    ConnectionLost,
    EndOfStream,
    FrameError,
    Host,
    HostClosed,
    HostConfig,
    ProtocolSpec,
    Relay,
    RemoteError,
    RequestTimeout,
    Stream,
    Tensor,
)
from p2p.testing import (
    ECHO_COMPUTE,
    ECHO_CONTROL,
    LOCAL,
    SINK,
    TENSOR,
    Chunk,
    Echo,
    TensorMsg,
    serve_test_protocols,
)

pytestmark = pytest.mark.timeout(60)


async def test_control_handler_runs_on_the_event_loop(pair: tuple[Host, Host, str]) -> None:
    _, client, peer = pair
    answer = await client.request(peer, ECHO_CONTROL, Echo(data=b"hi", n=1))
    assert answer == Echo(data=b"hi", n=2, thread=threading.main_thread().name)


async def test_compute_handler_runs_in_a_worker_thread(pair: tuple[Host, Host, str]) -> None:
    _, client, peer = pair
    answer = await client.request(peer, ECHO_COMPUTE, Echo(data=b"hi", n=1))
    assert answer.n == 3 and answer.data == b"hi"
    assert answer.thread.startswith("fusionai-compute")


async def test_64_mb_tensor_round_trips_bit_exact(pair: tuple[Host, Host, str]) -> None:
    _, client, peer = pair
    rng = np.random.default_rng(7)
    array = rng.standard_normal(16 * 1024 * 1024, dtype=np.float32).reshape(4096, 4096)
    answer = await client.request(peer, TENSOR, TensorMsg(tensor=Tensor.from_numpy(array)))
    back = answer.tensor.to_numpy()
    assert back.shape == (4096, 4096) and back.dtype == np.float32
    assert back.tobytes() == array.tobytes()


async def test_200_concurrent_requests_over_one_connection(pair: tuple[Host, Host, str]) -> None:
    server, client, peer = pair
    answers = await asyncio.gather(
        *(
            client.request(peer, ECHO_COMPUTE if i % 2 else ECHO_CONTROL, Echo(n=i))
            for i in range(200)
        )
    )
    assert [a.n for a in answers] == [i + 2 if i % 2 else i + 1 for i in range(200)]
    assert client.connected_peers() == [server.peer_id]
    # the same answer without a trip to the p2p thread, from any thread
    assert await asyncio.to_thread(client.is_connected, server.peer_id)
    assert not client.is_connected(client.peer_id) and not client.is_connected("not a peer")


async def test_requests_made_while_the_stream_opens_arrive_in_order() -> None:
    order = ProtocolSpec("/fusionai/test-order/1", Echo, Echo)
    arrived: list[int] = []

    async def record(peer_id: str, msg: Echo) -> Echo:
        arrived.append(msg.n)
        return msg

    config = HostConfig(listen=LOCAL.listen, max_concurrent_requests=1)
    async with Host(config) as server, Host(LOCAL) as client:
        server.add_control_handler(order, record)
        peer = await client.connect(server.addrs[0])
        await asyncio.gather(*(client.request(peer, order, Echo(n=i)) for i in range(50)))
    assert arrived == list(range(50))


@pytest.mark.parametrize("spec", [ECHO_CONTROL, ECHO_COMPUTE], ids=["control", "compute"])
async def test_handler_error_reaches_caller_and_next_request_works(
    pair: tuple[Host, Host, str], spec: ProtocolSpec
) -> None:
    _, client, peer = pair
    with pytest.raises(RemoteError) as info:
        await client.request(peer, spec, Echo(n=-1))
    assert info.value.code == "handler_error"
    assert "n must not be negative" in info.value.message
    assert info.value.peer_id == peer
    answer = await client.request(peer, spec, Echo(n=5))
    assert answer.n in (6, 7)


async def test_handler_returning_the_wrong_type_is_a_remote_error(
    pair: tuple[Host, Host, str],
) -> None:
    server, client, peer = pair
    wrong = ProtocolSpec("/fusionai/test-wrong/1", Echo, Echo)
    server.add_compute_handler(wrong, lambda p, m: Chunk(seq=1))
    with pytest.raises(RemoteError, match="handler returned Chunk"):
        await client.request(peer, wrong, Echo())


async def test_unknown_message_type_is_rejected_with_a_typed_error(
    pair: tuple[Host, Host, str],
) -> None:
    _, client, peer = pair
    # The client's spec claims the protocol takes Chunk; the server's takes only Echo.
    lying = ProtocolSpec(ECHO_COMPUTE.protocol_id, Chunk, Echo)
    with pytest.raises(RemoteError) as info:
        await client.request(peer, lying, Chunk(seq=1))
    assert info.value.code == "bad_request"
    assert (await client.request(peer, ECHO_COMPUTE, Echo(n=1))).n == 3


async def test_oversized_request_is_refused_locally_and_remotely() -> None:
    small = ProtocolSpec("/fusionai/test-small/1", Echo, Echo, max_message_bytes=1000)
    big_client = HostConfig(listen=LOCAL.listen, max_message_bytes={small.protocol_id: 10**6})
    async with Host(LOCAL) as server, Host(big_client) as client:
        server.add_compute_handler(small, lambda p, m: m)
        peer = await client.connect(server.addrs[0])
        async with Host(LOCAL) as strict:
            with pytest.raises(FrameError, match="exceeds the limit"):
                await strict.request(peer, small, Echo(data=b"x" * 2000))
        with pytest.raises(RemoteError) as info:
            await client.request(peer, small, Echo(data=b"x" * 5000))
        assert info.value.code == "too_large"
        assert (await client.request(peer, small, Echo(data=b"ok"))).data == b"ok"


async def test_request_timeout_then_late_answer_is_dropped(pair: tuple[Host, Host, str]) -> None:
    server, client, peer = pair
    slow = ProtocolSpec("/fusionai/test-slow/1", Echo, Echo)

    async def sleepy(peer_id: str, msg: Echo) -> Echo:
        await asyncio.sleep(msg.n / 1000)
        return msg

    server.add_control_handler(slow, sleepy)
    with pytest.raises(RequestTimeout):
        await client.request(peer, slow, Echo(n=500), timeout=0.1)
    await asyncio.sleep(0.6)  # the late answer arrives and must be ignored
    assert (await client.request(peer, slow, Echo(n=1))).n == 1


async def test_message_stream_delivers_everything_in_order(pair: tuple[Host, Host, str]) -> None:
    server, client, peer = pair
    got: list[int] = []

    async def collect(stream):  # type: ignore[no-untyped-def]
        async for chunk in stream:
            got.append(chunk.seq)
        await stream.send(Chunk(seq=len(got)))

    collect_spec = ProtocolSpec("/fusionai/test-collect/1", Chunk, Chunk)
    server.add_stream_handler(collect_spec, collect)
    async with await client.open_stream(peer, collect_spec) as stream:
        for i in range(500):
            await stream.send(Chunk(seq=i, data=b"z" * 100))
        await stream.close()
        assert (await stream.recv()).seq == 500
    assert got == list(range(500))


async def test_unknown_peer_and_bad_addresses_give_clear_errors() -> None:
    async with Host(LOCAL) as host:
        with pytest.raises(ValueError, match="not a peer multiaddr"):
            await host.connect("not-a-multiaddr")
        stranger = Host(LOCAL)
        async with stranger:
            stranger_id = stranger.peer_id
        with pytest.raises(ConnectionLost):
            await host.request(stranger_id, ECHO_CONTROL, Echo(), timeout=20)


async def test_a_closed_host_refuses_calls() -> None:
    host = Host(LOCAL)
    async with host:
        pass
    with pytest.raises(HostClosed):
        await host.request("12D3KooWanything", ECHO_CONTROL, Echo())


async def test_two_processes_exchange_typed_requests(remote_peer: dict[str, object]) -> None:
    addrs = remote_peer["addrs"]
    assert isinstance(addrs, list)
    async with Host(LOCAL) as client:
        peer = await client.connect(addrs[0])
        assert peer == remote_peer["peer_id"]
        control = await client.request(peer, ECHO_CONTROL, Echo(data=b"a", n=1))
        compute = await client.request(peer, ECHO_COMPUTE, Echo(data=b"b", n=1))
        assert (control.n, control.thread) == (2, "MainThread")
        assert compute.n == 3 and compute.thread.startswith("fusionai-compute")
        with pytest.raises(RemoteError):
            await client.request(peer, ECHO_COMPUTE, Echo(n=-1))
        answers = await asyncio.gather(
            *(client.request(peer, ECHO_COMPUTE, Echo(n=i)) for i in range(200))
        )
        assert [a.n for a in answers] == [i + 2 for i in range(200)]
        array = np.arange(16 * 1024 * 1024, dtype=np.int32)
        back = await client.request(peer, TENSOR, TensorMsg(tensor=Tensor.from_numpy(array)))
        assert np.array_equal(back.tensor.to_numpy(), array)
        async with await client.open_stream(peer, SINK) as stream:
            for i in range(20):
                await stream.send(Chunk(seq=i, data=bytes(1 << 20)))
            await stream.close()
            assert (await stream.recv()).seq == 20 << 20


async def test_several_hosts_share_one_trio_thread() -> None:
    async with Host(LOCAL) as a, Host(LOCAL) as b, Host(LOCAL) as c:
        serve_test_protocols(a)
        names = [t.name for t in threading.enumerate()]
        assert names.count("fusionai-p2p") == 1
        for host in (b, c):
            peer = await host.connect(a.addrs[0])
            assert (await host.request(peer, ECHO_CONTROL, Echo(n=1))).n == 2
    assert "fusionai-p2p" not in [t.name for t in threading.enumerate()]


async def test_concurrent_large_sends_on_one_stream_arrive_whole_and_in_order(
    pair: tuple[Host, Host, str],
) -> None:
    server, client, peer = pair
    got: list[tuple[int, bytes]] = []

    async def collect(stream: Stream) -> None:
        async for chunk in stream:
            got.append((chunk.seq, chunk.data))
        await stream.send(Chunk(seq=len(got)))

    spec = ProtocolSpec("/fusionai/test-order-stream/1", Chunk, Chunk, max_message_bytes=4 << 20)
    server.add_stream_handler(spec, collect)
    sizes = [1_800_000, 260_000, 3_000_000, 10, 700_000]
    async with await client.open_stream(peer, spec) as stream:
        await asyncio.gather(
            *(stream.send(Chunk(seq=i, data=bytes([i + 1]) * n)) for i, n in enumerate(sizes))
        )
        await stream.close()
        assert (await stream.recv()).seq == len(sizes)
    assert [seq for seq, _ in got] == list(range(len(sizes)))  # sends were queued in order
    for seq, data in got:
        assert data == bytes([seq + 1]) * sizes[seq]  # no message mixed with another


async def test_a_stream_handler_that_returns_early_does_not_hang_the_sender() -> None:
    spec = ProtocolSpec("/fusionai/test-early/1", Chunk, Chunk, max_message_bytes=2 << 20)

    async def first_only(stream: Stream) -> None:
        await stream.recv()  # reads one message, then returns

    small_window = HostConfig(listen=LOCAL.listen, recv_window=4 << 20)
    async with Host(small_window) as server, Host(LOCAL) as client:
        server.add_stream_handler(spec, first_only)
        peer = await client.connect(server.addrs[0])
        async with await client.open_stream(peer, spec) as stream:
            async with asyncio.timeout(30):
                for i in range(12):  # 12 MB against a 4 MB window
                    await stream.send(Chunk(seq=i, data=bytes(1 << 20)))
                await stream.close()
                with pytest.raises(EndOfStream):
                    await stream.recv()


async def test_a_compute_handler_relays_its_result_through_another_peer() -> None:
    """A -> B's compute handler answers with a `Relay` to C: B dials C by address, sends its
    result on from the trio side (no worker thread waits), and answers A from C's answer; a
    relay to a peer that cannot be reached is finished with the error, once."""
    relay_spec = ProtocolSpec("/fusionai/test-relay/1", Echo, Echo)
    finished: list[str] = []
    async with Host(LOCAL) as a, Host(LOCAL) as b, Host(LOCAL) as c:
        serve_test_protocols(c)
        target = {"peer": c.peer_id, "addrs": list(c.addrs)}

        def relay(peer_id: str, msg: Echo) -> Relay:
            def finish(outcome: object) -> Echo:
                finished.append(type(outcome).__name__)
                if isinstance(outcome, Echo):
                    return Echo(data=outcome.data, n=outcome.n * 10, thread=outcome.thread)
                return Echo(data=str(outcome).encode(), n=-1)

            on = Echo(data=msg.data, n=msg.n + 1)
            return Relay(target["peer"], target["addrs"], ECHO_COMPUTE, on, 10.0, finish)

        b.add_compute_handler(relay_spec, relay)
        peer = await a.connect(b.addrs[0])
        assert c.peer_id not in b.connected_peers()
        answers = await asyncio.gather(*(a.request(peer, relay_spec, Echo(n=i)) for i in range(20)))
        # B adds 1, C's compute echo adds 2, B's finish multiplies by 10.
        assert [x.n for x in answers] == [(i + 3) * 10 for i in range(20)]
        assert all(x.thread.startswith("fusionai-compute") for x in answers)
        assert c.peer_id in b.connected_peers() and finished == ["Echo"] * 20
        assert b.is_connected(c.peer_id)

        await c.close()
        answer = await a.request(peer, relay_spec, Echo(n=1), timeout=30)
        assert answer.n == -1 and finished[-1] in {"ConnectionLost", "RemoteError"}
        target["peer"] = "12D3KooWNotAPeerThatExistsAnywhereXXXXXXXXXXXXXXXXXXX"
        target["addrs"] = ["/ip4/127.0.0.1/tcp/1/p2p/" + target["peer"]]
        answer = await a.request(peer, relay_spec, Echo(n=1), timeout=30)
        assert answer.n == -1 and finished[-1] == "ConnectionLost" and len(finished) == 22
