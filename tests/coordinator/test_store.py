"""The incident store: survives restarts, prunes oldest-first under its cap, fails loudly but
harmlessly on a full disk and writes what it kept once there is room, moves a corrupt database
aside and starts afresh, keeps its files private whatever the umask, and refuses an unusable data
directory with a clear error."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from hangwatch.coordinator.store import IncidentStore, StoreError
from hangwatch.diagnosis.incidents import Finding, Incident


def incident(n: int, payload: int = 100) -> Incident:
    finding = Finding(
        "stuck_collective", f"stuck:0:{n}", [1], [0], "x" * payload, "hint", onset_time=float(n), group="0", seq=n
    )
    return Incident.from_finding(f"inc-{n:04d}", "job", finding, now=float(n) + 1)


def test_round_trip_and_numbering(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path)
    for n in (1, 2, 3):
        assert store.save(incident(n))
    store.close()
    again = IncidentStore(tmp_path)
    assert [i.id for i in again.load()] == ["inc-0001", "inc-0002", "inc-0003"]
    assert again.load()[0].to_json() == incident(1).to_json()
    assert again.next_number() == 4


def test_prunes_oldest_first_under_the_cap(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path, max_bytes=64 * 1024)
    for n in range(1, 200):
        assert store.save(incident(n, payload=2000))
    kept = [i.id for i in store.load()]
    assert store.pruned > 0
    assert kept[-1] == "inc-0199"  # the newest is always kept
    assert "inc-0001" not in kept  # the oldest went first
    assert kept == sorted(kept)
    assert store.used_bytes() <= 64 * 1024


def test_full_disk_is_counted_and_written_once_there_is_room(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path)
    assert store.save(incident(1))
    # SQLite's own "database or disk is full", as on a full filesystem
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")
    big = incident(2, payload=200_000)
    assert store.save(big) is False
    assert store.write_errors == 1
    assert "full" in store.last_error
    assert big.summary  # the caller's incident object is untouched (the coordinator keeps it in memory)
    assert list(store.unsaved) == ["inc-0002"] and store.retry() is False  # still full
    store.db.execute("PRAGMA max_page_count = 1073741823")  # room again
    assert store.retry() is True and store.unsaved == {}
    store.close()
    assert [i.id for i in IncidentStore(tmp_path).load()] == ["inc-0001", "inc-0002"]


def test_a_corrupt_database_is_moved_aside_and_a_fresh_one_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    garbage = b"this is not a database" * 100
    (tmp_path / "hangwatch.sqlite3").write_bytes(garbage)
    store = IncidentStore(tmp_path)
    assert store.moved_aside and Path(store.moved_aside).read_bytes() == garbage  # kept for a post-mortem
    assert store.load() == [] and store.save(incident(1))
    assert [r.message for r in caplog.records if "moved aside" in r.message]  # one clear line


def test_a_database_with_a_corrupt_page_is_moved_aside(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path)
    for n in range(1, 40):
        store.save(incident(n, payload=3000))
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    path = tmp_path / "hangwatch.sqlite3"
    data = bytearray(path.read_bytes())
    data[4096 * 3 : 4096 * 3 + 512] = b"\xff" * 512  # one page scribbled over
    path.write_bytes(bytes(data))
    again = IncidentStore(tmp_path)
    assert again.moved_aside and again.save(incident(99))


def test_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        data = tmp_path / "data"
        IncidentStore(data).save(incident(1))
    finally:
        os.umask(old)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for path in data.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    IncidentStore(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700


def test_data_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_text("a file, not a directory")
    with pytest.raises(StoreError, match="cannot use data directory"):
        IncidentStore(path)


def test_wal_mode(tmp_path: Path) -> None:
    IncidentStore(tmp_path).save(incident(1))
    mode = sqlite3.connect(tmp_path / "hangwatch.sqlite3").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_a_garbage_write_ahead_log_is_moved_aside_not_silently_dropped(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path)
    store.save(incident(1))
    store.close()
    wal = tmp_path / "hangwatch.sqlite3-wal"
    wal.write_bytes(b"garbage " * 512)
    again = IncidentStore(tmp_path)
    assert again.moved_aside.startswith(str(wal)) and Path(again.moved_aside).exists()
    assert [i.id for i in again.load()] == ["inc-0001"]  # what the database itself held is kept
