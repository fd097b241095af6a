"""Incident persistence: SQLite (WAL) in the data directory.

Writes never raise into the coordinator: a full or broken disk is logged loudly, counted, and
shown in ``status``; the incident stays in memory. A data directory that cannot be opened at
start is a clear error (``StoreError``).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from hangwatch.coordinator.incidents import Incident

log = logging.getLogger("hangwatch.coordinator")

SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    kind TEXT NOT NULL,
    detected_time REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class StoreError(RuntimeError):
    """The data directory cannot be used."""


DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class IncidentStore:
    """Incidents by id; at most ``max_bytes`` of live database pages, oldest incidents pruned first."""

    def __init__(self, data_dir: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(data_dir) / "hangwatch.sqlite3"
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.write_errors = 0
        self.last_error = ""
        self.pruned = 0
        try:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
            self.db.execute("SELECT count(*) FROM incidents").fetchone()
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot use data directory {data_dir!s}: {exc}") from exc

    def save(self, incident: Incident) -> bool:
        body = dict(incident.to_json())
        body["key"] = incident.key
        try:
            with self.lock:
                self.db.execute(
                    "INSERT INTO incidents (id, job, kind, detected_time, body) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET body = excluded.body, kind = excluded.kind",
                    (incident.id, incident.job, incident.kind, incident.detected_time, json.dumps(body)),
                )
                self._prune(keep=incident.id)
            return True
        except sqlite3.Error as exc:
            self.write_errors += 1
            self.last_error = f"{time.strftime('%H:%M:%S')} {exc}"
            log.error("cannot persist incident %s (kept in memory): %s", incident.id, exc)
            return False

    def used_bytes(self) -> int:
        page_size = self.db.execute("PRAGMA page_size").fetchone()[0]
        pages = (
            self.db.execute("PRAGMA page_count").fetchone()[0] - self.db.execute("PRAGMA freelist_count").fetchone()[0]
        )
        return int(page_size * pages)

    def _prune(self, keep: str) -> None:
        """Delete the oldest incidents (never ``keep``) until the live pages fit ``max_bytes``."""
        while self.used_bytes() > self.max_bytes:
            row = self.db.execute(
                "SELECT id FROM incidents WHERE id != ? ORDER BY detected_time, id LIMIT 1", (keep,)
            ).fetchone()
            if row is None:
                return
            self.db.execute("DELETE FROM incidents WHERE id = ?", row)
            self.pruned += 1
            log.warning("data directory over %d bytes: pruned the oldest incident %s", self.max_bytes, row[0])

    def load(self) -> list[Incident]:
        with self.lock:
            rows = self.db.execute("SELECT body FROM incidents ORDER BY detected_time, id").fetchall()
        out: list[Incident] = []
        for (body,) in rows:
            try:
                out.append(Incident.from_json(json.loads(body)))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("skipping unreadable stored incident: %s", exc)
        return out

    def next_number(self) -> int:
        with self.lock:
            rows = self.db.execute("SELECT id FROM incidents").fetchall()
        best = 0
        for (ident,) in rows:
            try:
                best = max(best, int(str(ident).rsplit("-", 1)[-1]))
            except ValueError:
                continue
        return best + 1

    def close(self) -> None:
        with self.lock:
            self.db.close()
