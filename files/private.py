"""What a data directory holds stays its owner's, and secrets stay out of messages.

    private_dir(data_dir, ["artifacts"])  # 0700, created if absent; the files in it and
                                          # all under artifacts/ made owner-only (logged)
    private_file(path)                    # created 0600 (before SQLite opens it), or made so
    redact(text)                          # "...&token=REDACTED": no log shows a link's token

A broker's data directory holds every job's texts and results (`broker.db`), the secret that
signs artifact links and the peer's identity key; a provider's holds its identity key and its
artifact cache. Both are kept owner-only whatever the umask: directories 0700, files 0600.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

OTHERS = 0o077  # group and other permission bits
_TOKEN = re.compile(r"(token=)[^&\s\"'#]+", re.IGNORECASE)


def private_dir(root: Path, folders: Iterable[str] = ()) -> int:
    """Create `root` (mode 0700) if absent, and take group and other permissions off it, off
    the files directly in it and off everything under its `folders` (those the caller keeps
    there: a directory named on a command line may hold more, which is left alone, as are
    symbolic links). Returns how many entries were changed; a warning names the directory
    when any were, since others could have read them until now."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if sys.platform == "win32":  # (permissions there are ACLs, inherited from the profile)
        return 0
    changed = _tighten(root)
    for entry in root.iterdir():
        if entry.is_file() and not entry.is_symlink():
            changed += _tighten(entry)
    for name in folders:
        top = root / name
        if top.is_symlink() or not top.is_dir():
            continue
        changed += _tighten(top)
        for folder, dirs, files in os.walk(top):
            changed += sum(_tighten(Path(folder) / n) for n in [*dirs, *files])
    if changed:
        log.warning(
            "%d files and folders in %s were open to other users: made owner-only (0600 "
            "files, 0700 folders); if others can log in to this machine, consider the "
            "secrets in it exposed",
            changed,
            root,
        )
    return changed


def private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 if absent (so what opens it next keeps that mode:
    SQLite gives its -wal and -shm files the database's), or take group and other permissions
    off it."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    if sys.platform != "win32":
        _tighten(path)


def _tighten(path: Path) -> int:
    try:
        st = path.lstat()
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode) or not mode & OTHERS:
            return 0
        path.chmod(mode & ~OTHERS)
    except OSError as exc:  # gone meanwhile, or not ours: said, and the rest goes on
        log.warning("cannot make %s owner-only: %s", path, exc.strerror or exc)
        return 0
    return 1


def redact(text: str) -> str:
    """`text` with the value of every `token=` (in a URL's query) replaced by "REDACTED"."""
    return _TOKEN.sub(r"\1REDACTED", text) if "token=" in text.lower() else text
