"""The artifact cache against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

import files.cache
from files.atomic import move_atomic
from files.cache import PARTIAL_MAX_AGE_S, ArtifactCache, ArtifactError
from files.digest import sha256_file

pytestmark = pytest.mark.timeout(60)
BODY = os.urandom(1000)
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[str]]]:
    ranges: list[str] = []

    async def artifact(request: web.Request) -> web.Response:
        rng = request.headers.get("Range", "")
        ranges.append(rng)
        start = int(rng[6:].split("-")[0]) if rng.startswith("bytes=") else 0
        return web.Response(body=BODY[start:], status=206 if start else 200)

    app = web.Application()
    app.router.add_get("/a", artifact)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/a", ranges
    await runner.cleanup()


async def test_a_resumed_download_needs_room_only_for_what_is_missing(
    server: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, ranges = server
    cache = ArtifactCache(tmp_path, limit_bytes=1500)
    (cache.partial / SHA).write_bytes(BODY[:600])  # a download cut past the middle
    path = await cache.fetch(SHA, url, len(BODY))
    assert path.read_bytes() == BODY and ranges == ["bytes=600-"]


async def test_other_partials_are_evicted_before_objects_and_pinned_objects_stay(
    server: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, _ = server
    cache = ArtifactCache(tmp_path, limit_bytes=1800)
    pinned = os.urandom(500)
    pinned_sha = hashlib.sha256(pinned).hexdigest()
    (cache.objects / pinned_sha).write_bytes(pinned)
    cache.pinned.add(pinned_sha)
    (cache.partial / ("0" * 64)).write_bytes(b"x" * 700)  # someone else's abandoned download
    await cache.fetch(SHA, url, len(BODY))
    assert not (cache.partial / ("0" * 64)).exists()
    assert (cache.objects / pinned_sha).exists() and cache.has(SHA)
    other = os.urandom(900)
    cache.pinned.add(SHA)
    with pytest.raises(ArtifactError, match="no room"):  # 500 + 1000 pinned: 900 more won't fit
        await cache.fetch(hashlib.sha256(other).hexdigest(), url, len(other))


async def test_a_fetch_cancelled_while_its_file_moves_into_place_leaves_the_next_one_whole(
    server: tuple[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage assignment replaced while its artifact was being moved into place (a slow
    fsync) cancels that fetch (twice, here); the next fetch of the same artifact waits for the
    move instead of finding `partial/<sha>` taken from under it mid-way (it failed on
    FileNotFoundError)."""
    url, ranges = server
    cache = ArtifactCache(tmp_path)
    moving, release, moved = threading.Event(), threading.Event(), threading.Event()

    def held_move(source: Path, path: Path) -> None:  # the first move is slow
        if not moving.is_set():
            moving.set()
            release.wait(10)
            move_atomic(source, path)
            moved.set()
        else:
            move_atomic(source, path)

    hashes = 0

    def hash_after_the_move(path: Path) -> str:  # a later hash runs while the first moves
        nonlocal hashes
        hashes += 1
        if hashes > 1:
            moved.wait(10)
        return sha256_file(path)

    monkeypatch.setattr(files.cache, "move_atomic", held_move)
    monkeypatch.setattr(files.cache, "sha256_file", hash_after_the_move)
    first = asyncio.create_task(cache.fetch(SHA, url, len(BODY)))
    assert await asyncio.to_thread(moving.wait, 10)
    first.cancel()
    second = asyncio.create_task(cache.fetch(SHA, url, len(BODY)))
    await asyncio.sleep(0.1)  # the second fetch goes as far as it may meanwhile
    first.cancel()  # and again: the move is still waited for
    await asyncio.sleep(0.1)
    release.set()
    assert (await asyncio.wait_for(second, 10)).read_bytes() == BODY
    with pytest.raises(asyncio.CancelledError):
        await first
    assert ranges == [""]  # downloaded once


async def test_check_drops_altered_files_and_stale_partials(
    server: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, _ = server
    cache = ArtifactCache(tmp_path, limit_bytes=10_000)
    path = await cache.fetch(SHA, url, len(BODY))
    stale = cache.partial / ("1" * 64)
    stale.write_bytes(b"old")
    old = time.time() - PARTIAL_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    kept = path.stat()
    path.write_bytes(BODY[:10] + b"!" + BODY[11:])  # same size, one byte altered,
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # in the same clock tick
    assert ArtifactCache(tmp_path, limit_bytes=10_000).check() == [SHA]
    assert not path.exists() and not stale.exists()


async def test_check_trusts_its_index_only_for_files_older_than_a_clock_tick(
    server: tuple[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = server
    path = await ArtifactCache(tmp_path).fetch(SHA, url, len(BODY))
    hashed: list[Path] = []

    def counted(p: Path) -> str:
        hashed.append(p)
        return sha256_file(p)

    monkeypatch.setattr(files.cache, "sha256_file", counted)
    assert ArtifactCache(tmp_path).check() == []  # recorded as it was written: hashed again
    assert hashed == [path]
    old = time.time_ns() - int(files.cache.RACY_S * 3e9)
    os.utime(path, ns=(old, old))
    assert ArtifactCache(tmp_path).check() == [] and len(hashed) == 2  # its time changed
    assert ArtifactCache(tmp_path).check() == [] and len(hashed) == 2  # verified long after


async def test_uploads_and_puts_are_kept_only_when_their_bytes_match(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)  # no limit: nothing is evicted

    async def chunks(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 300):
            yield data[i : i + 300]

    with pytest.raises(ArtifactError, match="hash to"):
        await cache.receive(SHA, chunks(BODY[:-1] + b"x"), max_bytes=10_000)
    with pytest.raises(ArtifactError, match="larger than"):
        await cache.receive(SHA, chunks(BODY), max_bytes=999)
    assert not cache.has(SHA) and list(cache.objects.iterdir()) == []  # nothing half-kept
    assert await cache.receive(SHA, chunks(BODY), max_bytes=1000) == 1000
    assert cache.path(SHA).read_bytes() == BODY
    assert await cache.receive(SHA, chunks(BODY), max_bytes=1000) == 1000  # kept once
    with pytest.raises(ArtifactError, match="hash to"):
        cache.put(hashlib.sha256(b"other").hexdigest(), b"not other")
    assert cache.put(hashlib.sha256(b"other").hexdigest(), b"other").read_bytes() == b"other"


def test_a_flat_store_from_an_earlier_release_is_adopted(tmp_path: Path) -> None:
    (tmp_path / SHA).write_bytes(BODY)  # as the broker kept artifacts before
    (tmp_path / "notes.txt").write_text("not an artifact")
    cache = ArtifactCache(tmp_path)
    assert cache.adopt(tmp_path) == 1
    assert cache.has(SHA) and cache.check() == []
    assert (tmp_path / "notes.txt").exists()  # only what is named by its hash moves


def test_a_check_leaves_writes_under_way_alone_and_sweeps_old_leftovers(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    young = cache.objects / f".{SHA}.abc.tmp"  # another process sharing the cache, writing
    old = cache.objects / f".{SHA}.def.tmp"  # a crashed write's leftover
    young.write_bytes(b"half")
    old.write_bytes(b"half")
    long_ago = time.time() - 2 * 3600
    os.utime(old, (long_ago, long_ago))
    assert cache.check() == []
    assert young.exists() and not old.exists()
