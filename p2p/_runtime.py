"""The dedicated trio thread that runs every libp2p host of this process.

py-libp2p runs only under trio; our code runs under asyncio. One thread per process runs
`trio.run`, started by the first host and stopped when the last one closes, so a closed
process is left with no extra thread. asyncio calls in with `call_soon` (a synchronous callback
in the trio thread, ~tens of µs) or `run` (a coroutine whose result comes back through
`loop.call_soon_threadsafe`). Nothing outside `p2p/` sees trio.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import outcome
import trio

from p2p.errors import HostClosed

log = logging.getLogger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_runtime: TrioRuntime | None = None


class TrioRuntime:
    """A trio event loop in its own thread, with a nursery that hosts' tasks live in."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self.users = 0
        self._thread = threading.Thread(target=self._main, name="fusionai-p2p", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # surfaced to the starter, or logged at exit
            self._error = exc
            log.exception("the p2p trio thread stopped with an error")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        assert self._token is not None
        return self._token

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run the synchronous `fn(*args)` in the trio thread, soon. Thread-safe.

        An exception from `fn` is logged, never raised into trio: it would end the thread
        that every host of this process runs on.
        """
        try:
            self.token.run_sync_soon(_guarded, fn, args)
        except trio.RunFinishedError:
            raise HostClosed("the p2p runtime has stopped") from None

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start `fn(*args)` as a task in the runtime's nursery. Call only in the trio thread."""
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await the trio coroutine `fn(*args)` from asyncio; cancelling this cancels it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[outcome.Outcome[T]] = loop.create_future()
        scope = trio.CancelScope()

        def deliver(result: outcome.Outcome[T]) -> None:
            if not fut.done():
                fut.set_result(result)

        async def task() -> None:
            try:
                with scope:
                    value = await fn(*args)
                    post(loop, deliver, outcome.Value(value))
                    return
                post(loop, deliver, outcome.Error(asyncio.CancelledError()))
            except trio.Cancelled:
                post(loop, deliver, outcome.Error(HostClosed("the p2p host is closing")))
                raise
            except Exception as exc:
                post(loop, deliver, outcome.Error(exc))

        self.call_soon(self.spawn, task)
        try:
            result = await fut
        except asyncio.CancelledError:
            try:
                self.call_soon(scope.cancel)
            except HostClosed:
                pass
            raise
        return result.unwrap()

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the synchronous `fn(*args)` in the trio thread and wait for its result."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def _shutdown(self) -> None:
        if self._stop is not None:
            self.call_soon(self._stop.set)
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # pragma: no cover - only if a host refuses to die
            log.error("the p2p trio thread did not stop within 30 s")


def _guarded(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("a callback into the p2p thread failed")


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """`loop.call_soon_threadsafe(fn, *args)`, doing nothing if the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass


def acquire() -> TrioRuntime:
    """The process's runtime, started if needed; pair every call with `release()`."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = TrioRuntime()
        _runtime.users += 1
        return _runtime


def release(runtime: TrioRuntime) -> None:
    """Drop one use; the last one stops the trio thread and waits for it to exit."""
    global _runtime
    with _lock:
        runtime.users -= 1
        if runtime.users > 0:
            return
        if _runtime is runtime:
            _runtime = None
    runtime._shutdown()
