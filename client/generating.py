"""`AsyncClient.generate`: an interactive generation session the client runs itself (the
session logic is `client.session`; this is the SDK's face of it: prompts, sampling options,
streaming text pieces, the `Generation` record)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
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
from client.stages import ClientStages
from client.text import TextStream
from client.types import (
    Failover,
    Generation,
    GenerationStream,
)
from client.verifying import verify_generation
from ir.chat import ChatError, render

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render with the model's chat template once its package is here."""

    messages: list[dict[str, str]]


def chat_ids(client: ClientStages, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The prompt token ids of a conversation: rendered by the model's chat template (with the
    generation prompt), tokenized as the template wrote it (no special tokens added)."""
    manifest = client.manifest
    if manifest.chat_template is None:
        raise FusionAIError(f"model {manifest.name} has no chat template: use generate")
    if client.tokenizer is None:
        raise FusionAIError(f"model {manifest.name} ships no tokenizer: no chat")
    try:
        text = render(manifest.chat_template, messages, manifest.special_tokens)
    except ChatError as exc:
        raise FusionAIError(str(exc)) from None
    return list(client.tokenizer.encode(text, add_special_tokens=False).ids)


class GenerationMethods(ClientCore):
    """Part of `AsyncClient` (what it uses of the other parts: `client/core.py`)."""

    # ---- generation ------------------------------------------------------------------------

    @overload
    def generate(
        self,
        prompt: str | Sequence[int] | ChatPrompt,
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
        prompt: str | Sequence[int] | ChatPrompt,
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
        prompt: str | Sequence[int] | ChatPrompt,
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
        return self._answer(pieces, result, stream)

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        *,
        stream: Literal[True] = ...,
        **options: Any,
    ) -> GenerationStream: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        *,
        stream: Literal[False],
        **options: Any,
    ) -> Awaitable[Generation]: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        stream: bool = True,
        **options: Any,
    ) -> GenerationStream | Awaitable[Generation]:
        """The assistant's next message after `messages` (`[{"role": "user", "content":
        "..."}, ...]`, roles system, user and assistant), answered as `generate` answers (the
        same `options`: model, seed, stop, on_failover, adapter, verify): the model's chat
        template renders the conversation with the generation prompt, and the answer ends at
        any of the model's end-of-turn tokens. A model without a chat template raises
        `FusionAIError`."""
        conversation = [dict(m) for m in messages]
        if not conversation:
            raise ValueError("no messages")
        for i, m in enumerate(conversation):
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(
                m.get("content"), str
            ):
                raise ValueError(
                    f"messages[{i}] must have a role (system, user, assistant) and text content"
                )
        prompt = ChatPrompt(conversation)
        if stream:
            return self.generate(prompt, max_new_tokens, temperature, top_p, **options)
        return self.generate(prompt, max_new_tokens, temperature, top_p, stream=False, **options)

    @staticmethod
    def _answer(
        pieces: AsyncIterator[str], result: Generation, stream: bool
    ) -> GenerationStream | Awaitable[Generation]:
        if stream:
            return GenerationStream(pieces, result)

        async def whole() -> Generation:
            async for _ in pieces:
                pass
            return result

        return whole()

    async def _generate(
        self,
        prompt: str | Sequence[int] | ChatPrompt,
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
        if isinstance(prompt, ChatPrompt):
            ids = chat_ids(client, prompt.messages)
        elif isinstance(prompt, str):
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
            mux=self._mux,
            chains=self._chains,
        )
        text = TextStream(client.tokenizer, stop, prefix=ids) if client.tokenizer else None
        tokens = generate(session, ids, max_new_tokens, sampler, stops=client.stops)
        finished = False
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
            stopped = result.tokens[-1] in client.stops or (text is not None and text.stopped)
            result.finish_reason = "stop" if stopped else "length"
            if text is not None and (rest := text.finish()):
                result.text += rest
                yield rest
            finished = True
        finally:
            await tokens.aclose()
            result.route = [s.peer or "" for s in session.stages]
            result.checked, result.unchecked = session.checked, session.unchecked
            result.distrusted = sorted(session.distrusted)
            result.chained = session.chained
            await session.close()
        checked = finished and tensors is None and not verify  # (an adapter: not the model's)
        if checked and self._verify_rng.random() < self.verify_share:
            await verify_generation(self, name, session, result)
