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
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from client.errors import BrokerUnreachable, FusionAIError, JobFailed, JobTimeout
from client.finetuning import FinetuneMethods
from client.generating import GenerationMethods
from client.http import BrokerHttp, Retry
from client.routing import quote_part
from client.stages import ClientStages
from client.training import TrainMethods
from client.types import Job, long_poll_s
from files.atomic import link_atomic, write_atomic
from files.cache import ArtifactCache, ArtifactError
from ir.manifest import ModelManifest
from proto import api
from proto.api.openai import EmbeddingList, EmbeddingRequest

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:7371"
EMBED_CHUNK = 256  # texts per embeddings request
PUNCH_LIMIT_S = 15.0  # longest a hole punch may hold up a session's start; seconds


def default_cache_dir() -> Path:
    """Where client stages are kept: `$FUSIONAI_CACHE_DIR`, else the user cache directory."""
    env = os.environ.get("FUSIONAI_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fusionai", appauthor=False))


class AsyncClient(GenerationMethods, FinetuneMethods, TrainMethods):
    """One broker's API. Use as `async with AsyncClient(url, api_key=...) as client:`, or
    call `aclose()` when done (it stops the p2p host a generation started)."""

    def __init__(
        self,
        broker_url: str | None = None,
        api_key: str | None = None,
        *,
        cacert: str | None = None,
        timeout: float = 30.0,
        retry_s: float = 30.0,
        cache_dir: Path | str | None = None,
        listen: str = "/ip4/127.0.0.1/tcp/0",
        chain: bool | None = None,
        verify_share: float = 0.0,
    ) -> None:
        """`broker_url` defaults to `$FUSIONAI_BROKER_URL`, then http://127.0.0.1:7371;
        `api_key` to `$FUSIONAI_API_KEY`; `cacert` (a PEM file to trust for https) to
        `$FUSIONAI_CACERT`. `timeout` is the per-request deadline in seconds, including each
        generation step on a provider. `retry_s` is how long, in seconds, a call keeps trying
        a broker it cannot reach or that answers 502, 503 or 504 (a restart), with growing
        pauses (`client.http`); 0 makes every failure final. `chain`: a generation's steps
        go provider to provider along a route this client signs (n + 1 network trips a token
        for n stages) instead of to each stage and back (2n); concurrent generations' steps
        along the same providers go together, one message a hop: True or None (default)
        chains, False never. `verify_share`: the share
        of generations (0 to 1, drawn at random) whose tokens and providers' signed
        commitments are sent to the broker once done, to be checked by its own run
        (`client.verifying`: the broker then sees those tokens); 0 sends none."""
        url = broker_url or os.environ.get("FUSIONAI_BROKER_URL") or DEFAULT_URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"broker_url must be an http:// or https:// URL, got {url!r}")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if not 0.0 <= verify_share <= 1.0:
            raise ValueError("verify_share must be from 0 to 1")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("FUSIONAI_API_KEY")
        self.cacert = cacert or os.environ.get("FUSIONAI_CACERT")
        self.timeout = timeout
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.listen = listen
        self.chain = chain
        self.verify_share = verify_share
        self._verify_rng = random.Random()  # which generations are checked: unpredictable
        self._http = BrokerHttp(self.url, self.api_key, self.cacert, retry_s)
        self._host: Any = None  # p2p.Host, started by the first generation
        self._puncher: Any = None  # p2p.punch.Puncher on that host
        self._mux: Any = None  # client.stepmux.StepMux on that host: sessions' steps together
        self._chains: Any = None  # client.chained.ChainInbox on it, when `chain`
        self._host_lock: asyncio.Lock | None = None
        self._stages: dict[str, ClientStages] = {}
        self._loading: dict[str, asyncio.Lock] = {}  # one download of a model's stages at once
        self._manifests: dict[str, tuple[ModelManifest, bytes]] = {}
        self._cache: ArtifactCache | None = None
        self._cache_lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        host, self._host = self._host, None
        try:
            if host is not None:
                await host.close()
        finally:
            await self._http.close()

    # ---- HTTP --------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        raw: bool = False,
        data: bytes | Path | None = None,
        retry: Retry | None = None,
        deadline: float | None = None,
    ) -> Any:
        """The JSON answer to one call (or its bytes with `raw`); typed errors otherwise,
        after the retries `retry` allows (`client.http.BrokerHttp.request`)."""
        return await self._http.request(
            method, path, body, timeout=timeout if timeout is not None else self.timeout,
            raw=raw, data=data, retry=retry, deadline=deadline,
        )  # fmt: skip

    async def _call(
        self, method: str, path: str, answer: type[T], body: Any = None, **options: Any
    ) -> T:
        """One call whose answer is decoded as `answer` (a `proto.api` struct)."""
        data = await self._request(method, path, body, raw=True, **options)
        try:
            return msgspec.json.decode(data, type=answer)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise FusionAIError(
                f"the broker's answer to {method} {path} is not what this SDK reads: {exc} "
                f"(are the broker and the SDK of compatible versions?)"
            ) from None

    # ---- the swarm and models ------------------------------------------------------------

    async def swarm(self) -> api.Swarm:
        """Providers (pool, hardware, load) and models (routes, backups)."""
        return await self._call("GET", "/v1/swarm", api.Swarm)

    async def models(self) -> list[api.ModelCard]:
        """The broker's models, and whether the swarm serves each."""
        return (await self._call("GET", "/v1/models", api.ModelList)).data

    async def model(self, name: str) -> api.Model:
        """A model's stages, who serves each (peer ids, addresses) and their backups."""
        return await self._call("GET", f"/v1/models/{quote_part(name)}", api.Model)

    async def add_model(
        self, directory: Path | str, *, progress: Callable[[str, int, int], None] | None = None
    ) -> api.Model:
        """Upload a model package (a directory from `fusionai ir split`): its artifacts, then
        its manifest; the broker places it. `progress(file, index, count)` is called before
        each upload. Returns the model as `model()` does. On a broker with API keys this
        client's key must be an admin key (others get `AuthenticationError`, 403)."""
        directory = Path(directory)
        data = await asyncio.to_thread((directory / "manifest.json").read_bytes)
        manifest = ModelManifest.from_json(data)
        files = [(s.file, s.sha256) for s in manifest.stages]
        if manifest.tokenizer and manifest.tokenizer_sha256:
            files.append((manifest.tokenizer, manifest.tokenizer_sha256))
        for i, (file, sha) in enumerate(files, 1):
            if progress is not None:
                progress(file, i, len(files))
            await self._request("PUT", f"/v1/artifacts/{sha}", data=directory / file, timeout=3600)
        return await self._call("POST", "/v1/models", api.Model, data=data, timeout=300)

    async def manifest(self, name: str) -> ModelManifest:
        return (await self._manifest(name))[0]

    async def _manifest(self, name: str) -> tuple[ModelManifest, bytes]:
        if name not in self._manifests:
            data = await self._request("GET", f"/v1/models/{quote_part(name)}/manifest", raw=True)
            self._manifests[name] = (ModelManifest.from_json(data), data)
        return self._manifests[name]

    async def default_model(self, decoder: bool = True) -> str:
        """The broker's only decoder (or, `decoder=False`, encoder); `FusionAIError` when it
        has none or several."""
        return await self._default_model(decoder)

    async def _default_model(self, decoder: bool) -> str:
        """The broker's only model of the kind asked for (a decoder or an encoder)."""
        names = [m.id for m in await self.models()]
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
        async with self._cache_lock:
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
            chunk: list[Any] = items[start : start + EMBED_CHUNK]
            body = EmbeddingRequest(name, chunk, encoding_format="base64")
            out = await self._call("POST", "/v1/embeddings", EmbeddingList, body, retry="any")
            for d in sorted(out.data, key=lambda d: d.index):
                if not isinstance(d.embedding, str):
                    raise FusionAIError("the broker sent floats where base64 was asked for")
                rows.append(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"))
        return np.stack(rows).astype(np.float32)

    async def _p2p(self) -> Any:
        """The p2p host generation sessions use (an ephemeral identity), started once."""
        if self._host_lock is None:
            self._host_lock = asyncio.Lock()
        async with self._host_lock:
            if self._host is None:
                from client.stepmux import StepMux
                from p2p import Host, HostConfig
                from p2p.punch import Puncher

                host = Host(HostConfig(listen=(self.listen,), request_timeout=self.timeout))
                await host.start()
                self._puncher = Puncher(host)
                self._mux = StepMux(host)
                if self.chain is not False:
                    from client.chained import inbox_of

                    self._chains = inbox_of(host)
                self._host = host
        return self._host

    async def _direct(self, peer: str) -> None:
        """Just connected to provider `peer`: when it is reachable only through a relay and
        both NATs allow it, move to a direct connection (`p2p.punch`; otherwise, and for a
        provider that is reachable directly, the connection stays as it is)."""
        if self._puncher is None:
            return
        try:
            async with asyncio.timeout(PUNCH_LIMIT_S):
                punched = await self._puncher.punch(peer)
        except TimeoutError:
            log.info("provider %s: no direct connection within %g s", peer, PUNCH_LIMIT_S)
            return
        if punched.direct:
            log.info("provider %s: direct at %s (hole punched)", peer, punched.direct)

    # ---- batch jobs ------------------------------------------------------------------------

    async def submit(self, job: Mapping[str, Any] | api.JobRequest) -> Job:
        """Submit a batch job: `{"model", "texts" | "token_ids", "microbatch"?, ...}` (or
        `proto.api.EmbedJobRequest`, `FinetuneJobRequest`). It is tried again only while the
        broker cannot be connected to: a connection that breaks once the job was sent raises
        `BrokerUnreachable` with `sent` True (the job may have been queued: see `jobs()`)."""
        body = job if isinstance(job, msgspec.Struct) else dict(job)
        try:
            return await self._call("POST", "/v1/jobs", Job, body, retry="unsent")
        except BrokerUnreachable as exc:
            if not exc.sent:
                raise
            raise BrokerUnreachable(
                f"{exc}; the job may have been queued: look for it among the broker's jobs "
                f"(`fusionai job list`) before submitting it again"
            ) from None

    async def jobs(self, *, limit: int = 100) -> list[Job]:
        """The broker's most recent jobs (at most `limit`, up to 1000), newest first."""
        return (await self._call("GET", f"/v1/jobs?limit={limit}", api.JobList)).jobs

    async def job(self, job_id: str, *, wait: float = 0.0) -> Job:
        """A job's state and progress. With `wait` (at most 30 s), a job still going is
        answered once its state or progress changes, or after `wait` seconds."""
        return await self._job(job_id, wait, None)

    async def _job(self, job_id: str, wait: float, deadline: float | None) -> Job:
        """`job`, retried through a broker restart until `deadline` at the latest."""
        path = f"/v1/jobs/{quote_part(job_id)}"
        if wait > 0:
            path += f"?wait={wait:.3f}"
        return await self._call("GET", path, Job, timeout=self.timeout + wait, deadline=deadline)

    async def story(self, job_id: str) -> api.Story:
        """The job and the events that tell what happened to it."""
        return await self._call("GET", f"/v1/jobs/{quote_part(job_id)}/story", api.Story)

    async def cancel(self, job_id: str) -> Job:
        return await self._call("POST", f"/v1/jobs/{quote_part(job_id)}/cancel", Job, retry="any")

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
        so the longest between two calls of `progress`. A broker that restarts meanwhile is
        waited for (`retry_s`, and never past `timeout`), and the wait goes on."""

        async def seen(job: Job) -> None:
            if progress is not None:
                progress(job)

        return await self._follow(job_id, seen, timeout=timeout, poll=poll)

    async def _follow(
        self,
        job_id: str,
        seen: Callable[[Job], Awaitable[None]],
        *,
        timeout: float | None,
        poll: float,
        what: str = "job",
    ) -> Job:
        """`wait`, with `seen(job)` awaited after each answer (a job kind's own progress)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        hold = 0.0  # the first answer comes at once
        while True:
            job = await self._job(job_id, hold, deadline)
            await seen(job)
            if job.finished:
                if job.state != "succeeded":
                    raise JobFailed(job)
                return job
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise JobTimeout(f"{what} {job_id} is still {job.state} after {timeout} s")
            hold = long_poll_s(poll, left)

    async def results(self, job_id: str, *, page: int = 10_000) -> Array:
        """A succeeded job's embeddings, one row per input, fetched page by page (a page
        that fails is asked for again from the same offset: no row twice)."""
        rows: list[list[float]] = []
        while True:
            path = f"/v1/jobs/{quote_part(job_id)}/results?offset={len(rows)}&limit={page}"
            out = await self._call("GET", path, api.EmbedResults)
            rows.extend(out.embeddings)
            if not out.embeddings or len(rows) >= out.total:
                break
        return np.asarray(rows, dtype=np.float32)
