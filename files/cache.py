"""The content-addressed artifact cache the broker, providers and clients share: files named
by their SHA-256, verified before anyone uses them, kept on disk (least recently used evicted
first when a limit is set).

    cache = ArtifactCache(data_dir / "artifacts", limit_bytes=20 * 2**30)
    cache.check()                                  # at start: drop what fails verification
    path = await cache.fetch(sha256, url, size)    # resumes, verifies, evicts LRU to make room
    await cache.receive(sha256, chunks, max_bytes) # an upload streamed in (the broker)
    cache.put(sha256, data)                        # bytes already in hand (a client)

Layout: `objects/<sha256>` holds verified files only (renamed into place after the hash
matched, so a crash never leaves a half file there); `partial/<sha256>` holds a download in
progress, resumed with an HTTP range request; `index.json` records each object's size and
modification time when it was last verified, so `check()` re-hashes only what changed.
Files in use are pinned and never evicted. Everything is owner-only (files 0600, folders
0700), and messages show a URL's token as REDACTED (`files.private.redact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from files.atomic import atomic_file, move_atomic, write_atomic
from files.digest import CHUNK, SHA256_RE, sha256_file
from files.private import redact

if TYPE_CHECKING:  # aiohttp loads on the first download: importing the cache stays cheap
    import aiohttp

log = logging.getLogger(__name__)

PARTIAL_MAX_AGE_S = 7 * 24 * 3600.0  # a partial download untouched this long is dropped
STRAY_AGE_S = 3600.0  # a file not named by its hash, this old, is a crashed write's leftover
RACY_S = 2.0  # file times tick coarsely (2 s on FAT): a write this soon may keep the time
Progress = Callable[[int, int], None]  # (bytes so far, total bytes)
T = TypeVar("T")


class ArtifactError(Exception):
    """An artifact could not be fetched or kept; the message says why and what to do."""


class _Entry(msgspec.Struct):
    size: int
    mtime_ns: int
    checked_ns: int = 0  # the clock when it was recorded (absent in older indexes: racy)

    def vouches_for(self, st: os.stat_result) -> bool:  # the file unchanged since verified
        old = self.checked_ns - self.mtime_ns >= RACY_S * 1e9
        return old and (self.size, self.mtime_ns) == (st.st_size, st.st_mtime_ns)


def _entry(st: os.stat_result) -> _Entry:
    return _Entry(st.st_size, st.st_mtime_ns, time.time_ns())


class ArtifactCache:
    def __init__(
        self,
        root: Path,
        limit_bytes: int | None = None,
        *,
        attempts: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
    ) -> None:
        """`limit_bytes`: the most the cache holds, evicting the least recently used
        unpinned files to stay under it; None: no limit, nothing is ever evicted (the broker,
        whose artifacts are the models it serves)."""
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"the cache limit must be positive, got {limit_bytes} bytes")
        self.root = root
        self.objects, self.partial = root / "objects", root / "partial"
        self.limit = limit_bytes if limit_bytes is not None else float("inf")
        self.attempts, self.backoff_s, self.timeout_s = attempts, backoff_s, timeout_s
        self.pinned: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        for folder in (root, self.objects, self.partial):  # (owner-only, as the files)
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._index: dict[str, _Entry] = self._read_index()

    # ---- index -----------------------------------------------------------------------------

    def _read_index(self) -> dict[str, _Entry]:
        path = self.root / "index.json"
        if not path.is_file():
            return {}
        try:
            return msgspec.json.decode(path.read_bytes(), type=dict[str, _Entry])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("artifact index unreadable (%s): every file will be re-verified", exc)
            return {}

    def _write_index(self) -> None:
        # a cache: lost in a crash, every file is verified again
        index = msgspec.json.encode(self._index)
        write_atomic(self.root / "index.json", index, mode=0o600, sync=False)

    def _record(self, sha: str) -> None:
        self._index[sha] = _entry((self.objects / sha).stat())
        self._write_index()

    # ---- queries ---------------------------------------------------------------------------

    def path(self, sha256: str) -> Path:
        return self.objects / _checked(sha256)

    def has(self, sha256: str) -> bool:
        return (self.objects / _checked(sha256)).is_file()

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.objects.iterdir() if p.is_file())

    def discard(self, sha256: str) -> None:
        """Remove an object (unless pinned)."""
        if sha256 in self.pinned:
            return
        _remove(self.objects / _checked(sha256))
        if self._index.pop(sha256, None) is not None:
            self._write_index()

    def check(self, *, verify: bool = True) -> list[str]:
        """Verify the cache (at start, after a crash): drop files whose hash does not match
        their name, stray files and leftovers. Returns the hashes dropped. `verify=False`
        only clears leftovers (a cache whose writers verified every file before keeping it,
        and that is too large to hash at every start)."""
        dropped = []
        stray_before = time.time() - STRAY_AGE_S
        for p in list(self.objects.iterdir()):
            name = p.name
            if not SHA256_RE.match(name) or not p.is_file():
                # A write under way (another process sharing the cache) is young: left alone.
                if _mtime(p) < stray_before:
                    log.warning("removing stray file %s from the artifact cache", p)
                    _remove(p)
                continue
            if not verify:
                continue
            st = p.stat()
            entry = self._index.get(name)
            if entry is not None and entry.vouches_for(st):
                continue  # verified before and unchanged since
            if sha256_file(p) != name:
                log.warning("artifact %s fails verification (truncated or altered): dropped", name)
                _remove(p)
                self._index.pop(name, None)
                dropped.append(name)
            else:
                self._index[name] = _entry(st)
        for name in list(self._index):
            if not (self.objects / name).is_file():
                del self._index[name]
        stale = time.time() - PARTIAL_MAX_AGE_S
        for p in self.partial.iterdir():  # downloads abandoned long ago
            if p.is_file() and p.stat().st_mtime < stale:
                log.info("removing an abandoned partial download %s", p.name[:12])
                _remove(p)
        self._write_index()
        return dropped

    def adopt(self, folder: Path, suffix: str = "") -> int:
        """Move files named by their SHA-256 (and `suffix`) from `folder` (a flat store an
        earlier release kept) into the cache; returns how many. Renames only: nothing is
        copied. A missing folder has nothing to adopt."""
        moved = 0
        for p in folder.iterdir() if folder.is_dir() else ():
            sha = p.name.removesuffix(suffix) if p.name.endswith(suffix) else ""
            if p.is_file() and SHA256_RE.match(sha) and not (self.objects / sha).exists():
                os.replace(p, self.objects / sha)
                moved += 1
        return moved

    # ---- storing what the caller has ---------------------------------------------------

    async def receive(self, sha256: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Keep an artifact streamed in (an upload) if its bytes hash to `sha256` and number
        at most `max_bytes`; returns its size. A file already here is kept and the stream
        drained. Raises `ArtifactError` (nothing is kept) otherwise."""
        sha = _checked(sha256)
        target = self.objects / sha
        digest = hashlib.sha256()
        size = 0
        async with self._locks.setdefault(sha, asyncio.Lock()):
            if target.is_file():  # already here: drain the stream, keep the stored copy
                async for _ in chunks:
                    pass
                return target.stat().st_size
            with atomic_file(target, mode=0o600) as out:  # moved in only if it checks out
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise ArtifactError(f"it is larger than the limit of {max_bytes} bytes")
                    digest.update(chunk)
                    out.write(chunk)
                if digest.hexdigest() != sha:
                    raise ArtifactError(
                        f"its bytes hash to {digest.hexdigest()}, not {sha}; send them again"
                    )
        self._record(sha)
        return size

    def put(self, sha256: str, data: bytes) -> Path:
        """Keep `data` (already in hand) as artifact `sha256`; raises `ArtifactError` if it
        hashes to something else."""
        sha = _checked(sha256)
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha:
            raise ArtifactError(f"the bytes hash to {digest}, not {sha}: refused")
        target = self.objects / sha
        if not target.is_file():
            self._make_room(len(data), keep=sha)
            write_atomic(target, data, mode=0o600)
        self._record(sha)
        return target

    # ---- fetching --------------------------------------------------------------------------

    async def fetch(
        self,
        sha256: str,
        url: str,
        size: int,
        *,
        session: aiohttp.ClientSession | None = None,
        progress: Progress | None = None,
        pin: str = "",
    ) -> Path:
        """The verified file for `sha256`, downloading it from `url` if needed (resuming an
        interrupted download). `pin` is the SHA-256 (hex) of the server's TLS certificate to
        accept (a self-signed broker). Raises `ArtifactError` when it cannot."""
        sha = _checked(sha256)
        if size < 0:
            raise ArtifactError(f"artifact {sha[:12]}: negative size {size}")
        if size > self.limit:
            raise ArtifactError(
                f"artifact {sha[:12]} has {size} bytes, more than the whole cache limit of "
                f"{self.limit} bytes; raise the provider's cache size"
            )
        lock = self._locks.setdefault(sha, asyncio.Lock())
        async with lock:
            target = self.objects / sha
            if target.is_file():
                os.utime(target)  # most recently used
                self._record(sha)
                return target
            part = self.partial / sha
            self._make_room(size - (part.stat().st_size if part.exists() else 0), keep=sha)
            import aiohttp

            own = session is None
            session = session or aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s)
            )
            try:
                await self._download(session, sha, url, size, progress, pin)
            finally:
                if own:
                    await session.close()
            self._record(sha)
            return target

    async def _download(
        self,
        session: aiohttp.ClientSession,
        sha: str,
        url: str,
        size: int,
        progress: Progress | None,
        pin: str = "",
    ) -> None:
        import aiohttp
        import tenacity

        part = self.partial / sha
        transient = (aiohttp.ClientError, TimeoutError, ConnectionError)
        retrying = tenacity.AsyncRetrying(  # waits backoff_s, 2 * backoff_s, 4 * backoff_s, ...
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_exponential(multiplier=self.backoff_s),
            retry=tenacity.retry_if_exception_type(transient),
            reraise=True,  # the last transient error itself, not a RetryError
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._resume(session, sha, url, size, progress, pin)
        except transient as exc:
            raise ArtifactError(
                f"could not download {sha[:12]} from {redact(url)} after {self.attempts} "
                f"attempts: {redact(str(exc))}; the partial file is kept and the next attempt "
                "resumes it"
            ) from None
        digest = await asyncio.to_thread(sha256_file, part)  # (left behind if cancelled: it
        # only reads, and the next fetch hashes again)
        if digest != sha:
            _remove(part)
            raise ArtifactError(
                f"artifact from {redact(url)} has SHA-256 {digest}, not {sha}: the server sent "
                f"a different or corrupt file; it was deleted"
            )
        # fsyncing gigabytes takes a while: not on the event loop
        await _to_the_end(move_atomic, part, self.objects / sha)

    async def _resume(
        self,
        session: aiohttp.ClientSession,
        sha: str,
        url: str,
        size: int,
        progress: Progress | None,
        pin: str,
    ) -> None:
        """One attempt: fetch what `partial/<sha>` still lacks. A transient error (logged)
        leaves what arrived in place for the next attempt."""
        import aiohttp

        part = self.partial / sha
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            _remove(part)  # longer than the artifact: not ours
            have = 0
        if have == size:
            return
        try:
            await self._get(session, url, part, have, size, progress, pin)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            got = part.stat().st_size if part.exists() else 0
            log.info(
                "download of %s interrupted at %d of %d bytes (%s); resuming",
                sha[:12],
                got,
                size,
                redact(str(exc)),
            )
            raise

    async def _get(
        self,
        session: aiohttp.ClientSession,
        url: str,
        part: Path,
        have: int,
        size: int,
        progress: Progress | None,
        pin: str = "",
    ) -> None:
        import aiohttp

        headers = {"Range": f"bytes={have}-"} if have else {}
        ssl: bool | aiohttp.Fingerprint = True
        if pin:
            try:
                ssl = aiohttp.Fingerprint(bytes.fromhex(pin))
            except ValueError as exc:
                raise ArtifactError(f"bad certificate fingerprint {pin!r}: {exc}") from None
        shown = redact(url)  # (a link's token is never logged)
        async with session.get(url, headers=headers, ssl=ssl) as resp:
            if resp.status == 404:
                raise ArtifactError(f"{shown} does not have this artifact (HTTP 404)")
            if resp.status not in (200, 206):
                raise ArtifactError(f"{shown} answered HTTP {resp.status}: {resp.reason}")
            if resp.status == 200 and have:
                have = 0  # the server ignored the range: start over
            mode = "ab" if have else "wb"
            done = have
            # (owner-only, as everything in the cache; appends of 1 MiB blocks, no waits)
            with open(part, mode, opener=_private) as f:  # noqa: ASYNC230
                async for block in resp.content.iter_chunked(CHUNK):
                    if done + len(block) > size:
                        raise ArtifactError(
                            f"{shown} sent more than the {size} bytes expected: refused"
                        )
                    f.write(block)
                    done += len(block)
                    if progress is not None:
                        progress(done, size)
            if done < size:
                raise aiohttp.ClientPayloadError(f"connection ended at {done} of {size} bytes")

    def _make_room(self, size: int, keep: str) -> None:
        """Evict until `size` more bytes fit: other artifacts' partial downloads first, then
        the least recently used objects that no loaded stage pins. `keep`'s partial stays."""
        if self.limit == float("inf"):
            return
        files = [p for p in self.objects.iterdir() if p.is_file() and SHA256_RE.match(p.name)]
        partials = [p for p in self.partial.iterdir() if p.is_file()]
        used = sum(p.stat().st_size for p in files) + sum(p.stat().st_size for p in partials)
        if used + size <= self.limit:
            return
        others = sorted((p for p in partials if p.name != keep), key=lambda p: p.stat().st_mtime)
        objects = sorted(files, key=lambda p: p.stat().st_mtime)
        for p in [*others, *(p for p in objects if p.name not in self.pinned)]:
            used -= p.stat().st_size
            log.info("evicting %s (least recently used)", p.name[:12])
            _remove(p)
            self._index.pop(p.name, None)
            if used + size <= self.limit:
                break
        self._write_index()
        if used + size > self.limit:
            raise ArtifactError(
                f"no room for {size} more bytes in the artifact cache (limit {self.limit} "
                f"bytes, {used} held by stages this provider has loaded); raise the cache size"
            )


async def _to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread. A cancelled caller still waits for the thread to
    finish before the cancellation goes on (and with it the artifact's lock): a move left
    behind would take `partial/<sha>` from under the next fetch of the same artifact (a
    stage assignment replaced while its download was being moved into place: the new load
    found the partial file gone)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():  # (a second cancellation waits too)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({work})
        if not work.cancelled():
            work.exception()  # retrieved: its outcome no longer matters to anyone
        raise


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _checked(sha256: str) -> str:
    if not SHA256_RE.match(sha256):
        raise ArtifactError(f"{sha256!r} is not a SHA-256 hex digest")
    return sha256


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")  # gone meanwhile (a write finished): nothing to remove


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
