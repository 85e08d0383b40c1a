"""The broker's durable state in one SQLite file (WAL): models, placements, jobs, microbatch
results and the bounded event log.

Everything a restarted broker needs is here; what providers tell it (membership, loaded
stages) is soft state they re-announce. Writes are small and happen on the event loop
thread; each is its own transaction, so a broker killed at any moment leaves a consistent
file. Nothing is pickled: rows hold JSON text and raw little-endian float32 bytes. The file
(with its -wal and -shm) is its owner's alone (0600): it holds every job's texts and results.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from broker.schema import EventRow, JobRow, open_schema
from files.private import private_file


class Store:
    """One SQLite connection, used from the event loop thread only."""

    def __init__(self, path: Path, *, event_log_size: int = 100_000) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        private_file(path)  # owner-only; SQLite gives a new -wal and -shm the file's mode
        for side in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if side.exists():  # (left by an earlier run)
                private_file(side)
        self.path = path
        self.event_log_size = event_log_size
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")
        open_schema(self.db)  # new, or brought up to date (refused if from a newer broker)
        self._since_trim = 0

    def close(self) -> None:
        self.db.close()

    # ---- models and placements -------------------------------------------------------------

    def put_model(self, name: str, manifest: bytes) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO models (name, manifest, added_at) VALUES (?, ?, ?)",
            (name, manifest, time.time()),
        )

    def models(self) -> dict[str, bytes]:
        return {n: bytes(m) for n, m in self.db.execute("SELECT name, manifest FROM models")}

    def put_placement(self, model: str, data: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO placements (model, data) VALUES (?, ?)",
            (model, json.dumps(data)),
        )

    def delete_placement(self, model: str) -> None:
        self.db.execute("DELETE FROM placements WHERE model = ?", (model,))

    def placements(self) -> dict[str, dict[str, Any]]:
        return {m: json.loads(d) for m, d in self.db.execute("SELECT model, data FROM placements")}

    # ---- jobs ------------------------------------------------------------------------------

    def add_job(
        self,
        job_id: str,
        kind: str,
        model: str,
        request: dict[str, Any],
        graph: bytes,
        microbatches: int,
        estimate_s: float,
    ) -> JobRow:
        now = time.time()
        with self.db:
            self.db.execute("BEGIN")
            (seq,) = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()
            self.db.execute(
                "INSERT INTO jobs (id, seq, kind, model, state, request, graph, microbatches, "
                "estimate_s, created, updated) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    seq,
                    kind,
                    model,
                    json.dumps(request),
                    graph.decode(),
                    microbatches,
                    estimate_s,
                    now,
                    now,
                ),
            )
        job = self.job(job_id)
        assert job is not None
        return job

    def set_job_state(self, job_id: str, state: str, error: str = "") -> None:
        self.db.execute(
            "UPDATE jobs SET state = ?, error = ?, updated = ? WHERE id = ?",
            (state, error, time.time(), job_id),
        )

    @staticmethod
    def _job(row: tuple[Any, ...]) -> JobRow:
        return JobRow(
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            json.loads(row[5]),
            row[6].encode(),
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
        )

    @staticmethod
    def _columns(full: bool) -> str:
        """The job columns; without `full`, the (large) request and graph are left empty."""
        body = "request, graph" if full else "'{}', ''"
        return (
            f"id, seq, kind, model, state, {body}, microbatches, estimate_s, created, updated, "
            f"error"
        )

    def job(self, job_id: str, *, full: bool = True) -> JobRow | None:
        row = self.db.execute(
            f"SELECT {self._columns(full)} FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        return self._job(row) if row else None

    def jobs(
        self,
        states: tuple[str, ...] | None = None,
        limit: int = 1000,
        *,
        oldest_first: bool = False,
    ) -> list[JobRow]:
        """Jobs without their request and graph, newest first (or oldest first)."""
        order = "ASC" if oldest_first else "DESC"
        where = ""
        args: tuple[str, ...] = ()
        if states:
            where = f"WHERE state IN ({','.join('?' * len(states))})"
            args = states
        rows = self.db.execute(
            f"SELECT {self._columns(False)} FROM jobs {where} ORDER BY seq {order} LIMIT ?",
            (*args, limit),
        )
        return [self._job(r) for r in rows]

    # ---- results ---------------------------------------------------------------------------

    def put_result(
        self,
        job_id: str,
        idx: int,
        attempts: int,
        shape: tuple[int, ...],
        data: bytes,
        peers: tuple[str, ...] = (),
    ) -> None:
        """Keep a microbatch's result and which providers computed it (so a provider found
        wrong later has its work redone)."""
        now = time.time()
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT OR REPLACE INTO results (job, idx, attempts, shape, data) "
                "VALUES (?, ?, ?, ?, ?)",
                (job_id, idx, attempts, json.dumps(list(shape)), data),
            )
            self.db.execute("DELETE FROM work WHERE job = ? AND idx = ?", (job_id, idx))
            self.db.executemany(
                "INSERT OR REPLACE INTO work (job, idx, peer, at) VALUES (?, ?, ?, ?)",
                [(job_id, idx, p, now) for p in set(peers)],
            )

    def forget_work(self, peer: str, since: float) -> dict[str, int]:
        """Drop the results `peer` computed since `since` (Unix time), in jobs not cancelled
        or failed: {job: microbatches dropped}."""
        with self.db:
            self.db.execute("BEGIN")
            rows = self.db.execute(
                "SELECT w.job, w.idx FROM work w JOIN jobs j ON j.id = w.job "
                "WHERE w.peer = ? AND w.at >= ? AND j.state NOT IN ('cancelled', 'failed')",
                (peer, since),
            ).fetchall()
            dropped: dict[str, int] = {}
            for job, idx in rows:
                self.db.execute("DELETE FROM results WHERE job = ? AND idx = ?", (job, idx))
                self.db.execute("DELETE FROM work WHERE job = ? AND idx = ?", (job, idx))
                dropped[job] = dropped.get(job, 0) + 1
        return dropped

    def done_microbatches(self, job_id: str) -> set[int]:
        return {i for (i,) in self.db.execute("SELECT idx FROM results WHERE job = ?", (job_id,))}

    def count_jobs(self) -> dict[str, int]:
        """Jobs per state."""
        rows = self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        return {state: int(n) for state, n in rows}

    def count_queued(self) -> dict[str, int]:
        """Queued jobs per model."""
        rows = self.db.execute(
            "SELECT model, COUNT(*) FROM jobs WHERE state = 'queued' GROUP BY model"
        )
        return {model: int(n) for model, n in rows}

    def count_done(self, job_id: str) -> int:
        (n,) = self.db.execute("SELECT COUNT(*) FROM results WHERE job = ?", (job_id,)).fetchone()
        return int(n)

    def results(self, job_id: str) -> Iterator[tuple[int, list[int], bytes]]:
        for idx, shape, data in self.db.execute(
            "SELECT idx, shape, data FROM results WHERE job = ? ORDER BY idx", (job_id,)
        ):
            yield idx, json.loads(shape), bytes(data)

    def results_from(
        self, job_id: str, first: int, count: int
    ) -> list[tuple[int, list[int], bytes]]:
        """Up to `count` stored microbatches of a job from index `first` on, in order."""
        rows = self.db.execute(
            "SELECT idx, shape, data FROM results WHERE job = ? AND idx >= ? ORDER BY idx LIMIT ?",
            (job_id, first, count),
        )
        return [(int(idx), json.loads(shape), bytes(data)) for idx, shape, data in rows]

    def delete_results(self, job_id: str) -> int:
        self.db.execute("DELETE FROM work WHERE job = ?", (job_id,))
        cur = self.db.execute("DELETE FROM results WHERE job = ?", (job_id,))
        return cur.rowcount

    def delete_results_from(self, job_id: str, first: int) -> int:
        """Forget results from index `first` on (a fine-tune job went back to a snapshot)."""
        cur = self.db.execute("DELETE FROM results WHERE job = ? AND idx >= ?", (job_id, first))
        return cur.rowcount

    def finetune_steps(self, job_id: str) -> list[tuple[int, list[float]]]:
        """(step, [loss, tokens, seconds]) of each step of a fine-tune job so far."""
        import numpy as np

        return [
            (idx + 1, np.frombuffer(data, dtype=np.float64).tolist())
            for idx, _, data in self.results(job_id)
        ]

    def put_train_step(
        self, job_id: str, step: int, attempts: int, record: bytes, peers: list[str]
    ) -> None:
        """Keep a train job's step (its record as a result) and the replicas that took part,
        in one transaction."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT OR REPLACE INTO results (job, idx, attempts, shape, data) "
                "VALUES (?, ?, ?, ?, ?)",
                (job_id, step - 1, attempts, json.dumps([len(record) // 8]), record),
            )
            self.db.execute(
                "INSERT OR REPLACE INTO replicas (job, step, peers) VALUES (?, ?, ?)",
                (job_id, step, json.dumps(peers)),
            )

    def train_replicas(self, job_id: str) -> list[str]:
        """The replicas of a train job's last recorded step, in ring order."""
        row = self.db.execute("SELECT peers FROM replicas WHERE job = ?", (job_id,)).fetchone()
        return list(json.loads(row[0])) if row else []

    # ---- providers' reputation -------------------------------------------------------------

    def put_reputation(
        self,
        peer: str,
        checks: int,
        agreed: int,
        disagreed: int,
        quarantined: float | None,
        reason: str,
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO reputation (peer, checks, agreed, disagreed, quarantined, "
            "reason) VALUES (?, ?, ?, ?, ?, ?)",
            (peer, checks, agreed, disagreed, quarantined, reason),
        )

    def reputations(self) -> dict[str, dict[str, Any]]:
        rows = self.db.execute(
            "SELECT peer, checks, agreed, disagreed, quarantined, reason FROM reputation"
        )
        return {
            peer: {
                "checks": checks,
                "agreed": agreed,
                "disagreed": disagreed,
                "quarantined": quarantined,
                "reason": reason,
            }
            for peer, checks, agreed, disagreed, quarantined, reason in rows
        }

    # ---- fine-tune snapshots and adapters --------------------------------------------------

    def put_snapshot(self, job_id: str, step: int, records: dict[int, dict[str, Any]]) -> None:
        """Every stage's record of one complete snapshot, in one transaction; older snapshots
        of the job are dropped (only the newest is ever restored)."""
        with self.db:
            self.db.execute("BEGIN")
            for stage, record in records.items():
                self.db.execute(
                    "INSERT OR REPLACE INTO snapshots (job, step, stage, data) VALUES (?, ?, ?, ?)",
                    (job_id, step, stage, json.dumps(record)),
                )
            self.db.execute("DELETE FROM snapshots WHERE job = ? AND step < ?", (job_id, step))

    def latest_snapshot(
        self, job_id: str, stages: int
    ) -> tuple[int, dict[int, dict[str, Any]]] | None:
        """The newest snapshot with a record for each of `stages` stages: (step, records)."""
        rows = self.db.execute(
            "SELECT step, stage, data FROM snapshots WHERE job = ? ORDER BY step DESC", (job_id,)
        ).fetchall()
        by_step: dict[int, dict[int, dict[str, Any]]] = {}
        for step, stage, data in rows:
            by_step.setdefault(step, {})[stage] = json.loads(data)
        for step in sorted(by_step, reverse=True):
            if set(by_step[step]) == set(range(stages)):
                return step, by_step[step]
        return None

    def snapshot_holders(self, job_id: str) -> set[str]:
        peers: set[str] = set()
        for (data,) in self.db.execute("SELECT data FROM snapshots WHERE job = ?", (job_id,)):
            peers.update(h["peer"] for h in json.loads(data)["holders"])
        return peers

    def put_adapter(self, job_id: str, model: str, sha256: str, size: int) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO adapters (job, model, sha256, size, created) "
            "VALUES (?, ?, ?, ?, ?)",
            (job_id, model, sha256, size, time.time()),
        )

    def adapter(self, job_id: str) -> dict[str, Any] | None:
        row = self.db.execute(
            "SELECT model, sha256, size, created FROM adapters WHERE job = ?", (job_id,)
        ).fetchone()
        if row is None:
            return None
        return {"job": job_id, "model": row[0], "sha256": row[1], "size": row[2], "created": row[3]}

    # ---- events ----------------------------------------------------------------------------

    def add_event(
        self, kind: str, data: dict[str, Any], job: str | None = None, peer: str | None = None
    ) -> EventRow:
        at = time.time()
        cur = self.db.execute(
            "INSERT INTO events (at, kind, job, peer, data) VALUES (?, ?, ?, ?, ?)",
            (at, kind, job, peer, json.dumps(data, default=str)),
        )
        event_id = int(cur.lastrowid or 0)
        self._since_trim += 1
        if self._since_trim >= max(1, self.event_log_size // 100):
            self._since_trim = 0
            self.db.execute("DELETE FROM events WHERE id <= ?", (event_id - self.event_log_size,))
        return EventRow(event_id, at, kind, job, peer, data)

    def events(
        self, *, job: str | None = None, since: int = 0, limit: int = 1000
    ) -> list[EventRow]:
        if job is not None:
            rows = self.db.execute(
                "SELECT id, at, kind, job, peer, data FROM events WHERE job = ? AND id > ? "
                "ORDER BY id LIMIT ?",
                (job, since, limit),
            )
        else:
            rows = self.db.execute(
                "SELECT id, at, kind, job, peer, data FROM events WHERE id > ? ORDER BY id LIMIT ?",
                (since, limit),
            )
        return [EventRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    def last_event_id(self) -> int:
        (n,) = self.db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()
        return int(n)

    def story(self, job: str, limit: int = 10_000) -> list[EventRow]:
        """The job's events, with the swarm events about the providers it used (losses,
        promotions, repairs) that happened while it ran, in order."""
        own = self.events(job=job, limit=limit)
        if not own:
            return []
        peers: set[str] = set()
        for e in own:
            if e.peer:
                peers.add(e.peer)
            for stage in e.data.get("route") or []:
                peers.update(p for p in (stage if isinstance(stage, list) else [stage]))
        if not peers:
            return own
        marks = ",".join("?" * len(peers))
        rows = self.db.execute(
            f"SELECT id, at, kind, job, peer, data FROM events WHERE job IS NULL AND peer IN "
            f"({marks}) AND id > ? AND id < ? ORDER BY id LIMIT ?",
            (*sorted(peers), own[0].id, own[-1].id, limit),
        )
        swarm = [EventRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]
        return sorted(own + swarm, key=lambda e: e.id)
