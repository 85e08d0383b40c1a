"""API keys managed at run time (`fusionai keys add|revoke|list`, `/v1/keys`), beside the
static `--api-key` and `--api-keys-file` ones (`broker.auth.Keys`).

A managed key has a role (`user`; `admin`, which may also manage keys and models; `gateway`,
which a gateway process presents to the broker), and optional limits: requests in progress at
once (`max_streams`) and requests started per minute (`per_minute`), counted across every
gateway (`broker.leases`). The broker keeps only each key's SHA-256, in its SQLite database
(table `api_keys`, `broker.schema`), with a copy in memory that every change updates; a
revoked key is refused at once by the broker and, by a gateway, within the `ttl_s` its
decision was cached for (`DECISION_TTL_S`).
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.auth import Keys, check_key
from broker.errors import NotFound
from broker.jobkinds import JobError
from proto.api.keys import KeyInfo, KeyRequest, Role

DECISION_TTL_S = 5.0  # a gateway keeps a key's decision at most this long
ROLES: tuple[Role, ...] = ("user", "admin", "gateway")


@dataclass(frozen=True)
class Holder:
    """Who presented a key, and what it may do."""

    id: str  # a managed key's id; "static" for a key of the broker's options
    role: Role
    max_streams: int | None = None
    per_minute: int | None = None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyStore:
    """Managed keys in the broker's database, and the static keys beside them."""

    def __init__(
        self, db: sqlite3.Connection, static: Keys, clock: Callable[[], float] = time.time
    ) -> None:
        self.db = db
        self.static = static
        self.clock = clock
        self._by_digest: dict[bytes, KeyInfo] = {}
        self._load()

    def _load(self) -> None:
        rows = self.db.execute(
            "SELECT id, digest, name, role, max_streams, per_minute, created, revoked FROM api_keys"
        ).fetchall()
        self._infos = [KeyInfo(r[0], r[2], r[3], r[4], r[5], r[6], r[7]) for r in rows]
        self._by_digest = {
            bytes(r[1]): info for r, info in zip(rows, self._infos, strict=True) if r[7] is None
        }

    @property
    def required(self) -> bool:
        """Whether the API needs a key (one is configured, managed or static)."""
        return self.static.required or bool(self._infos)

    @property
    def has_admin(self) -> bool:
        return self.static.has_admin or any(
            i.role == "admin" and i.revoked is None for i in self._infos
        )

    def holder(self, key: str | None) -> Holder | None:
        """What `key` may do; None for no key, an unknown one or a revoked one."""
        if key is None:
            return None
        info = self._by_digest.get(_digest(key))
        if info is not None:
            return Holder(info.id, info.role, info.max_streams, info.per_minute)
        if self.static.valid(key):
            return Holder("static", "admin" if self.static.admin(key) else "user")
        return None

    def add(self, request: KeyRequest) -> tuple[str, KeyInfo]:
        """A new key and its record; the key itself is not kept. While no admin key exists
        the first must be one (else nobody could manage keys once a key is required)."""
        if request.role != "admin" and not self.has_admin:
            raise JobError(
                "role", "add an admin key first: once a key exists, managing keys needs one"
            )
        key = "fai-" + secrets.token_urlsafe(24)
        check_key(key)
        info = KeyInfo(
            "key_" + secrets.token_hex(8),
            request.name,
            request.role,
            request.max_streams,
            request.per_minute,
            round(self.clock(), 3),
        )
        self.db.execute(
            "INSERT INTO api_keys (id, digest, name, role, max_streams, per_minute, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (info.id, _digest(key), info.name, info.role, info.max_streams, info.per_minute,
             info.created),
        )  # fmt: skip
        self._load()
        return key, info

    def revoke(self, key_id: str) -> KeyInfo:
        """Revoke a managed key by its id (again: no change); NotFound for an unknown id."""
        if not any(i.id == key_id for i in self._infos):
            raise NotFound(f"no managed key with id {key_id!r}")
        self.db.execute(
            "UPDATE api_keys SET revoked = ? WHERE id = ? AND revoked IS NULL",
            (round(self.clock(), 3), key_id),
        )
        self._load()
        return next(i for i in self._infos if i.id == key_id)

    def list(self) -> list[KeyInfo]:
        return sorted(self._infos, key=lambda i: (i.created, i.id))
