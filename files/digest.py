"""Content addresses: the SHA-256 of a file's bytes, as 64 lowercase hex digits."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")  # \Z: no trailing newline
CHUNK = 1 << 20


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    """The SHA-256 of a file, read in blocks (any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_sha256(text: str) -> bool:
    return bool(SHA256_RE.fullmatch(text))
