"""The broker database's schema, its version, and the rows read from it.

The version lives in SQLite's `user_version`. A database from before versioning (0, the
tables already there) is version 1: the same tables (any it lacks, from an older broker still,
are created). `open_schema` brings an older database up
to `VERSION` step by step, each step in one transaction, and refuses one written by a newer
broker (it would misread it) with what to do instead.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

VERSION = 3  # bump with a step in MIGRATIONS whenever the tables change

SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    manifest BLOB NOT NULL,
    added_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS placements (
    model TEXT PRIMARY KEY,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    graph TEXT NOT NULL,
    microbatches INTEGER NOT NULL,
    estimate_s REAL NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    error TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS results (
    job TEXT NOT NULL,
    idx INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    shape TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (job, idx)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    job TEXT,
    peer TEXT,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (job, step, stage)
);
CREATE TABLE IF NOT EXISTS adapters (
    job TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS work (
    job TEXT NOT NULL,
    idx INTEGER NOT NULL,
    peer TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (job, idx, peer)
);
CREATE TABLE IF NOT EXISTS reputation (
    peer TEXT PRIMARY KEY,
    checks INTEGER NOT NULL,
    agreed INTEGER NOT NULL,
    disagreed INTEGER NOT NULL,
    quarantined REAL,
    reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_job ON events (job, id);
CREATE INDEX IF NOT EXISTS work_peer ON work (peer, at);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, seq);
"""
# version 2: managed API keys (`broker.keystore`): a key's SHA-256 alone is kept
KEYS_TABLE = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    digest BLOB NOT NULL UNIQUE,
    name TEXT NOT NULL,
    role TEXT NOT NULL,
    max_streams INTEGER,
    per_minute INTEGER,
    created REAL NOT NULL,
    revoked REAL
)
"""
# version 3: the replicas of a train job's last recorded step (found again after a restart)
REPLICAS_TABLE = """
CREATE TABLE IF NOT EXISTS replicas (
    job TEXT PRIMARY KEY,
    step INTEGER NOT NULL,
    peers TEXT NOT NULL
)
"""
SCHEMA = SCHEMA_V1 + KEYS_TABLE + ";" + REPLICAS_TABLE + ";"


# MIGRATIONS[v] brings a version-v database to v + 1 (SQL run in one transaction).
MIGRATIONS: dict[int, str] = {1: KEYS_TABLE, 2: REPLICAS_TABLE}


class SchemaError(RuntimeError):
    """The database cannot be used by this broker; the message says what to do."""


def open_schema(db: sqlite3.Connection) -> int:
    """Create the tables in a new database, or bring an older one up to date; returns the
    version found (0: a new database)."""
    (found,) = db.execute("PRAGMA user_version").fetchone()
    (tables,) = db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()
    if found > VERSION:
        raise SchemaError(
            f"this data folder's database has schema version {found}, written by a newer "
            f"broker; this one reads up to version {VERSION}: upgrade fusionai, or start "
            f"this broker on another --data-dir"
        )
    if not tables:
        db.executescript(SCHEMA)
        db.execute(f"PRAGMA user_version = {VERSION}")
        return 0
    if not found:  # written before the schema was versioned: version 1's tables, of which
        # the oldest such databases lack some (all IF NOT EXISTS)
        db.executescript(SCHEMA_V1)
    version = found or 1
    while version < VERSION:  # each step and its version number in one transaction
        try:
            db.executescript(
                f"BEGIN; {MIGRATIONS[version]}; PRAGMA user_version = {version + 1}; COMMIT;"
            )
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise SchemaError(
                f"upgrading the database from schema version {version} failed ({exc}); "
                f"it is unchanged: keep this data folder and report the error"
            ) from None
        version += 1
    db.execute(f"PRAGMA user_version = {VERSION}")
    return found or 1


@dataclass(frozen=True)
class JobRow:
    id: str
    seq: int
    kind: str
    model: str
    state: str
    request: dict[str, Any]
    graph: bytes
    microbatches: int
    estimate_s: float
    created: float
    updated: float
    error: str


@dataclass(frozen=True)
class EventRow:
    id: int
    at: float
    kind: str
    job: str | None
    peer: str | None
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "at": round(self.at, 6), "kind": self.kind}
        if self.job:
            out["job"] = self.job
        if self.peer:
            out["peer"] = self.peer
        out.update(self.data)
        return out
