"""The in-memory network: the host's request API through the real codec, in one process."""

from __future__ import annotations

import asyncio

import pytest

from p2p import ConnectionLost, ErrorCode, FrameError, Relay, RemoteError, RequestTimeout
from p2p.testing import (
    ECHO_COMPUTE,
    ECHO_CONTROL,
    TENSOR,
    Echo,
    MemoryNetwork,
    echo_compute,
    echo_control,
)

pytestmark = pytest.mark.timeout(20)


async def test_requests_reach_control_and_compute_handlers_and_errors_come_back_typed() -> None:
    net = MemoryNetwork()
    async with net.host() as a, net.host() as b:
        b.add_control_handler(ECHO_CONTROL, echo_control)
        b.add_compute_handler(ECHO_COMPUTE, echo_compute)
        assert (await a.request(b.peer_id, ECHO_CONTROL, Echo(n=1))).n == 2
        answer = await a.request(b.peer_id, ECHO_COMPUTE, Echo(n=1, data=b"x"))
        assert answer.n == 3 and answer.data == b"x"
        assert answer.thread != "MainThread"  # compute handlers run in a worker thread
        with pytest.raises(RemoteError) as failed:
            await a.request(b.peer_id, ECHO_CONTROL, Echo(n=-1))
        assert failed.value.code == ErrorCode.HANDLER_ERROR and "negative" in str(failed.value)
        with pytest.raises(RemoteError) as unknown:
            await a.request(b.peer_id, TENSOR, Echo(n=1))  # b serves no such protocol
        assert unknown.value.code == ErrorCode.PROTOCOL_ERROR
        with pytest.raises(FrameError):
            await a.request(b.peer_id, ECHO_CONTROL, Echo(data=b"x" * (2 << 20)))  # too large
        assert net.calls[0] == (a.peer_id, b.peer_id, ECHO_CONTROL.protocol_id)


async def test_a_killed_host_fails_calls_at_once_and_a_frozen_one_times_out() -> None:
    net = MemoryNetwork()
    async with net.host() as a, net.host() as b:
        started = asyncio.Event()

        async def slow(peer: str, msg: Echo) -> Echo:
            started.set()
            await asyncio.sleep(30)
            return msg

        b.add_control_handler(ECHO_CONTROL, slow)
        call = asyncio.ensure_future(a.request(b.peer_id, ECHO_CONTROL, Echo(n=1), timeout=10))
        await started.wait()
        net.kill(b.peer_id)  # mid-call
        with pytest.raises(ConnectionLost):
            await call
        with pytest.raises(ConnectionLost):
            await a.request(b.peer_id, ECHO_CONTROL, Echo(n=1))
    async with net.host() as a, net.host() as c:
        c.add_control_handler(ECHO_CONTROL, echo_control)
        net.freeze(c.peer_id)
        with pytest.raises(RequestTimeout):
            await a.request(c.peer_id, ECHO_CONTROL, Echo(n=1), timeout=0.05)
        net.freeze(c.peer_id, False)
        assert (await a.request(c.peer_id, ECHO_CONTROL, Echo(n=1), timeout=1)).n == 2


async def test_a_compute_handler_relays_to_another_host_unless_it_cannot_dial_it() -> None:
    net = MemoryNetwork()
    async with net.host() as a, net.host() as b, net.host() as c:
        c.add_control_handler(ECHO_CONTROL, echo_control)

        def forward(peer: str, msg: Echo) -> Relay:
            def finish(outcome: object) -> Echo:
                if isinstance(outcome, Exception):
                    return Echo(n=-1, data=str(outcome).encode())
                assert isinstance(outcome, Echo)
                return Echo(n=outcome.n * 10)

            return Relay(c.peer_id, c.addrs, ECHO_CONTROL, msg, 5.0, finish)

        b.add_compute_handler(ECHO_COMPUTE, forward)
        assert (await a.request(b.peer_id, ECHO_COMPUTE, Echo(n=1))).n == 20
        net.block(b.peer_id, c.peer_id)
        refused = await a.request(b.peer_id, ECHO_COMPUTE, Echo(n=1))
        assert refused.n == -1 and b"cannot be reached" in refused.data
