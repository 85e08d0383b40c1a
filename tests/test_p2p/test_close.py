"""After close, a host leaves nothing behind: threads, file descriptors and sockets counted."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import numpy as np
import psutil
import pytest

from p2p import Host, Tensor
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

pytestmark = pytest.mark.timeout(120)


def _resources() -> dict[str, object]:
    gc.collect()  # garbage of earlier tests (e.g. their HTTP clients' sockets) closes first
    proc = psutil.Process()
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "fds": len(os.listdir("/proc/self/fd")),
        "sockets": sorted((c.laddr, c.raddr, c.status) for c in proc.net_connections(kind="inet")),
    }


async def _busy_session() -> None:
    async with Host(LOCAL) as server, Host(LOCAL) as client, Host(LOCAL) as third:
        serve_test_protocols(server)
        for host in (client, third):
            peer = await host.connect(server.addrs[0])
            await asyncio.gather(*(host.request(peer, ECHO_COMPUTE, Echo(n=i)) for i in range(50)))
            await host.request(peer, ECHO_CONTROL, Echo(n=1))
            array = np.ones(1 << 20, dtype=np.float32)
            await host.request(peer, TENSOR, TensorMsg(tensor=Tensor.from_numpy(array)))
            async with await host.open_stream(peer, SINK) as stream:
                await stream.send(Chunk(seq=0, data=b"x" * 1000))
                await stream.close()
                await stream.recv()
            # Leave one call in flight at close time.
        asyncio.get_running_loop().create_task(
            client.request(peer, ECHO_CONTROL, Echo(n=1))
        ).add_done_callback(lambda t: t.exception())


async def test_closing_releases_threads_fds_and_sockets() -> None:
    async with Host(LOCAL):  # warm up once: imports and lazy module state are not leaks
        pass
    before = _resources()
    for _ in range(2):
        await _busy_session()
        await asyncio.sleep(0.2)  # let the event loop run the last callbacks
        after = _resources()
        assert after == before
