"""`Client`: the SDK's blocking twin of `AsyncClient`, for scripts and notebooks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import numpy as np

from client.api import AsyncClient
from client.errors import (
    FusionAIError,
)
from client.types import FineTune, FinetuneStep, Generation, GenerationStream, Job

Array = np.ndarray[Any, Any]
T = TypeVar("T")


class Client:
    """The blocking form of `AsyncClient`, with the same methods and arguments. It runs an
    event loop in a background thread; use it as a context manager or call `close()`."""

    def __init__(self, broker_url: str | None = None, api_key: str | None = None, **options: Any):
        self._async = AsyncClient(broker_url, api_key, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fusionai-client", daemon=True
        )
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        return self._async.url

    def _run(self, coro: Awaitable[T]) -> T:
        if self._closed or threading.current_thread() is self._thread:
            close = getattr(coro, "close", None)
            if close is not None:
                close()  # never started: no "never awaited" warning
            if self._closed:
                raise FusionAIError("the client is closed")
            raise FusionAIError("a blocking Client method was called from its own callback")

        async def call() -> T:
            return await coro

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
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
            future = asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop)
            future.result(timeout=10)  # open generation streams close their sessions
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    def swarm(self) -> dict[str, Any]:
        return self._run(self._async.swarm())

    def models(self) -> list[dict[str, Any]]:
        return self._run(self._async.models())

    def model(self, name: str) -> dict[str, Any]:
        return self._run(self._async.model(name))

    def add_model(self, directory: Path | str, **options: Any) -> dict[str, Any]:
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

    def submit(self, job: Mapping[str, Any]) -> Job:
        return self._run(self._async.submit(job))

    def job(self, job_id: str) -> Job:
        return self._run(self._async.job(job_id))

    def cancel(self, job_id: str) -> Job:
        return self._run(self._async.cancel(job_id))

    def wait(self, job_id: str, **options: Any) -> Job:
        return self._run(self._async.wait(job_id, **options))

    def finetune(self, model: str, data: str | Path | Sequence[str], **options: Any) -> FineTune:
        return self._run(self._async.finetune(model, data, **options))

    def finetune_steps(self, job_id: str, **options: Any) -> list[FinetuneStep]:
        return self._run(self._async.finetune_steps(job_id, **options))

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
            return self._client._run(self._iter.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._client._run(self._stream.aclose())
