"""A receiver that stops reading for 8 s does not break the sender's stream.

yamux resets a stream whose window stays empty for 5 s. Our reader always drains yamux and
the sender waits for credit instead, so a pause of 8 s only pauses the sender.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from p2p import Host, HostConfig, ProtocolSpec, Stream
from p2p.testing import LOCAL, Chunk, Echo

pytestmark = pytest.mark.timeout(90)

PAUSE = 8.0  # seconds the receiver stops reading
WINDOW = 4 * 1024 * 1024  # the receiver's credit window, bytes
MB = 1024 * 1024


async def test_stream_survives_a_receiver_that_stops_reading_for_8_s() -> None:
    spec = ProtocolSpec("/fusionai/test-pause/1", Chunk, Chunk, max_message_bytes=2 * MB)
    received: list[int] = []
    resumed_at: list[float] = []

    async def paused_reader(stream: Stream) -> None:
        await asyncio.sleep(PAUSE)
        resumed_at.append(time.monotonic())
        async for chunk in stream:
            assert chunk.data == bytes([chunk.seq % 256]) * MB
            received.append(chunk.seq)
        await stream.send(Chunk(seq=len(received)))

    count = 48  # 48 MB: twelve windows
    server_config = HostConfig(listen=LOCAL.listen, recv_window=WINDOW)
    async with Host(server_config) as server, Host(LOCAL) as client:
        server.add_stream_handler(spec, paused_reader)
        peer = await client.connect(server.addrs[0])
        sent_at: list[float] = []
        async with await client.open_stream(peer, spec) as stream:
            for seq in range(count):
                await stream.send(Chunk(seq=seq, data=bytes([seq % 256]) * MB))
                sent_at.append(time.monotonic())
            await stream.close()
            assert (await stream.recv()).seq == count

    assert received == list(range(count))
    # While the receiver was not reading, the sender was held back by credit: it got at most
    # about two windows plus the initial credit out, not the whole 48 MB into yamux.
    sent_before_resume = sum(1 for t in sent_at if t < resumed_at[0])
    assert 1 <= sent_before_resume <= (2 * WINDOW + 2 * MB) // MB + 1, sent_before_resume


async def test_requests_survive_a_handler_that_blocks_for_8_s() -> None:
    spec = ProtocolSpec("/fusionai/test-block/1", Echo, Echo, max_message_bytes=2 * MB)
    release = asyncio.Event()
    first: list[int] = []

    async def blocking(peer_id: str, msg: Echo) -> Echo:
        if not first:  # the first request to run blocks; the rest queue behind it
            first.append(msg.n)
            await asyncio.sleep(PAUSE)
            release.set()
        await release.wait()
        return Echo(n=msg.n, data=msg.data[:1])

    # One request at a time: the rest wait in the receiver, holding credit, for 8 s.
    server_config = HostConfig(listen=LOCAL.listen, recv_window=WINDOW, max_concurrent_requests=1)
    async with Host(server_config) as server, Host(LOCAL) as client:
        server.add_control_handler(spec, blocking)
        peer = await client.connect(server.addrs[0])
        answers = await asyncio.gather(
            *(client.request(peer, spec, Echo(n=i, data=b"x" * MB)) for i in range(24))
        )
    assert [a.n for a in answers] == list(range(24))


async def test_small_requests_do_not_each_cost_a_window_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A yamux stream returns its receive credit once half its window has been read
    (`p2p._libp2p.batched_release`), not with every read: 300 requests and answers of 2 KB
    each way move about 1.2 MB, which needs a handful of WINDOW_UPDATE frames, not one a
    message (py-libp2p's own release sent 632)."""
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    updates: list[int] = []
    send_update = YamuxStream.send_window_update

    async def counted(self: YamuxStream, increment: int, skip_lock: bool = False) -> None:
        updates.append(increment)
        await send_update(self, increment, skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    spec = ProtocolSpec("/fusionai/test-small/1", Echo, Echo, max_message_bytes=MB)

    async def echo(peer_id: str, msg: Echo) -> Echo:
        return Echo(n=msg.n, data=msg.data)

    async with Host(LOCAL) as server, Host(LOCAL) as client:
        server.add_control_handler(spec, echo)
        peer = await client.connect(server.addrs[0])
        for i in range(300):  # one after another, as a generation's steps go
            answer = await client.request(peer, spec, Echo(n=i, data=bytes([i % 256]) * 2048))
            assert answer.n == i and answer.data == bytes([i % 256]) * 2048
    assert 1 <= len(updates) <= 20, len(updates)
