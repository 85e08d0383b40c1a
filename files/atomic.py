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
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: Path, *, mode: int | None = None, sync: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into; moved over `path` when the block ends
    without an exception. `mode` sets its permission bits (default: the umask's);
    `sync=False` skips the fsyncs (for caches a crash may lose)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        elif hasattr(os, "umask"):  # mkstemp makes 0600; a plain write would follow the umask
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (another file system, FAT, some shares)
        with atomic_file(path) as f, open(source, "rb") as src:
            while block := src.read(1 << 20):
                f.write(block)
        return
    os.replace(tmp, path)


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
