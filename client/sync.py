"""`Client`: the SDK's blocking twin of `AsyncClient`, for scripts and notebooks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import anyio
import numpy as np
from anyio.from_thread import start_blocking_portal

from client.api import AsyncClient
from client.errors import (
    FusionAIError,
)
from client.training import Trained
from client.types import FineTune, FinetuneStep, Generation, GenerationStream, Job
from ir.manifest import ModelManifest
from proto import api
from proto.api import TrainStep

Array = np.ndarray[Any, Any]
T = TypeVar("T")


class Client:
    """The blocking form of `AsyncClient`, with the same methods and arguments. It runs an
    event loop in a background thread (an anyio blocking portal); use it as a context
    manager or call `close()`."""

    def __init__(self, broker_url: str | None = None, api_key: str | None = None, **options: Any):
        self._async = AsyncClient(broker_url, api_key, **options)
        stack = contextlib.ExitStack()
        self._portal = stack.enter_context(
            start_blocking_portal(backend="asyncio", name="fusionai-client")
        )
        # Exits the portal at close(), or at interpreter exit for a client never closed:
        # exited later, while Python finalizes, it would wait forever for its frozen thread.
        self._stop = weakref.finalize(self, stack.close)
        self._loop_thread = self._portal.call(threading.get_ident)
        self._closed = False

    @property
    def url(self) -> str:
        return self._async.url

    def _run(self, coro: Awaitable[T]) -> T:
        if self._closed or threading.get_ident() == self._loop_thread:
            close = getattr(coro, "close", None)
            if close is not None:
                close()  # never started: no "never awaited" warning
            if self._closed:
                raise FusionAIError("the client is closed")
            raise FusionAIError("a blocking Client method was called from its own callback")
        future = self._portal.start_task_soon(_cancelled_once, coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. Ctrl-C in this thread: stop the work on the loop too
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._run(self._async.aclose())
        finally:
            self._closed = True
            # Stops the portal's loop; asyncio's runner then closes the generation streams
            # still open (they end their sessions) before closing the loop.
            self._stop()

    def swarm(self) -> api.Swarm:
        return self._run(self._async.swarm())

    def default_model(self, decoder: bool = True) -> str:
        return self._run(self._async.default_model(decoder))

    def manifest(self, name: str) -> ModelManifest:
        return self._run(self._async.manifest(name))

    def models(self) -> list[api.ModelCard]:
        return self._run(self._async.models())

    def model(self, name: str) -> api.Model:
        return self._run(self._async.model(name))

    def add_model(self, directory: Path | str, **options: Any) -> api.Model:
        return self._run(self._async.add_model(directory, **options))

    def embed(self, texts: str | Sequence[str], *, model: str | None = None) -> Array:
        return self._run(self._async.embed(texts, model=model))

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        *,
        stream: Literal[True] = ...,
        **options: Any,
    ) -> SyncGenerationStream: ...

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        *,
        stream: Literal[False],
        **options: Any,
    ) -> Generation: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        stream: bool = True,
        **options: Any,
    ) -> SyncGenerationStream | Generation:
        """As `AsyncClient.generate`: an iterator of text pieces, or the whole `Generation`."""
        if not stream:
            return self._run(
                self._async.generate(
                    prompt, max_new_tokens, temperature, top_p, stream=False, **options
                )
            )
        pieces = self._async.generate(
            prompt, max_new_tokens, temperature, top_p, stream=True, **options
        )
        return SyncGenerationStream(self, pieces)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        stream: bool = True,
        **options: Any,
    ) -> SyncGenerationStream | Generation:
        """As `AsyncClient.chat`: an iterator of text pieces, or the whole `Generation`."""
        if not stream:
            return self._run(
                self._async.chat(
                    messages, max_new_tokens, temperature, top_p, stream=False, **options
                )
            )
        pieces = self._async.chat(messages, max_new_tokens, temperature, top_p, **options)
        return SyncGenerationStream(self, pieces)

    def submit(self, job: Mapping[str, Any] | api.JobRequest) -> Job:
        return self._run(self._async.submit(job))

    def jobs(self, *, limit: int = 100) -> list[Job]:
        return self._run(self._async.jobs(limit=limit))

    def job(self, job_id: str, *, wait: float = 0.0) -> Job:
        return self._run(self._async.job(job_id, wait=wait))

    def story(self, job_id: str) -> api.Story:
        return self._run(self._async.story(job_id))

    def cancel(self, job_id: str) -> Job:
        return self._run(self._async.cancel(job_id))

    def wait(self, job_id: str, **options: Any) -> Job:
        return self._run(self._async.wait(job_id, **options))

    def finetune(self, model: str, data: str | Path | Sequence[str], **options: Any) -> FineTune:
        return self._run(self._async.finetune(model, data, **options))

    def finetune_steps(self, job_id: str, **options: Any) -> list[FinetuneStep]:
        return self._run(self._async.finetune_steps(job_id, **options))

    def train(self, model: str, data: str | Path | Sequence[str], **options: Any) -> Trained:
        return self._run(self._async.train(model, data, **options))

    def train_steps(self, job_id: str, **options: Any) -> list[TrainStep]:
        return self._run(self._async.train_steps(job_id, **options))

    def adapter(self, job_id: str) -> Path:
        return self._run(self._async.adapter(job_id))

    def results(self, job_id: str, **options: Any) -> Array:
        return self._run(self._async.results(job_id, **options))


class SyncGenerationStream:
    """Text pieces of a generation, iterated from blocking code; `result` as in
    `GenerationStream`. Breaking out early and calling `close()` ends the sessions."""

    def __init__(self, client: Client, stream: GenerationStream) -> None:
        self._client = client
        self._stream = stream
        self._iter = stream.__aiter__()
        self.result = stream.result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return self._client._run(_anext(self._iter))
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._client._run(self._stream.aclose())


async def _anext(pieces: AsyncIterator[str]) -> str:
    """The next piece. `__anext__` is called here, on the loop's thread, so that the loop
    knows the generator and closes it (ending its sessions) when the client closes."""
    return await pieces.__anext__()


async def _cancelled_once(coro: Awaitable[T]) -> T:
    """Await `coro` in a task of its own, which a cancellation of this call (Ctrl-C in the
    calling thread) cancels once, as asyncio does: its cleanup (closing generation
    sessions) then runs to the end, where the portal's cancel scope would cancel each of
    its awaits again."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([task])
        raise
