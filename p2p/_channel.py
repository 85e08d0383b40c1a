"""One libp2p stream carrying framed calls or messages, with credit-based flow control.

Runs in the trio thread. Two tasks own the stream: a reader that never stops reading (so
yamux's window is always refilled and the 5-second window timeout can never fire) and a writer
that sends a data frame only when the peer has granted credit for it. A receiver that is slow
to consume simply stops granting credit, and the sender waits without touching yamux.

Credit: each side starts with `INITIAL_CREDIT` bytes it may send; the receiver grants more in
`CREDIT` frames. Bytes of frames that arrive are granted back at once while the bytes of
unconsumed messages stay under the receive window and those of a message still arriving stay
within the protocol's message limit; past that, grants wait until the application consumes (a
request's handler answers, or `recv` takes a message). Memory held for a peer is thus bounded
by about two windows plus one message, whatever the peer does. CREDIT and stream-level ERROR
frames do not count, so credit can always flow.

Sending: on request/response streams, single-frame messages go out between the frames of at
most one large message at a time, so a 64 MB tensor does not hold up a 3 KB request and a
receiver never holds more than one part-received message from an honest sender. Message
streams send strictly in order. A server stops starting new requests while answers wait
unsent, so a peer that never reads cannot make us queue answers without bound.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import trio

from p2p._outgoing import Outgoing
from p2p.codec import (
    HEADER,
    HEADER_SIZE,
    MAX_CHUNK,
    ErrorCode,
    Frame,
    FrameDecoder,
    Kind,
    Reassembler,
    decode_credit,
    decode_error,
    encode_credit,
    encode_error,
)
from p2p.errors import ConnectionLost, FrameError

log = logging.getLogger(__name__)

INITIAL_CREDIT = 2 * MAX_CHUNK  # bytes either side may send before the first CREDIT frame
READ_SIZE = 1024 * 1024  # bytes asked of the stream per read
DRAIN_TIMEOUT = 300.0  # seconds a half-closed server stream waits for its handlers to answer


class CallSink(Protocol):
    """Where a client call's outcome goes (implemented by the asyncio facade)."""

    def resolve(self, kind: int, payload: bytes) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class ChannelOwner(Protocol):
    """What a channel needs from its host."""

    def on_request(self, channel: Channel, call_id: int, payload: bytes) -> None: ...

    def on_message(self, channel: Channel, kind: int, payload: bytes) -> None: ...

    def on_closed(self, channel: Channel, error: BaseException | None) -> None: ...


class Channel:
    """A framed, flow-controlled duplex over one libp2p stream.

    `mode` is "client" (we send requests and await responses), "server" (we answer requests)
    or "stream" (both sides send messages). All methods run in the trio thread.
    """

    def __init__(
        self,
        stream: Any,
        *,
        mode: str,
        protocol_id: str,
        owner: ChannelOwner,
        recv_window: int,
        chunk_size: int,
        max_message: int,
        max_concurrent: int = 1,
    ) -> None:
        self.stream = stream
        self.mode = mode
        self.protocol_id = protocol_id
        self.peer_id = str(stream.muxed_conn.peer_id)
        self._owner = owner
        self._window = recv_window
        self._chunk = chunk_size
        self._decoder = FrameDecoder(max_frame=MAX_CHUNK)
        self._reasm = Reassembler(max_message)
        self._max_message = max_message
        # sending
        self._ctrl: deque[bytes] = deque()
        self._small: deque[Outgoing] = deque()  # single-frame messages
        self._large: deque[Outgoing] = deque()  # multi-frame messages, one at a time
        self._out_bytes = 0  # payload bytes queued and not yet written
        self._last_large = False
        self._send_credit = INITIAL_CREDIT
        self._wake = trio.Event()
        # receiving
        self._granted = INITIAL_CREDIT  # total bytes we have allowed the peer to send
        self._received = 0  # counted bytes the peer has sent
        self._unconsumed = 0  # bytes of complete messages not yet consumed
        self._deferred = 0  # credit held back until the application consumes
        self._to_grant = 0  # credit earned but not yet sent
        # client calls
        self._pending: dict[int, CallSink] = {}
        self._next_call = 1
        # server requests
        self._max_concurrent = max_concurrent
        self._active: dict[int, int] = {}  # call id -> request bytes, while its handler runs
        self._waiting: deque[tuple[int, bytes]] = deque()
        self.closed = False
        self._cancel: trio.CancelScope | None = None
        self._write_error: BaseException | None = None
        self._sent_end = False
        self._got_end = False
        self._writing = False
        self._idle = trio.Event()

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the stream until either side closes it; never raises (but `Cancelled`)."""
        error: BaseException | None = None
        if self._window > INITIAL_CREDIT:
            self._grant(self._window - INITIAL_CREDIT, force=True)
        try:
            async with trio.open_nursery() as nursery:
                self._cancel = nursery.cancel_scope
                nursery.start_soon(self._write_loop)
                try:
                    await self._reader()
                    if self.mode == "server":
                        with trio.move_on_after(DRAIN_TIMEOUT):
                            await self._drain()  # the peer half-closed: still answer it
                except Exception as exc:  # a broken stream must never take the host down
                    error = exc
                nursery.cancel_scope.cancel()
            error = error or self._write_error
            if isinstance(error, FrameError):
                log.info("closing %s stream from %s: %s", self.protocol_id, self.peer_id, error)
                with trio.move_on_after(1):
                    await self._write_quietly(
                        self._frame(Kind.ERROR, 0, encode_error(error.code, error.message))
                    )
            elif error is not None:
                log.debug("%s stream to %s failed: %r", self.protocol_id, self.peer_id, error)
        finally:
            self._finish(error)
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await self._close_stream(error is not None)

    def _busy(self) -> bool:
        return bool(
            self._active
            or self._waiting
            or self._small
            or self._large
            or self._ctrl
            or self._writing
        )

    def _check_idle(self) -> None:
        if not self._busy():
            self._idle.set()

    async def _drain(self) -> None:
        while self._busy():
            self._idle = trio.Event()
            await self._idle.wait()

    async def _write_loop(self) -> None:
        try:
            await self._writer()
        except Exception as exc:
            self._write_error = exc
            if self._cancel is not None:
                self._cancel.cancel()

    def abort(self) -> None:
        """Stop serving at once (host shutdown)."""
        if self._cancel is not None:
            self._cancel.cancel()

    def _finish(self, error: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        lost = ConnectionLost(
            f"the {self.protocol_id} stream to {self.peer_id} closed"
            + (f": {error}" if error else "")
        )
        pending, self._pending = self._pending, {}
        for sink in pending.values():
            sink.fail(lost)
        queued = [*self._small, *self._large]
        self._small.clear()
        self._large.clear()
        for item in queued:
            if item.on_sent is not None:
                item.on_sent(False)
        self._waiting.clear()
        self._owner.on_closed(self, error)

    async def _close_stream(self, reset: bool) -> None:
        try:
            if reset:
                await self.stream.reset()
            else:
                await self.stream.close()
        except Exception as exc:
            log.debug("closing a %s stream: %r", self.protocol_id, exc)

    # ---- sending ---------------------------------------------------------------------------

    @staticmethod
    def _frame(kind: int, call_id: int, payload: bytes) -> bytes:
        return HEADER.pack(len(payload), kind, 0, call_id) + payload

    def _kick(self) -> None:
        self._wake.set()

    def send(
        self,
        kind: int,
        call_id: int,
        payload: bytes,
        on_sent: Callable[[bool], None] | None = None,
    ) -> None:
        """Queue one message (split into chunks as needed).

        `on_sent(True)` runs once it is written, `on_sent(False)` if the stream closes first.
        """
        if self.closed:
            if on_sent is not None:
                on_sent(False)
            return
        item = Outgoing(kind, call_id, payload, on_sent)
        if self.mode != "stream" and len(payload) <= self._chunk:
            self._small.append(item)
        else:
            self._large.append(item)  # message streams: everything in order, here
        self._out_bytes += len(payload)
        self._kick()

    def call(self, payload: bytes, sink: CallSink) -> int:
        """Send a request; the response or error goes to `sink`. Returns the call id."""
        if self.closed:
            sink.fail(ConnectionLost(f"the {self.protocol_id} stream to {self.peer_id} closed"))
            return 0
        call_id = self._next_call
        self._next_call += 1
        self._pending[call_id] = sink
        self.send(Kind.REQUEST, call_id, payload)
        return call_id

    def forget(self, call_id: int) -> None:
        """The caller gave up on `call_id`; a late answer will be dropped."""
        self._pending.pop(call_id, None)

    def respond(self, call_id: int, kind: int, payload: bytes) -> None:
        """Answer a request (RESPONSE or ERROR) and let the next waiting one start."""
        size = self._active.pop(call_id, None)
        if size is None:
            return  # not a request we are running (the stream was reset meanwhile)
        self.send(kind, call_id, payload)
        self.consumed(size)
        self._start_waiting()

    def _next_outgoing(self) -> tuple[deque[Outgoing], Outgoing] | None:
        """Alternate between small messages and frames of the large message in progress."""
        if self._small and (not self._large or self._last_large):
            return self._small, self._small[0]
        if self._large:
            return self._large, self._large[0]
        return None

    async def _writer(self) -> None:
        while True:
            if self._ctrl:
                await self._write(self._ctrl.popleft())
                continue
            picked = self._next_outgoing()
            if picked is not None:
                queue, item = picked
                if self._send_credit >= item.next_frame_size(self._chunk):
                    frame = item.take(self._chunk)
                    self._send_credit -= len(frame)
                    self._out_bytes -= len(frame) - HEADER_SIZE
                    self._last_large = queue is self._large
                    if item.done:
                        queue.popleft()
                    await self._write(frame)
                    if item.done:
                        if item.on_sent is not None:
                            item.on_sent(True)
                        if item.kind == Kind.END:
                            self._sent_end = True
                            if self._got_end and self._cancel is not None:
                                self._cancel.cancel()  # both sides done: a clean close
                        if self.mode == "server":
                            self._start_waiting()  # room again for answers
                    continue
            self._wake = trio.Event()
            await self._wake.wait()

    async def _write(self, data: bytes) -> None:
        self._writing = True
        try:
            await self.stream.write(data)
        finally:
            self._writing = False
            self._check_idle()

    async def _write_quietly(self, data: bytes) -> None:
        try:
            await self.stream.write(data)
        except Exception:
            pass

    # ---- receiving -------------------------------------------------------------------------

    def _grant(self, amount: int, *, force: bool = False) -> None:
        self._to_grant += amount
        if force or self._to_grant >= min(self._window // 4, 4 * 1024 * 1024):
            self._granted += self._to_grant
            self._ctrl.append(self._frame(Kind.CREDIT, 0, encode_credit(self._to_grant)))
            self._to_grant = 0
            self._kick()

    def _room(self) -> bool:
        return self._unconsumed < self._window and self._reasm.buffered <= self._max_message

    def _earned(self, nbytes: int) -> None:
        if self._room():
            self._grant(nbytes)
        else:
            self._deferred += nbytes

    def consumed(self, nbytes: int) -> None:
        """The application took a message of `nbytes` off our hands."""
        self._unconsumed -= nbytes
        if self._deferred and self._room():
            deferred, self._deferred = self._deferred, 0
            self._grant(deferred, force=True)

    async def _reader(self) -> None:
        from libp2p.network.stream.exceptions import StreamEOF, StreamReset

        while True:
            try:
                data = await self.stream.read(READ_SIZE)
            except StreamEOF:
                return
            except StreamReset as exc:
                raise ConnectionLost(f"stream reset by {self.peer_id}") from exc
            if not data:
                return
            for frame in self._decoder.feed(data):
                if not self._on_frame(frame):
                    return

    def _on_frame(self, frame: Frame) -> bool:
        """Handle one frame; False once the peer ended a message stream."""
        if frame.kind == Kind.CREDIT:
            self._send_credit += decode_credit(frame.payload)
            self._kick()
            return True
        if frame.kind == Kind.ERROR and frame.call_id == 0:
            info = decode_error(frame.payload)
            raise ConnectionLost(f"{self.peer_id} closed the stream: {info.code}: {info.message}")
        size = HEADER_SIZE + len(frame.payload)
        self._received += size
        if self._received > self._granted:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"peer sent {self._received} bytes but was granted only {self._granted}",
            )
        self._earned(size)
        expected = {
            "client": (Kind.RESPONSE, Kind.ERROR),
            "server": (Kind.REQUEST,),
            "stream": (Kind.MESSAGE, Kind.END, Kind.ERROR),
        }[self.mode]
        if frame.kind not in expected:
            self._answer_error(
                frame.call_id,
                ErrorCode.PROTOCOL_ERROR,
                f"unexpected frame kind {frame.kind} on a {self.mode} stream",
            )
            return True
        try:
            payload = self._reasm.add(frame)
        except FrameError as exc:
            self._reject(frame, exc)
            return True
        if payload is None:
            return True
        if self.mode == "client":
            sink = self._pending.pop(frame.call_id, None)
            if sink is not None:
                sink.resolve(frame.kind, payload)
        elif self.mode == "server":
            self._unconsumed += len(payload)
            self._waiting.append((frame.call_id, payload))
            self._start_waiting()
        else:
            if frame.kind == Kind.MESSAGE:
                self._unconsumed += len(payload)
            self._owner.on_message(self, frame.kind, payload)
            if frame.kind == Kind.END:
                self._got_end = True
                return not self._sent_end  # both sides done: a clean close
        return True

    def _answer_error(self, call_id: int, code: str, message: str) -> None:
        """Answer a bad frame with an ERROR, through the credited queue; a peer that keeps
        sending bad frames without reading the answers is cut off."""
        if self._out_bytes > self._window + self._max_message:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "the peer sends but does not read")
        self.send(Kind.ERROR, call_id, encode_error(code, message))

    def _reject(self, frame: Frame, exc: FrameError) -> None:
        if self.mode == "server":
            self._answer_error(frame.call_id, exc.code, exc.message)
        elif self.mode == "client":
            sink = self._pending.pop(frame.call_id, None)
            if sink is not None:
                sink.fail(exc)
        else:
            self._owner.on_message(self, Kind.ERROR, encode_error(exc.code, exc.message))

    def _start_waiting(self) -> None:
        """Start waiting requests while handler slots are free and answers are not piling up
        unsent. A request's bytes stay counted as unconsumed until its answer is queued."""
        while (
            self._waiting
            and len(self._active) < self._max_concurrent
            and self._out_bytes <= self._window
            and not self.closed
        ):
            call_id, payload = self._waiting.popleft()
            if call_id in self._active:
                self.consumed(len(payload))
                error = encode_error(ErrorCode.PROTOCOL_ERROR, "call id already running")
                self.send(Kind.ERROR, call_id, error)
                continue
            self._active[call_id] = len(payload)
            self._owner.on_request(self, call_id, payload)
