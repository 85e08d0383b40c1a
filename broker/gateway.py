"""OpenAI-style endpoints: `POST /v1/embeddings` and `POST /v1/completions` (with `stream`).

Requests and answers have the shapes the `openai` Python package sends and reads, so an
OpenAI client works by changing its base URL. Embeddings run at once through the swarm (the
job runner's graph walk, with its retries; nothing queued or stored). Completions open a
generation session along the model's route (`client.session`): the broker runs the tokenizer,
the embedding stage, the head and the sampling, providers run the blocks with their KV caches,
and a provider lost mid-answer is replaced without changing the text.

Fields the swarm does not implement (`logprobs`, `echo`, penalties, `n` > 1, ...) are refused
with 400 naming the field, rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp_sse import EventSourceResponse

from broker.admission import Admission, Limits, tokens_of_texts
from broker.config import BrokerConfig
from broker.embedjobs import EmbedJobs
from broker.errors import NotFound, Unavailable
from broker.events import EventLog
from broker.httpkit import answer, event_stream, sse
from broker.jobkinds import JobError
from broker.metrics import Metrics
from broker.models import ModelStore
from broker.openai import Completion, parse_chat, parse_completion, parse_input
from broker.registry import Registry
from broker.serving import Serving
from broker.verify import Verifier
from client.errors import GenerationError
from client.sampling import Sampler
from client.session import GenerationSession, generate
from client.stages import CHARS_PER_TOKEN, DEFAULT_MAX_TOKENS, ClientStageError, ClientStages
from client.stepmux import StepMux
from client.text import TextStream
from ir.chat import ChatError, render
from p2p import Host
from proto.api import openai as oa

log = logging.getLogger("fusionai.broker")
CHAT_MAX_TOKENS = 4096  # a chat answer without max_tokens: the rest of the context, at most this


@dataclass(frozen=True)
class Parts:
    """What the gateway uses of the broker, handed over by the composition root."""

    config: BrokerConfig
    serving: Serving
    registry: Registry
    models: ModelStore
    verifier: Verifier
    embeds: EmbedJobs
    metrics: Metrics
    events: EventLog
    host: Host
    inflight: dict[str, int]  # stage requests outstanding per provider (shared with jobs)
    using: Callable[[str], AbstractContextManager[None]]  # a model in interactive use
    stopping: Callable[[], bool]
    rng: random.Random  # who checks a generation step: unpredictable


class BrokerRouter:
    """Routes for generation sessions the broker runs itself (`client.session.Router`)."""

    def __init__(self, parts: Parts, model: str, load: dict[str, int]) -> None:
        self.parts = parts
        self.model = model
        self.load = load

    async def pick(self, pos: int, avoid: set[str]) -> str:
        timeout = self.parts.config.request_timeout_s
        peer = await self.parts.serving.pick(self.model, pos, avoid, self.load, timeout)
        if peer is None:
            raise GenerationError(
                f"no provider has served stage {pos} of {self.model} for {timeout:.0f} s"
            )
        return peer

    async def failed(self, pos: int, peer: str, reason: str) -> None:
        await self.parts.serving.suspect(peer, f"a generation step failed: {reason}")

    def lost(self, peer: str) -> asyncio.Event | None:
        return self.parts.registry.lost_event(peer)

    async def checker(self, pos: int, avoid: set[str]) -> str | None:
        plan = self.parts.serving.plans[self.model]
        key = self.parts.serving.unit_keys(plan)[pos]
        holders = self.parts.registry.holders(key, avoid)
        return self.parts.rng.choice(holders) if holders else None  # unpredictable checkers

    async def distrust(self, pos: int, key: str, peer: str, reason: str) -> bool:
        return (await self.parts.verifier.report(peer, self.model, pos, reason))[1]


class Gateway:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        # concurrent completions' steps to a provider travel together, and their embeddings
        # and heads run in batches (client.stepmux)
        self.mux = StepMux(parts.host)
        config = parts.config
        self.admission = Admission(
            Limits(
                config.max_interactive,
                config.max_reading_bytes,
                config.max_work_tokens,
                config.max_body_bytes,
            )
        )

    # ---- embeddings ------------------------------------------------------------------------

    async def embeddings(self, body: oa.EmbeddingRequest) -> oa.EmbeddingList:
        model = body.model
        texts, ids = parse_input(body.input, "input")
        fmt, dims = body.encoding_format or "float", body.dimensions
        work = (
            tokens_of_texts(texts, DEFAULT_MAX_TOKENS) if texts else sum(len(i) for i in ids or [])
        )
        with self._interactive("embeddings", work):
            vectors, tokens = await self.parts.embeds.embed_now(model, texts, ids)
        if dims is not None and dims != vectors.shape[1]:
            raise JobError("dimensions", f"{model} gives {vectors.shape[1]} dimensions only")
        data = []
        for i, row in enumerate(vectors):
            value: Any = (
                base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode()
                if fmt == "base64"
                else row.tolist()
            )
            data.append(oa.Embedding(i, value))
        return oa.EmbeddingList(data, model, oa.Usage(prompt_tokens=tokens, total_tokens=tokens))

    # ---- completions -----------------------------------------------------------------------

    async def _decoder(self, model: str) -> ClientStages:
        """The client stages of a stored decoder with a tokenizer (else a clear error)."""
        if self.parts.models.models.get(model) is None:
            raise NotFound(f"no model named {model!r}")
        client = await asyncio.to_thread(self.parts.models.client, model)
        if not client.decoder:
            raise JobError("model", f"{model} is an encoder; use /v1/embeddings")
        if client.tokenizer is None:
            raise JobError(
                "model", f"{model} ships no tokenizer (or `tokenizers` is missing): no text"
            )
        return client

    @staticmethod
    def _fitted(req: Completion, client: ClientStages, prompts: list[list[int]]) -> Completion:
        """`req` with its max_tokens (0: the rest of the context), checked to fit."""
        limit = int(client.manifest.config.get("max_positions", 0) or 0)
        longest = max(len(p) for p in prompts)
        if not req.max_tokens:
            room = (limit or longest + CHAT_MAX_TOKENS) - longest
            if room < 1:
                raise JobError("messages", f"the prompt fills the model's {limit} tokens")
            return dataclasses.replace(req, max_tokens=min(room, CHAT_MAX_TOKENS))
        if limit and longest + req.max_tokens > limit:
            raise JobError(
                "max_tokens",
                f"the prompt ({longest} tokens) plus max_tokens ({req.max_tokens}) exceeds "
                f"the model's context of {limit} tokens",
            )
        return req

    @contextlib.contextmanager
    def _interactive(self, kind: str, tokens: int) -> Iterator[None]:
        """Admitted with at most `tokens` tokens of work (else `TooBusy`), and timed."""
        with self.admission.working(tokens):
            start = time.perf_counter()
            try:
                yield
            finally:
                self.parts.metrics.interactive(kind, time.perf_counter() - start)

    async def completions(
        self, request: web.Request, body: oa.CompletionRequest
    ) -> web.StreamResponse:
        req = parse_completion(body)
        client = await self._decoder(req.model)
        context = _context(client)
        for i, text in enumerate(req.prompts or []):
            _check_chars(text, context, f"prompt[{i}]" if len(req.prompts or []) > 1 else "prompt")
        many = len(req.prompts or req.prompt_ids or [])
        work = tokens_of_texts(req.prompts or [], context) + sum(map(len, req.prompt_ids or []))
        with self._interactive("completions", work + many * (req.max_tokens or context)):
            prompts = await asyncio.to_thread(self._prompt_ids, client, req)
            req = self._fitted(req, client, prompts)
            cid = "cmpl-" + uuid.uuid4().hex[:24]
            created = int(time.time())
            if req.stream:
                return await self._stream(request, req, client, prompts, cid, created)
            choices, generated = [], 0
            for index, prompt in enumerate(prompts):
                text, reason, n = "", "length", 0
                async with contextlib.aclosing(self._run(req, client, prompt)) as pieces:
                    async for piece, finish, count in pieces:
                        text += piece
                        reason, n = finish or reason, count
                choices.append(oa.Choice(text, index, reason))  # type: ignore[arg-type]
                generated += n
            usage = _usage(sum(len(p) for p in prompts), generated)
            return answer(oa.Completion(cid, created, req.model, choices, usage))

    async def chat(
        self, request: web.Request, body: oa.ChatCompletionRequest
    ) -> web.StreamResponse:
        """The messages rendered by the model's chat template (sandboxed, as transformers
        renders it with `add_generation_prompt`), then a completion of that text that stops
        at any of the model's end-of-turn tokens."""
        req, messages = parse_chat(body)
        client = await self._decoder(req.model)
        manifest = client.manifest
        if manifest.chat_template is None:
            raise JobError(
                "model", f"{req.model} has no chat template: use /v1/completions with a prompt"
            )
        context = _context(client)
        with self._interactive("chat", context + (req.max_tokens or context)):
            try:
                text = await asyncio.to_thread(
                    render, manifest.chat_template, messages, manifest.special_tokens
                )
            except ChatError as exc:
                raise JobError("messages", str(exc)) from None
            _check_chars(text, context, "messages")
            prompt = await asyncio.to_thread(
                lambda: client.tokenizer.encode(text, add_special_tokens=False).ids
            )
            if not prompt:
                raise JobError("messages", "the conversation renders to no tokens")
            req = self._fitted(req, client, [prompt])
            cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
            if req.stream:
                return await self._stream(request, req, client, [prompt], cid, created, chat=True)
            content, reason, n = "", "length", 0
            async with contextlib.aclosing(self._run(req, client, prompt)) as pieces:
                async for piece, finish, n in pieces:  # noqa: B007 (n: after)
                    content += piece
                    reason = finish or reason
            choice = oa.ChatChoice(0, oa.AssistantMessage(content), reason)  # type: ignore[arg-type]
            usage = _usage(len(prompt), n)
            return answer(oa.ChatCompletion(cid, created, req.model, [choice], usage))

    def _prompt_ids(self, client: ClientStages, req: Completion) -> list[list[int]]:
        if req.prompt_ids is not None:
            try:
                client.pad(req.prompt_ids)  # checks the ids are in the vocabulary
            except ClientStageError as exc:
                raise JobError("prompt", str(exc)) from None
            return req.prompt_ids
        out = [e.ids for e in client.tokenizer.encode_batch(req.prompts or [])]
        if any(not ids for ids in out):
            raise JobError("prompt", "a prompt encodes to no tokens")
        return out

    async def _run(
        self, req: Completion, client: ClientStages, prompt: list[int]
    ) -> AsyncGenerator[tuple[str, str | None, int]]:
        """(text piece, finish reason once finished, tokens so far) as the answer grows."""
        parts = self.parts
        keys = parts.serving.unit_keys(parts.serving.plans[req.model])
        sid = uuid.uuid4().hex[:12]

        def on_failover(pos: int, peer: str, reason: str) -> None:
            parts.events.emit(
                "session_failover", peer=peer, session=sid, stage=keys[pos], reason=reason
            )
            parts.metrics.failover("session_retry")

        session = GenerationSession(
            parts.host,
            client,
            keys,
            BrokerRouter(parts, req.model, parts.inflight),
            timeout=parts.config.request_timeout_s,
            max_attempts=parts.config.max_attempts,
            on_failover=on_failover,
            mux=self.mux,
        )
        text = TextStream(client.tokenizer, req.stop, prefix=prompt)
        sampler = Sampler(req.temperature, req.top_p, req.seed)
        count = 0
        tokens = generate(session, prompt, req.max_tokens, sampler, stops=client.stops)
        try:
            with parts.using(req.model):  # no rebalancing under an open session
                async for token in tokens:
                    if parts.stopping():
                        raise Unavailable("the broker is shutting down")
                    count += 1
                    piece = text.push(token)
                    if token in client.stops or text.stopped:
                        yield piece + text.finish(), "stop", count
                        return
                    yield piece, None, count
                yield text.finish(), "length", count
        except GenerationError as exc:
            raise Unavailable(str(exc)) from None
        finally:
            await tokens.aclose()
            await session.close()
            parts.metrics.tokens(req.model, count)

    async def _stream(
        self,
        request: web.Request,
        req: Completion,
        client: ClientStages,
        prompts: list[list[int]],
        cid: str,
        created: int,
        *,
        chat: bool = False,
    ) -> web.StreamResponse:
        """Completion chunks (or chat completion chunks: the role first, then text deltas,
        then the finish reason) as server-sent events."""

        def chunk(index: int, piece: str | None, finish: Any, role: Any = None) -> Any:
            if chat:
                delta = oa.Delta(role=role, content=piece)
                return oa.ChatCompletionChunk(
                    cid, created, req.model, [oa.ChunkChoice(index, delta, finish)]
                )
            return oa.Completion(cid, created, req.model, [oa.Choice(piece or "", index, finish)])

        async def body(resp: EventSourceResponse) -> None:
            generated = 0
            try:
                for index, prompt in enumerate(prompts):
                    count = 0
                    if chat:
                        await sse(resp, None, chunk(index, "", None, "assistant"))
                    async with contextlib.aclosing(self._run(req, client, prompt)) as pieces:
                        async for piece, finish, count in pieces:  # noqa: B007 (count: after)
                            if not chat and (piece or finish):
                                await sse(resp, None, chunk(index, piece, finish))
                                continue
                            if piece:
                                await sse(resp, None, chunk(index, piece, None))
                            if finish:  # chat: the finish reason in a chunk of its own
                                await sse(resp, None, chunk(index, None, finish))
                    generated += count
            except Exception as exc:  # headers are sent: report the error in the stream
                if isinstance(exc, ConnectionResetError) or request.transport is None:
                    raise  # the client left or stopped reading: `event_stream` drops it
                kind = "unavailable" if isinstance(exc, Unavailable) else "internal_error"
                if kind == "internal_error":
                    log.exception("completion stream %s failed", cid)
                await sse(resp, None, {"error": {"message": str(exc), "type": kind}})
                return
            if req.include_usage:
                usage = _usage(sum(len(p) for p in prompts), generated)
                shape = oa.ChatCompletionChunk if chat else oa.Completion
                await sse(resp, None, shape(cid, created, req.model, [], usage))
            await sse(resp, None, "[DONE]")

        return await event_stream(request, body)


def _context(client: ClientStages) -> int:
    """The model's context in tokens (the client stages' cut when the model names none)."""
    return int(client.manifest.config.get("max_positions", 0) or 0) or client.max_tokens


def _check_chars(text: str, context: int, field: str) -> None:
    """Refuse, before tokenizing, a text longer than any that fits the model's context."""
    if len(text) > context * CHARS_PER_TOKEN:
        raise JobError(
            field,
            f"{len(text)} characters: more than fit the model's context of {context} tokens "
            f"(at most {context * CHARS_PER_TOKEN} characters)",
        )


def _usage(prompt: int, completion: int) -> oa.Usage:
    return oa.Usage(prompt, prompt + completion, completion)
