"""OpenAI-style endpoints: `POST /v1/embeddings` and `POST /v1/completions` (with `stream`).

Requests and answers have the shapes the `openai` Python package sends and reads, so an
OpenAI client works by changing its base URL. Embeddings run at once through the swarm (the
job runner's graph walk, with its retries; nothing queued or stored). Completions open a
generation session along the model's route (`client.session`): the broker runs the tokenizer,
the embedding stage, the head and the sampling, providers run the blocks with their KV caches,
and a provider lost mid-answer is replaced without changing the text.

A sampled share of answers (`verify_share`) is checked against the providers' commitments
(`broker/commitcheck.py`): its finish chunk (or whole answer) carries the `verification`.

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
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, NamedTuple, Protocol

import msgspec
import numpy as np
from aiohttp import web
from aiohttp_sse import EventSourceResponse

from broker.admission import Admission, Limits, tokens_of_texts
from broker.errors import Unavailable
from broker.httpkit import answer, event_stream, presented_key, sse
from broker.jobkinds import JobError
from broker.openai import Completion, parse_chat, parse_completion, parse_input
from client.chained import inbox_of
from client.errors import GenerationError
from client.sampling import Sampler
from client.session import GenerationSession, Router, generate
from client.stages import CHARS_PER_TOKEN, DEFAULT_MAX_TOKENS, ClientStageError, ClientStages
from client.stepmux import StepMux
from client.text import TextStream
from client.verifying import failed_check, verify_request, with_withheld
from ir.chat import ChatError, render
from p2p import Host
from proto.api import openai as oa
from proto.api.swarm import Verdict, VerifyRequest

log = logging.getLogger("fusionai.broker")
CHAT_MAX_TOKENS = 4096  # a chat answer without max_tokens: the rest of the context, at most this


class Backend(Protocol):
    """What the OpenAI endpoints use of the swarm: the broker's own parts in a one-machine
    setup (`broker.local_gateway`), or the broker's HTTP API from a gateway process
    (`gateway.remote`)."""

    host: Host
    limits: Limits  # this process's own bound on work in progress
    timeout_s: float  # a stage request's
    max_attempts: int  # providers tried for a stage before a session fails
    verify_share: float  # of answers whose providers' commitments the broker checks

    async def decoder(self, model: str) -> ClientStages:
        """The model's client stages (`NotFound` for an unknown model)."""
        ...

    async def stage_keys(self, model: str) -> list[str]: ...

    def router(self, model: str) -> Router: ...

    async def embed(
        self, model: str, texts: list[str] | None, ids: list[list[int]] | None
    ) -> tuple[np.ndarray[Any, Any], int]: ...

    def admit(
        self, key: str | None, model: str, session: bool
    ) -> AbstractAsyncContextManager[None]:
        """Held while one request's work runs: a lease under the key's limits and, for a
        generation `session`, the model's batch slots (`TooBusy` when over one)."""
        ...

    def stopping(self) -> bool: ...

    async def verify(self, model: str, body: VerifyRequest) -> Verdict:
        """The broker's check of a finished session's commitments (`broker.commitcheck`)."""
        ...

    def served(self, endpoint: str, model: str, seconds: float) -> None:
        """One request answered: its endpoint, model and latency."""
        ...

    def generated(self, model: str, tokens: int) -> None:
        """A session ended having generated `tokens`."""
        ...

    def failover(self, model: str, session: str, stage: str, peer: str, reason: str) -> None:
        """A session's provider was replaced."""
        ...


class Gateway:
    def __init__(self, backend: Backend, batching: bool = True) -> None:
        self.backend = backend
        # concurrent completions' steps to a provider travel together, and their embeddings
        # and heads run in batches (client.stepmux), unless not `batching`
        self.mux = StepMux(backend.host) if batching else None
        # and chained, those along the same providers as one message a hop (client.chained)
        self.chains = inbox_of(backend.host) if batching else None
        self.admission = Admission(backend.limits)
        self.sampling = random.SystemRandom()  # which answers are checked: unpredictable

    # ---- embeddings ------------------------------------------------------------------------

    async def embeddings(self, request: web.Request, body: oa.EmbeddingRequest) -> oa.EmbeddingList:
        model = body.model
        texts, ids = parse_input(body.input, "input")
        fmt, dims = body.encoding_format or "float", body.dimensions
        work = (
            tokens_of_texts(texts, DEFAULT_MAX_TOKENS) if texts else sum(len(i) for i in ids or [])
        )
        async with self._interactive(request, "embeddings", model, work):
            vectors, tokens = await self.backend.embed(model, texts, ids)
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
        client = await self.backend.decoder(model)
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

    @contextlib.asynccontextmanager
    async def _interactive(
        self, request: web.Request, kind: str, model: str, tokens: int
    ) -> AsyncIterator[None]:
        """Admitted here with at most `tokens` tokens of work, and under the key's and the
        model's limits (else `TooBusy`), and timed."""
        with self.admission.working(tokens):
            session = kind != "embeddings"
            async with self.backend.admit(presented_key(request), model, session):
                start = time.perf_counter()
                try:
                    yield
                finally:
                    self.backend.served(kind, model, time.perf_counter() - start)

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
        budget = work + many * (req.max_tokens or context)
        async with self._interactive(request, "completions", req.model, budget):
            prompts = await asyncio.to_thread(self._prompt_ids, client, req)
            req = self._fitted(req, client, prompts)
            cid = "cmpl-" + uuid.uuid4().hex[:24]
            created = int(time.time())
            if req.stream:
                return await self._stream(request, req, client, prompts, cid, created)
            choices, generated, checked = [], 0, []
            for index, prompt in enumerate(prompts):
                text, reason, n, verdict = await self._whole(req, client, prompt)
                choices.append(oa.Choice(text, index, reason))  # type: ignore[arg-type]
                generated += n
                checked += [oa.Verification(index, verdict)] if verdict else []
            usage = _usage(sum(len(p) for p in prompts), generated)
            made = checked or msgspec.UNSET
            return answer(oa.Completion(cid, created, req.model, choices, usage, verification=made))

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
        budget = context + (req.max_tokens or context)
        async with self._interactive(request, "chat", req.model, budget):
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
            content, reason, n, verdict = await self._whole(req, client, prompt)
            choice = oa.ChatChoice(0, oa.AssistantMessage(content), reason)  # type: ignore[arg-type]
            usage = _usage(len(prompt), n)
            made = [oa.Verification(0, verdict)] if verdict else msgspec.UNSET
            return answer(
                oa.ChatCompletion(cid, created, req.model, [choice], usage, verification=made)
            )

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

    async def _whole(
        self, req: Completion, client: ClientStages, prompt: list[int]
    ) -> tuple[str, str, int, Verdict | None]:
        """An answer not streamed: its text, finish reason, tokens and check (if sampled)."""
        text, reason, n, verdict = "", "length", 0, None
        async with contextlib.aclosing(self._run(req, client, prompt)) as pieces:
            async for got in pieces:
                text += got.text
                reason, n = got.finish or reason, got.tokens
                verdict = got.verdict or verdict
        return text, reason, n, verdict

    async def _run(
        self, req: Completion, client: ClientStages, prompt: list[int]
    ) -> AsyncGenerator[Piece]:
        """The answer as it grows, a piece a token."""
        backend = self.backend
        keys = await backend.stage_keys(req.model)
        sid = uuid.uuid4().hex[:12]

        def on_failover(pos: int, peer: str, reason: str) -> None:
            backend.failover(req.model, sid, keys[pos], peer, reason)

        session = GenerationSession(
            backend.host, client, keys, backend.router(req.model), timeout=backend.timeout_s,
            max_attempts=backend.max_attempts, on_failover=on_failover, mux=self.mux,
            chains=self.chains,
        )  # fmt: skip
        text = TextStream(client.tokenizer, req.stop, prefix=prompt)
        sampler = Sampler(req.temperature, req.top_p, req.seed)
        # a checked answer's finish waits for the check (its last commitments come with the
        # session's close), so that the finish chunk can carry the verdict
        checked = self.sampling.random() < backend.verify_share
        count, finish = 0, None
        tokens = generate(session, prompt, req.max_tokens, sampler, stops=client.stops)
        last = time.perf_counter()
        try:
            async for token in tokens:  # (the lease holds the model: no rebalancing)
                if backend.stopping():
                    raise Unavailable("the gateway is shutting down")
                count += 1
                route = None
                if req.include_route:  # (who ran it: only when asked, not a cost a token)
                    now = time.perf_counter()
                    peers = [s.peer or "" for s in session.stages]
                    route = oa.TokenRoute(peers, round(1e3 * (now - last), 2))
                    last = now
                piece = text.push(token)
                if token in client.stops or text.stopped:
                    finish = "stop"
                    piece += text.finish()
                    yield Piece(piece, None if checked else finish, count, route)
                    break
                yield Piece(piece, None, count, route)
            else:
                finish, rest = "length", text.finish()
                if rest or not checked:
                    yield Piece(rest, None if checked else finish, count, None)
        except GenerationError as exc:
            raise Unavailable(str(exc)) from None
        finally:
            await tokens.aclose()
            await session.close()
            backend.generated(req.model, count)
        if checked and finish is not None:
            yield Piece("", finish, count, None, await self._verify(req.model, session))

    async def _verify(self, model: str, session: GenerationSession) -> Verdict | None:
        """The broker's check of a finished answer's commitments, and of their being whole
        (None: nothing to check, or the broker could not; the answer stands either way)."""
        body = verify_request(session)
        verdict: Verdict | None = None
        try:  # (bounded: the answer's finish and its lease wait for it)
            if body is not None:
                verdict = await asyncio.wait_for(
                    self.backend.verify(model, body), self.backend.timeout_s
                )
        except Exception as exc:  # (a check that cannot run, or in time, fails no answer)
            log.warning("the broker could not check an answer of %s: %s", model, exc)
        verdict = with_withheld(model, session, verdict)
        if verdict is not None and not verdict.ok:
            log.warning("%s", failed_check(model, verdict))
        return verdict

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

        def chunk(
            index: int,
            piece: str | None,
            finish: Any,
            role: Any = None,
            route: Any = None,
            verdict: Verdict | None = None,
        ) -> Any:
            made = route if route is not None else msgspec.UNSET
            checked = [oa.Verification(index, verdict)] if verdict else msgspec.UNSET
            if chat:
                delta = oa.Delta(role=role, content=piece)
                choice = oa.ChunkChoice(index, delta, finish)
                return oa.ChatCompletionChunk(
                    cid, created, req.model, [choice], fusionai=made, verification=checked
                )
            choices = [oa.Choice(piece or "", index, finish)]
            return oa.Completion(
                cid, created, req.model, choices, fusionai=made, verification=checked
            )

        async def body(resp: EventSourceResponse) -> None:
            generated = 0
            try:
                for index, prompt in enumerate(prompts):
                    count = 0
                    if chat:
                        await sse(resp, None, chunk(index, "", None, "assistant"))
                    async with contextlib.aclosing(self._run(req, client, prompt)) as pieces:
                        async for got in pieces:
                            piece, finish, count = got.text, got.finish, got.tokens
                            routed = got.route is not None
                            checked = got.verdict
                            if not chat and (piece or finish or routed):
                                made = chunk(index, piece, finish, None, got.route, checked)
                                await sse(resp, None, made)
                                continue
                            if piece or routed:
                                await sse(resp, None, chunk(index, piece, None, None, got.route))
                            if finish:  # chat: the finish reason in a chunk of its own
                                await sse(
                                    resp, None, chunk(index, None, finish, None, None, checked)
                                )
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


class Piece(NamedTuple):
    """A token's part of an answer: its text (may be empty until a character completes), the
    finish reason once finished, tokens so far, and who made it (None: not asked, or no
    token); the finish of a checked answer carries the broker's verdict."""

    text: str
    finish: str | None
    tokens: int
    route: oa.TokenRoute | None
    verdict: Verdict | None = None  # the broker's check (sampled), with the finish


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
