"""Incident persistence: SQLite (WAL) in the data directory.

Private whatever the umask: the directory is made (or set) 0700 and the database files 0600, for
stacks hold whatever the ranks' frames show. Writes never raise into the coordinator: a full or
broken disk is logged loudly, counted, and shown in ``status``; the incident stays in memory and
is written once the disk takes writes again (``retry``, and every later save). A database that
is not one (a corrupt page, garbage) is moved aside with one log line and a fresh one started
(``moved_aside``); a data directory that cannot be used at all is a clear error (``StoreError``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from hangwatch.diagnosis.incidents import Incident

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


def _private_dir(path: Path) -> None:
    """``path`` made, or kept, readable by its owner only (0700), whatever the umask."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.getuid():  # another user's directory is theirs to set
        os.chmod(path, 0o700)


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
        self.moved_aside = ""  # where a corrupt database was moved at start ("": none was)
        self.unsaved: dict[str, Incident] = {}  # incidents a failed write left in memory only
        try:
            _private_dir(Path(data_dir))
            try:
                self.db = self._open()
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError) and "unable to open" in str(exc):
                    raise
                self.moved_aside = self._move_aside(exc)
                self.db = self._open()
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot use data directory {data_dir!s}: {exc}") from exc

    def _open(self) -> sqlite3.Connection:
        self._check_wal()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # made private before SQLite opens it
        os.close(fd)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            db.execute("SELECT count(*) FROM incidents").fetchone()
            db.execute("PRAGMA quick_check").fetchone()
        except sqlite3.Error:
            db.close()
            raise
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.chmod(f"{self.path}{suffix}", 0o600)
        return db

    def _check_wal(self) -> None:
        """SQLite ignores a write-ahead log whose header is not one, and the incidents in it with
        it, without a word: such a log is moved aside, said once, and kept for a post-mortem."""
        wal = Path(f"{self.path}-wal")
        try:
            with open(wal, "rb") as f:
                header = f.read(4)
        except OSError:
            return
        if not header or header in (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83"):
            return
        aside = f"{wal}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(wal, aside)
        self.moved_aside = aside
        log.error("the incident database's write-ahead log %s is not one: moved aside to %s", wal, aside)

    def _move_aside(self, exc: Exception) -> str:
        """Move a database SQLite cannot read (and its WAL) aside; the coordinator starts on a
        fresh one instead of failing at every start (a crash loop under systemd)."""
        aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
        log.error(
            "the incident database %s is unreadable (%s): moved aside to %s; starting a new one", self.path, exc, aside
        )
        return aside

    def save(self, incident: Incident) -> bool:
        """Write ``incident`` (and any a failed write left behind); False if it stays unsaved."""
        self.unsaved[incident.id] = incident
        return self.retry() and incident.id not in self.unsaved

    def retry(self) -> bool:
        """Write the incidents that failed to be written (a full disk has room again); True when
        none is left unsaved."""
        for ident, incident in list(self.unsaved.items()):
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
            except sqlite3.Error as exc:
                self.write_errors += 1
                self.last_error = f"{time.strftime('%H:%M:%S')} {exc}"
                log.error("cannot persist incident %s (kept in memory, retried): %s", incident.id, exc)
                return False
            if self.unsaved.get(ident) is incident:
                del self.unsaved[ident]
        return True

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
