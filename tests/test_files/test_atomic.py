"""Atomic writes: the old content or the new, never half; nothing left behind on failure."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from files.atomic import atomic_file, link_atomic, move_atomic, write_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("crash mid-write")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"


def test_modes_are_set_before_the_file_appears(tmp_path: Path) -> None:
    secret = tmp_path / "sub" / "key"
    write_atomic(secret, b"k", mode=0o600)  # its folder is made too
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    plain = tmp_path / "plain"
    write_atomic(plain, b"p")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~umask


def test_links_and_moves_replace_what_was_there(tmp_path: Path) -> None:
    source = tmp_path / "object"
    source.write_bytes(b"artifact")
    target = tmp_path / "pkg" / "stage.onnx"
    link_atomic(source, target)
    link_atomic(source, target)  # already the same file: nothing to do
    assert target.read_bytes() == b"artifact" and os.path.samefile(source, target)
    done = tmp_path / "done"
    move_atomic(source, done)
    assert done.read_bytes() == b"artifact" and not source.exists()
