"""Random and mutated frames: the decoder raises only typed errors; a live host survives them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p import FrameError, Host
from p2p.codec import MAX_CHUNK, FrameDecoder, Kind, Reassembler, encode_frames, encode_message
from p2p.testing import ECHO_COMPUTE, ECHO_CONTROL, LOCAL, Echo, send_raw, serve_test_protocols

VALID = b"".join(
    [
        *encode_frames(Kind.REQUEST, 1, encode_message(Echo(data=b"abc", n=1)), 1024),
        *encode_frames(Kind.REQUEST, 2, encode_message(Echo(data=b"x" * 3000, n=2)), 1024),
    ]
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[pos : pos + draw(st.integers(1, 64))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        else:
            del data[pos:]
    return bytes(data)


frames = st.one_of(st.binary(max_size=4096), mutated())


@given(data=frames, cut=st.integers(1, 512))
@settings(max_examples=500, deadline=None)
def test_decoder_raises_only_typed_errors(data: bytes, cut: int) -> None:
    decoder, reasm = FrameDecoder(max_frame=MAX_CHUNK), Reassembler(max_message=1 << 16)
    try:
        for i in range(0, len(data), cut):
            for frame in decoder.feed(data[i : i + cut]):
                payload = reasm.add(frame)
                if payload is not None:
                    ECHO_CONTROL.decode_request(payload)
    except FrameError as exc:
        assert exc.code in {"too_large", "bad_request", "protocol_error"}


@given(payload=st.one_of(st.binary(max_size=512), mutated()))
@settings(max_examples=500, deadline=None)
def test_message_decoder_raises_only_frame_errors(payload: bytes) -> None:
    try:
        msg = ECHO_CONTROL.decode_request(payload)
    except FrameError as exc:
        assert exc.code == "bad_request"
    else:
        assert isinstance(msg, Echo)


class LiveHosts:
    """A server and a client on an event loop in a background thread, for sync hypothesis tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Host(LOCAL)
        self.client = Host(LOCAL)
        self.run(self._start())

    async def _start(self) -> None:
        await self.server.start()
        serve_test_protocols(self.server)
        await self.client.start()
        self.peer = await self.client.connect(self.server.addrs[0])

    def run(self, coro, timeout: float = 30):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveHosts]:
    hosts = LiveHosts()
    yield hosts
    hosts.close()


@pytest.mark.timeout(300)
@given(data=frames, protocol=st.sampled_from([ECHO_CONTROL, ECHO_COMPUTE]))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_live_host_answers_garbage_with_typed_errors_and_keeps_serving(
    live: LiveHosts, data: bytes, protocol: object
) -> None:
    answer = live.run(send_raw(live.client, live.peer, protocol.protocol_id, data, timeout=10)).data  # type: ignore[attr-defined]
    # Whatever came back is well-formed frames of the kinds a server may send.
    for frame in FrameDecoder(max_frame=MAX_CHUNK).feed(answer):
        assert frame.kind in (Kind.RESPONSE, Kind.ERROR, Kind.CREDIT)
    # And the host still answers a normal request on its ordinary stream.
    echo = live.run(live.client.request(live.peer, ECHO_COMPUTE, Echo(n=1)))
    assert echo.n == 3


def _errors(answer: bytes) -> list[tuple[int, str]]:
    from p2p.codec import decode_error

    return [
        (f.call_id, decode_error(f.payload).code)
        for f in FrameDecoder(max_frame=MAX_CHUNK).feed(answer)
        if f.kind == Kind.ERROR
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # a well-formed frame around a payload that is not an Echo
        (b"".join(encode_frames(Kind.REQUEST, 5, b"\x93\x01\x02\x03", 1024)), [(5, "bad_request")]),
        # a frame kind a server never accepts
        (b"".join(encode_frames(Kind.RESPONSE, 6, b"x", 1024)), [(6, "protocol_error")]),
        # a header announcing a frame beyond the wire limit: the stream is closed with a reason
        (
            b"".join(encode_frames(Kind.REQUEST, 7, b"", 1024))[:1] + b"\xff" * 13,
            [(0, "too_large")],
        ),
        # a credit frame of the wrong size
        (b"".join(encode_frames(Kind.CREDIT, 0, b"abc", 1024)), [(0, "protocol_error")]),
    ],
    ids=["bad-payload", "wrong-kind", "huge-length", "bad-credit"],
)
def test_live_host_names_what_was_wrong(
    live: LiveHosts, data: bytes, expected: list[tuple[int, str]]
) -> None:
    answer = live.run(send_raw(live.client, live.peer, ECHO_COMPUTE.protocol_id, data)).data
    assert _errors(answer) == expected
    assert live.run(live.client.request(live.peer, ECHO_COMPUTE, Echo(n=2))).n == 4


@pytest.mark.timeout(60)
def test_live_host_answers_valid_raw_frames(live: LiveHosts) -> None:
    from p2p.codec import Kind as K

    answer = live.run(send_raw(live.client, live.peer, ECHO_COMPUTE.protocol_id, VALID)).data
    responses = [f for f in FrameDecoder(max_frame=MAX_CHUNK).feed(answer) if f.kind == K.RESPONSE]
    assert sorted(f.call_id for f in responses) == [1, 2]


@pytest.mark.timeout(60)
def test_a_flood_of_unfinished_messages_is_cut_off_not_buffered(live: LiveHosts) -> None:
    # Frames flagged MORE on ever new call ids, ignoring credit: the host stops granting
    # credit once one message's worth is part-received, then closes the stream when the
    # peer overruns its credit, instead of buffering everything.
    from p2p.codec import FLAG_MORE, HEADER

    chunk = b"\x00" * (256 * 1024)
    # 25 MB: past the 16 MiB window granted up front, with no credit after the first 1 MiB.
    flood = b"".join(
        HEADER.pack(len(chunk), Kind.REQUEST, FLAG_MORE, i + 1) + chunk for i in range(100)
    )
    outcome = live.run(send_raw(live.client, live.peer, ECHO_COMPUTE.protocol_id, flood))
    assert outcome.reset or (0, "protocol_error") in _errors(outcome.data)
    assert not any(
        f.kind == Kind.ERROR and f.call_id > 0 for f in FrameDecoder(MAX_CHUNK).feed(outcome.data)
    )
    assert live.run(live.client.request(live.peer, ECHO_COMPUTE, Echo(n=2))).n == 4
