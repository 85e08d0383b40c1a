"""The SDK: `AsyncClient` and its blocking twin `Client`.

    from client import Client

    with Client("http://127.0.0.1:7371", api_key="...") as fa:
        vectors = fa.embed(["a text", "another"])             # (2, 384) float32
        for piece in fa.generate("Once upon a time", max_new_tokens=32):
            print(piece, end="", flush=True)
        job = fa.submit({"model": "minilm", "texts": texts})
        fa.wait(job.id)
        rows = fa.results(job.id)

Embeddings and batch jobs go through the broker's HTTP API. Generation is an interactive
session the client runs itself: it downloads the model's client stages (tokenizer, embedding,
head) once into a local cache, asks the broker which providers serve each block stage, and
streams hidden states to them over the p2p layer; token ids and text never leave this process.
When a provider dies or stalls past the deadline, the client reports it, asks the broker for a
replacement and replays the session's history into it (`client.session`), so the text equals an
uninterrupted run.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import numpy as np

from client.errors import (
    BrokerUnreachable,
    FusionAIError,
    GenerationError,
    JobFailed,
    JobTimeout,
    UnavailableError,
    for_status,
)
from client.sampling import Sampler
from client.session import GenerationSession, generate
from client.stages import ClientStages
from client.text import TextStream
from files.atomic import link_atomic, write_atomic
from files.cache import ArtifactCache, ArtifactError
from ir.manifest import ModelManifest

Array = np.ndarray[Any, Any]
T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:7371"
EMBED_CHUNK = 256  # texts per embeddings request
AVOID_PATIENCE_S = 5.0  # how long a failed peer is not taken back while others may come
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_HOLD_S = 30.0  # the broker holds a status request at most this long (`?wait=`)


def default_cache_dir() -> Path:
    """Where client stages are kept: `$FUSIONAI_CACHE_DIR`, else the user cache directory."""
    env = os.environ.get("FUSIONAI_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusionai", appauthor=False))


@dataclass(frozen=True)
class Job:
    """A batch job's state as the broker reported it."""

    id: str
    model: str
    state: str  # queued, running, succeeded, failed, cancelled
    done: int  # microbatches finished
    microbatches: int
    progress: float  # 0..1
    error: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Job:
        return cls(
            d["id"], d["model"], d["state"], d["done"], d["microbatches"], d["progress"],
            d.get("error"), d,
        )  # fmt: skip

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class FinetuneStep:
    """One optimizer step of a fine-tune job."""

    step: int
    steps: int  # the job's total
    loss: float  # mean next-token loss of the step's batch
    tokens: int
    seconds: float

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class FineTune:
    """A finished fine-tune job: its losses, and the trained adapter (a safetensors file)."""

    job: str
    model: str
    steps: list[FinetuneStep]
    adapter: Path  # downloaded into the cache, named by its SHA-256
    sha256: str

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


@dataclass(frozen=True)
class Failover:
    """A provider stage that failed during a generation, and why."""

    stage: int  # provider stage position
    peer: str
    reason: str
    at: float  # time.monotonic() when it was noticed


@dataclass
class Generation:
    """A finished generation (`generate(..., stream=False)`), or one in progress (the stream's
    `result`)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (eos or a stop string) or "length"
    failovers: list[Failover] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # monotonic time of each token
    route: list[str] = field(default_factory=list)  # peer id per provider stage at the end
    checked: int = 0  # with verify: stage steps a second provider's answer confirmed
    unchecked: int = 0  # with verify: stage steps no second provider could check
    distrusted: list[str] = field(default_factory=list)  # providers found wrong (quarantined)


class GenerationStream:
    """Text pieces of a generation as they come (`async for piece in stream`); `result` fills
    in as it goes and is complete once the iteration ends."""

    def __init__(self, pieces: AsyncIterator[str], result: Generation) -> None:
        self._pieces = pieces
        self.result = result

    def __aiter__(self) -> AsyncIterator[str]:
        return self._pieces

    async def aclose(self) -> None:
        close = getattr(self._pieces, "aclose", None)
        if close is not None:
            await close()


class AsyncClient:
    """One broker's API. Use as `async with AsyncClient(url, api_key=...) as client:`, or
    call `aclose()` when done (it stops the p2p host a generation started)."""

    def __init__(
        self,
        broker_url: str | None = None,
        api_key: str | None = None,
        *,
        cacert: str | None = None,
        timeout: float = 30.0,
        cache_dir: Path | str | None = None,
        listen: str = "/ip4/127.0.0.1/tcp/0",
    ) -> None:
        """`broker_url` defaults to `$FUSIONAI_BROKER_URL`, then http://127.0.0.1:7371;
        `api_key` to `$FUSIONAI_API_KEY`; `cacert` (a PEM file to trust for https) to
        `$FUSIONAI_CACERT`. `timeout` is the per-request deadline in seconds, including each
        generation step on a provider."""
        url = broker_url or os.environ.get("FUSIONAI_BROKER_URL") or DEFAULT_URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"broker_url must be an http:// or https:// URL, got {url!r}")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("FUSIONAI_API_KEY")
        self.cacert = cacert or os.environ.get("FUSIONAI_CACERT")
        self.timeout = timeout
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.listen = listen
        self._http: Any = None  # aiohttp.ClientSession, made on first use (inside a loop)
        self._host: Any = None  # p2p.Host, started by the first generation
        self._host_lock: asyncio.Lock | None = None
        self._stages: dict[str, ClientStages] = {}
        self._loading: dict[str, asyncio.Lock] = {}  # one download of a model's stages at once
        self._manifests: dict[str, tuple[ModelManifest, bytes]] = {}
        self._cache: ArtifactCache | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        host, self._host = self._host, None
        http, self._http = self._http, None
        try:
            if host is not None:
                await host.close()
        finally:
            if http is not None:
                await http.close()

    # ---- HTTP --------------------------------------------------------------------------

    def _session(self) -> Any:
        if self._http is None:
            import aiohttp

            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            ctx = ssl.create_default_context(cafile=self.cacert) if self.cacert else None
            self._http = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=ctx) if ctx is not None else None,
            )
        return self._http

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        raw: bool = False,
        data: Any = None,
    ) -> Any:
        """The JSON answer to one call (or its bytes with `raw`); typed errors otherwise.
        `body` is sent as JSON, `data` (bytes or a binary file) as it is."""
        import aiohttp

        wait = aiohttp.ClientTimeout(total=timeout if timeout is not None else self.timeout)
        try:
            async with self._session().request(
                method, self.url + path, json=body, data=data, timeout=wait
            ) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    raise _error(resp.status, data, resp.headers.get("Retry-After"))
                return data if raw else json.loads(data)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            raise BrokerUnreachable(f"cannot reach the broker at {self.url}: {why}") from None

    # ---- the swarm and models ------------------------------------------------------------

    async def swarm(self) -> dict[str, Any]:
        """Providers (pool, hardware, load) and models (routes, backups)."""
        result: dict[str, Any] = await self._request("GET", "/v1/swarm")
        return result

    async def models(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = (await self._request("GET", "/v1/models"))["models"]
        return result

    async def model(self, name: str) -> dict[str, Any]:
        """A model's stages, who serves each (peer ids, addresses) and their backups."""
        result: dict[str, Any] = await self._request("GET", f"/v1/models/{_quote(name)}")
        return result

    async def add_model(
        self, directory: Path | str, *, progress: Callable[[str, int, int], None] | None = None
    ) -> dict[str, Any]:
        """Upload a model package (a directory from `fusionai ir split`): its artifacts, then
        its manifest; the broker places it. `progress(file, index, count)` is called before
        each upload. Returns the model as `model()` does."""
        directory = Path(directory)
        data = await asyncio.to_thread((directory / "manifest.json").read_bytes)
        manifest = ModelManifest.from_json(data)
        files = [(s.file, s.sha256) for s in manifest.stages]
        if manifest.tokenizer and manifest.tokenizer_sha256:
            files.append((manifest.tokenizer, manifest.tokenizer_sha256))
        for i, (file, sha) in enumerate(files, 1):
            if progress is not None:
                progress(file, i, len(files))
            with (directory / file).open("rb") as f:  # aiohttp reads it in chunks
                await self._request("PUT", f"/v1/artifacts/{sha}", data=f, timeout=3600)
        result: dict[str, Any] = await self._request("POST", "/v1/models", data=data, timeout=300)
        return result

    async def manifest(self, name: str) -> ModelManifest:
        return (await self._manifest(name))[0]

    async def _manifest(self, name: str) -> tuple[ModelManifest, bytes]:
        if name not in self._manifests:
            data = await self._request("GET", f"/v1/models/{_quote(name)}/manifest", raw=True)
            self._manifests[name] = (ModelManifest.from_json(data), data)
        return self._manifests[name]

    async def _default_model(self, decoder: bool) -> str:
        """The broker's only model of the kind asked for (a decoder or an encoder)."""
        names = [m["model"] for m in await self.models()]
        fit = []
        for name in names:
            manifest = await self.manifest(name)
            keeps_cache = any(i.name.startswith("past_") for s in manifest.stages for i in s.inputs)
            if keeps_cache == decoder:
                fit.append(name)
        kind = "decoder (text generation)" if decoder else "encoder (embeddings)"
        if len(fit) != 1:
            found = f"it has {len(fit)}: {', '.join(fit)}" if fit else "it has none"
            raise FusionAIError(f"name the model: the broker must have one {kind} model; {found}")
        return fit[0]

    async def stages(self, name: str) -> ClientStages:
        """The model's client stages (tokenizer, embedding, head), downloaded once into the
        cache and checked against the manifest's SHA-256 hashes."""
        async with self._loading.setdefault(name, asyncio.Lock()):
            if name not in self._stages:
                self._stages[name] = await self._load_stages(name)
        return self._stages[name]

    async def _load_stages(self, name: str) -> ClientStages:
        manifest, data = await self._manifest(name)
        directory = self.cache_dir / "models" / f"{name}-{hashlib.sha256(data).hexdigest()[:16]}"
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        files = [(s.file, s.sha256) for s in manifest.stages if s.placement == "client"]
        if manifest.tokenizer and manifest.tokenizer_sha256:
            files.append((manifest.tokenizer, manifest.tokenizer_sha256))
        for file, sha in files:
            await self._fetch(directory / Path(file).name, sha)
        await asyncio.to_thread(write_atomic, directory / "manifest.json", data)
        stages: ClientStages = await asyncio.to_thread(ClientStages, directory)
        return stages

    async def _artifacts(self) -> ArtifactCache:
        """The content-addressed cache of what was downloaded (checked once per client)."""
        if self._cache is None:
            cache = await asyncio.to_thread(ArtifactCache, self.cache_dir / "artifacts")
            await asyncio.to_thread(cache.check)
            self._cache = cache
        return self._cache

    async def _fetch(self, path: Path, sha: str, url: str = "", what: str = "") -> None:
        """Make `path` the artifact `sha` (from the cache, else downloaded from `url`)."""
        cache = await self._artifacts()
        if not cache.has(sha):
            data = await self._request("GET", url or f"/v1/artifacts/{sha}", raw=True, timeout=600)
            try:
                await asyncio.to_thread(cache.put, sha, data)
            except ArtifactError:
                raise FusionAIError(
                    f"the broker sent {what or path.name} with the wrong SHA-256"
                ) from None
        await asyncio.to_thread(link_atomic, cache.path(sha), path)

    # ---- embeddings ------------------------------------------------------------------------

    async def embed(self, texts: str | Sequence[str], *, model: str | None = None) -> Array:
        """Sentence embeddings, one row per text (float32, normalized if the model does)."""
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise ValueError("no texts to embed")
        if not all(isinstance(t, str) for t in items):
            raise TypeError("texts must be strings")
        name = model or await self._default_model(decoder=False)
        rows: list[Array] = []
        for start in range(0, len(items), EMBED_CHUNK):
            body = {
                "model": name,
                "input": items[start : start + EMBED_CHUNK],
                "encoding_format": "base64",
            }
            out = await self._request("POST", "/v1/embeddings", body)
            for d in sorted(out["data"], key=lambda d: d["index"]):
                rows.append(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"))
        return np.stack(rows).astype(np.float32)

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
        keys = [s["key"] for s in route["stages"]]
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

    async def _p2p(self) -> Any:
        """The p2p host generation sessions use (an ephemeral identity), started once."""
        if self._host_lock is None:
            self._host_lock = asyncio.Lock()
        async with self._host_lock:
            if self._host is None:
                from p2p import Host, HostConfig

                host = Host(HostConfig(listen=(self.listen,), request_timeout=self.timeout))
                await host.start()
                self._host = host
        return self._host

    # ---- batch jobs ------------------------------------------------------------------------

    async def submit(self, job: Mapping[str, Any]) -> Job:
        """Submit a batch job: `{"model", "texts" | "token_ids", "microbatch"?, ...}`."""
        return Job.from_json(await self._request("POST", "/v1/jobs", dict(job)))

    async def job(self, job_id: str, *, wait: float = 0.0) -> Job:
        """A job's state and progress. With `wait` (at most 30 s), a job still going is
        answered once its state or progress changes, or after `wait` seconds."""
        path = f"/v1/jobs/{_quote(job_id)}"
        if wait > 0:
            path += f"?wait={wait:.3f}"
        return Job.from_json(await self._request("GET", path, timeout=self.timeout + wait))

    async def cancel(self, job_id: str) -> Job:
        return Job.from_json(await self._request("POST", f"/v1/jobs/{_quote(job_id)}/cancel"))

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        poll: float = 10.0,
        progress: Callable[[Job], None] | None = None,
    ) -> Job:
        """Wait for the job to end; returns it once it has succeeded. Raises `JobFailed` if it
        failed or was cancelled, `JobTimeout` after `timeout` seconds (the job goes on).

        The broker answers as soon as the job's state or progress changes (a long poll), so
        the end is seen at once; `poll` (at most 30 s) is the longest one request waits, and
        so the longest between two calls of `progress`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        hold = 0.0  # the first answer comes at once
        while True:
            job = await self.job(job_id, wait=hold)
            if progress is not None:
                progress(job)
            if job.finished:
                if job.state != "succeeded":
                    raise JobFailed(job)
                return job
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise JobTimeout(f"job {job_id} is still {job.state} after {timeout} s")
            hold = _hold(poll, left)

    async def results(self, job_id: str, *, page: int = 10_000) -> Array:
        """A succeeded job's embeddings, one row per input, fetched page by page."""
        rows: list[list[float]] = []
        while True:
            path = f"/v1/jobs/{_quote(job_id)}/results?offset={len(rows)}&limit={page}"
            out = await self._request("GET", path)
            rows.extend(out["embeddings"])
            if not out["embeddings"] or len(rows) >= out["total"]:
                break
        return np.asarray(rows, dtype=np.float32)

    # ---- fine-tuning -----------------------------------------------------------------------

    async def finetune(
        self,
        model: str,
        data: str | Path | Sequence[str],
        *,
        steps: int = 20,
        progress: Callable[[FinetuneStep], None] | None = None,
        timeout: float | None = None,
        poll: float = 10.0,
        **options: Any,
    ) -> FineTune:
        """Fine-tune `model` through the swarm on `data` (texts, or a JSONL file of
        {"text": ...} lines, or a plain text file of one example per line) and wait for it.
        `options`: batch, microbatches, seq_len, method ("lora-fa" or "lora"), rank, lr,
        weight_decay, seed, snapshot_every, shards ([k, n]). `progress` gets each step as it
        is done (`poll`: the longest one status request waits for a change, as in `wait`).
        Returns the losses and the downloaded adapter."""
        if isinstance(data, str | Path):
            texts = await asyncio.to_thread(read_texts, data)
        else:
            texts = [str(t) for t in data]
        body = {"kind": "finetune", "model": model, "texts": texts, "steps": steps, **options}
        if "shards" in body:
            body["shards"] = list(body["shards"])
        job = await self.submit(body)
        seen = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        hold = 0.0
        while True:
            current = await self.job(job.id, wait=hold)
            done = await self._steps(job.id, seen, current.microbatches)
            for s in done:
                if progress is not None:
                    progress(s)
            seen += len(done)
            if current.finished:
                if current.state != "succeeded":
                    raise JobFailed(current)
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise JobTimeout(
                    f"fine-tune job {job.id} is still {current.state} after {timeout} s"
                )
            hold = _hold(poll, left)
        path, sha = await self._download_adapter(job.id)
        return FineTune(
            job.id, model, await self._steps(job.id, 0, current.microbatches), path, sha
        )

    async def finetune_steps(self, job_id: str, *, offset: int = 0) -> list[FinetuneStep]:
        """The steps a fine-tune job has done so far (from `offset` on)."""
        return await self._steps(job_id, offset, (await self.job(job_id)).microbatches)

    async def _steps(self, job_id: str, offset: int, total: int) -> list[FinetuneStep]:
        out = await self._request(
            "GET", f"/v1/jobs/{_quote(job_id)}/results?offset={offset}&limit=10000"
        )
        return [
            FinetuneStep(s["step"], total, s["loss"], s["tokens"], s["seconds"])
            for s in out.get("steps", [])
        ]

    async def adapter(self, job_id: str) -> Path:
        """A fine-tune job's trained adapter (safetensors), downloaded once into the cache."""
        path, _ = await self._download_adapter(job_id)
        return path

    async def _download_adapter(self, job_id: str) -> tuple[Path, str]:
        info = await self._request("GET", f"/v1/jobs/{_quote(job_id)}/results?limit=1")
        adapter = info.get("adapter")
        if not adapter:
            raise FusionAIError(f"job {job_id} has no adapter (is it a finished fine-tune job?)")
        sha = str(adapter["sha256"])
        path = self.cache_dir / "adapters" / f"{sha}.safetensors"
        url = f"/v1/jobs/{_quote(job_id)}/adapter"
        await self._fetch(path, sha, url, f"job {job_id}'s adapter")
        return path, sha

    async def _adapter_tensors(self, adapter: str | Path, model: str) -> dict[str, Array]:
        """An adapter's tensors, checked against the model it is applied to."""
        path = Path(adapter)
        is_file = await asyncio.to_thread(path.is_file)
        if not (isinstance(adapter, Path) or path.suffix == ".safetensors" or is_file):
            path = await self.adapter(str(adapter))  # a fine-tune job's id
        return await asyncio.to_thread(load_adapter, path, model)


SAMPLE_DATA = Path(__file__).parent / "data" / "swarm-notes.jsonl"  # 40 sentences, shipped


def read_texts(path: str | Path) -> list[str]:
    """Training texts from a file: JSONL with a "text" field per line (`.jsonl`), else one
    example per non-empty line."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text") from None
    texts: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if file.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{file}:{n}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f'{file}:{n}: each line is an object with a "text" string')
            texts.append(row["text"])
        else:
            texts.append(line)
    if not texts:
        raise ValueError(f"{file} has no examples")
    return texts


def load_adapter(path: Path, model: str) -> dict[str, Array]:
    """A safetensors adapter's tensors; refused if it was trained for another model."""
    from ir.training import TrainingError, load_state, read_metadata

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FusionAIError(f"cannot read adapter {path}: {exc.strerror}") from None
    try:
        meta = read_metadata(data)
        tensors = load_state(data)
    except TrainingError as exc:
        raise FusionAIError(f"{path}: {exc}") from None
    if meta.get("model") not in (None, model):
        raise FusionAIError(f"{path} is an adapter for {meta['model']}, not {model}")
    if not tensors or not all(k.startswith("lora_") for k in tensors):
        raise FusionAIError(f"{path} holds no LoRA adapter tensors (lora_A.*, lora_B.*)")
    return tensors


class HttpRouter:
    """Providers for a client's generation session, named by the broker over HTTP
    (`client.session.Router`). The client connects to each provider it is given."""

    def __init__(self, client: AsyncClient, model: str) -> None:
        self.client = client
        self.model = model

    async def pick(self, pos: int, avoid: set[str]) -> str:
        host = await self.client._p2p()
        tried = set(avoid)
        deadline = time.monotonic() + self.client.timeout
        # A peer that just failed is what the broker names until it has noticed (its ping
        # fails) and promoted a backup: ask again for a while before taking it back.
        patience = time.monotonic() + min(AVOID_PATIENCE_S, self.client.timeout / 2)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GenerationError(f"no reachable provider serves stage {pos} of {self.model}")
            body = {"stage": pos, "avoid": sorted(tried), "timeout": round(left, 3)}
            try:
                out = await self.client._request(
                    "POST", f"/v1/models/{_quote(self.model)}/pick", body, timeout=left + 5
                )
            except FusionAIError as exc:
                raise GenerationError(f"stage {pos} of {self.model}: {exc}") from None
            peer: str = out["peer_id"]
            if peer in tried and time.monotonic() < patience:
                await asyncio.sleep(0.2)
                continue
            reason = await _dial(host, peer, list(out["addrs"]), deadline)
            if reason is None:
                return peer
            await self.failed(pos, peer, f"cannot connect: {reason}")
            if peer in tried:  # the broker had no other: give it a moment to notice
                await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
            tried.add(peer)

    async def failed(self, pos: int, peer: str, reason: str) -> None:
        try:
            await self.client._request(
                "POST", f"/v1/providers/{_quote(peer)}/report", {"reason": reason[:1000]}
            )
        except FusionAIError:
            pass  # best effort: the broker's heartbeats notice a dead provider anyway

    def lost(self, peer: str) -> asyncio.Event | None:
        return None  # the client learns of a dead provider from its own requests

    async def checker(self, pos: int, avoid: set[str]) -> str | None:
        host = await self.client._p2p()
        body = {"stage": pos, "avoid": sorted(avoid), "check": True}
        try:
            out = await self.client._request("POST", f"/v1/models/{_quote(self.model)}/pick", body)
        except UnavailableError:
            return None  # no one else holds the stage
        except FusionAIError as exc:
            raise GenerationError(f"stage {pos} of {self.model}: {exc}") from None
        peer: str = out["peer_id"]
        deadline = time.monotonic() + self.client.timeout
        return peer if await _dial(host, peer, list(out["addrs"]), deadline) is None else None

    async def distrust(self, pos: int, key: str, peer: str, reason: str) -> bool:
        try:
            out = await self.client._request(
                "POST",
                f"/v1/providers/{_quote(peer)}/report",
                {"reason": reason[:1000], "wrong_output": key},
            )
        except FusionAIError:
            return False  # unresolved: the session raises VerificationError
        return bool(out.get("quarantined"))


async def _dial(host: Any, peer: str, addrs: list[str], deadline: float) -> str | None:
    """Connect to `peer` by the first of `addrs` that answers before `deadline` (monotonic);
    None once connected, else why not."""
    if peer in host.connected_peers():
        return None
    errors = []
    for n, addr in enumerate(addrs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # an unreachable address must not use up the time the others need
        cap = left if n == len(addrs) - 1 else min(left, 10.0)
        try:
            full = addr if "/p2p/" in addr else f"{addr}/p2p/{peer}"
            await asyncio.wait_for(host.connect(full), cap)
            return None
        except Exception as exc:  # any dial failure: try the next
            errors.append(f"{addr}: {exc or type(exc).__name__}")
    return "; ".join(errors) or "it has no addresses"


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


def _error(status: int, data: bytes, retry_after: str | None) -> FusionAIError:
    message, field_name = data.decode(errors="replace")[:500], None
    try:
        err = json.loads(data)["error"]
        message, field_name = str(err["message"]), err.get("field")
    except (ValueError, KeyError, TypeError):
        pass
    retry = float(retry_after) if retry_after and retry_after.isdigit() else None
    return for_status(status, message, field_name, retry)


def _hold(poll: float, left: float | None) -> float:
    """How long the next status request may wait at the broker for a change (a long poll)."""
    return min(max(poll, 0.0), MAX_HOLD_S, MAX_HOLD_S if left is None else left)


def _quote(part: str) -> str:
    from urllib.parse import quote

    return quote(part, safe="")
