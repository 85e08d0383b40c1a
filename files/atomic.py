"""Atomic file writes: a reader (or a process started after a crash) sees the old file or the
new one, never half of one.

    write_atomic(path, data)                  # bytes, fsynced, then renamed over `path`
    with atomic_file(path, mode=0o600) as f:  # streamed writes; on an exception nothing moves
        f.write(chunk)

The temporary file lives beside `path` (a rename is atomic only within one file system) under a
unique name, so two writers never share one; it is removed when the write fails. The data is
fsynced before the rename and the folder after it, so a power cut cannot leave an empty file
under the final name. (The `atomicwrites` package did this once; it is archived, hence these
few lines.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    """The process's umask, read once (reading it means setting it: not safe to do while
    other threads create files)."""
    if not hasattr(os, "umask"):
        return 0
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


@contextlib.contextmanager
def atomic_file(path: Path, *, mode: int | None = None, sync: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into; moved over `path` when the block ends
    without an exception. `mode` sets its permission bits (default: what a plain write would
    get under the umask); `sync=False` skips the fsyncs (for caches a crash may lose)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                os.fchmod(f.fileno(), mode if mode is not None else 0o666 & ~_UMASK)
            except OSError:  # a file system without permissions (FAT, some shares)
                if mode is not None:
                    raise
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        sync_folder(path.parent)


def write_atomic(path: Path, data: bytes, *, mode: int | None = None, sync: bool = True) -> None:
    """Replace `path`'s content with `data`, atomically."""
    with atomic_file(path, mode=mode, sync=sync) as f:
        f.write(data)


def move_atomic(source: Path, path: Path) -> None:
    """Rename a finished file (written elsewhere on the same file system) to `path`, with the
    data and the folder synced, so `path` never names a partial file."""
    with open(source, "rb") as f:
        os.fsync(f.fileno())
    os.replace(source, path)
    sync_folder(path.parent)


def link_atomic(source: Path, path: Path) -> None:
    """Make `path` name the same file as `source` (a hard link; a copy where the file system
    has none), replacing whatever `path` named, atomically."""
    if path.exists() and os.path.samefile(source, path):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.link")  # one per call
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (another file system, FAT, some shares)
        with atomic_file(path) as f, open(source, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)
        return
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def sync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable (where the platform can)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
