"""`AsyncClient.generate`: an interactive generation session the client runs itself (the
session logic is `client.session`; this is the SDK's face of it: prompts, sampling options,
streaming text pieces, the `Generation` record)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

from client.core import ClientCore
from client.errors import (
    FusionAIError,
)
from client.routing import HttpRouter
from client.sampling import Sampler
from client.session import GenerationSession, generate
from client.text import TextStream
from client.types import (
    Failover,
    Generation,
    GenerationStream,
)

Array = np.ndarray[Any, Any]


class GenerationMethods(ClientCore):
    """Part of `AsyncClient` (what it uses of the other parts: `client/core.py`)."""

    # ---- generation ------------------------------------------------------------------------

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        *,
        stream: Literal[True] = ...,
        model: str | None = ...,
        seed: int | None = ...,
        stop: Sequence[str] = ...,
        on_failover: Callable[[Failover], None] | None = ...,
        adapter: str | Path | None = ...,
        verify: bool = ...,
    ) -> GenerationStream: ...

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        *,
        stream: Literal[False],
        model: str | None = ...,
        seed: int | None = ...,
        stop: Sequence[str] = ...,
        on_failover: Callable[[Failover], None] | None = ...,
        adapter: str | Path | None = ...,
        verify: bool = ...,
    ) -> Awaitable[Generation]: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        stream: bool = True,
        model: str | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        on_failover: Callable[[Failover], None] | None = None,
        adapter: str | Path | None = None,
        verify: bool = False,
    ) -> GenerationStream | Awaitable[Generation]:
        """Generate after `prompt` (text, or token ids). `temperature` 0 is greedy. With
        `stream=True` (default) returns a `GenerationStream` of text pieces; with
        `stream=False` an awaitable of the whole `Generation`. `adapter`: a fine-tune job's id
        or a safetensors adapter file, applied by the providers for this generation.
        `verify`: run every step also on a second provider holding the stage (a shadow step)
        and compare; a provider whose answer the broker then finds wrong is replaced, and
        `VerificationError` is raised when no one can be trusted."""
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError("max_new_tokens must be a positive integer")
        if isinstance(stop, str):
            stop = [stop]
        sampler = Sampler(temperature, top_p, seed)  # checks their ranges
        result = Generation()
        pieces = self._generate(
            prompt, max_new_tokens, sampler, model, stop, on_failover, result, adapter, verify
        )
        if stream:
            return GenerationStream(pieces, result)

        async def whole() -> Generation:
            async for _ in pieces:
                pass
            return result

        return whole()

    async def _generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        sampler: Sampler,
        model: str | None,
        stop: Sequence[str],
        on_failover: Callable[[Failover], None] | None,
        result: Generation,
        adapter: str | Path | None = None,
        verify: bool = False,
    ) -> AsyncIterator[str]:
        name = model or await self._default_model(decoder=True)
        client = await self.stages(name)
        tensors = await self._adapter_tensors(adapter, name) if adapter is not None else None
        if isinstance(prompt, str):
            if client.tokenizer is None:
                raise FusionAIError(f"model {name} ships no tokenizer: send token ids")
            ids = list(client.tokenizer.encode(prompt).ids)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt has no tokens")
        client.pad([ids])  # token ids outside the vocabulary or too many: a clear ValueError
        route = await self.model(name)
        keys = [s.key for s in route.stages]
        host = await self._p2p()

        def failed(pos: int, peer: str, reason: str) -> None:
            event = Failover(pos, peer, reason, time.monotonic())
            result.failovers.append(event)
            if on_failover is not None:
                on_failover(event)

        session = GenerationSession(
            host,
            client,
            keys,
            HttpRouter(self, name),
            timeout=self.timeout,
            on_failover=failed,
            adapters=tensors,
            verify=verify,
        )
        text = TextStream(client.tokenizer, stop, prefix=ids) if client.tokenizer else None
        tokens = generate(session, ids, max_new_tokens, sampler, eos=client.eos)
        try:
            async for token in tokens:
                result.tokens.append(token)
                result.token_times.append(time.monotonic())
                if text is None:
                    continue
                piece = text.push(token)
                if piece:
                    result.text += piece
                    yield piece
                if text.stopped:
                    break
            stopped = result.tokens[-1] == client.eos or (text is not None and text.stopped)
            result.finish_reason = "stop" if stopped else "length"
            if text is not None and (rest := text.finish()):
                result.text += rest
                yield rest
        finally:
            await tokens.aclose()
            result.route = [s.peer or "" for s in session.stages]
            result.checked, result.unchecked = session.checked, session.unchecked
            result.distrusted = sorted(session.distrusted)
            await session.close()
