"""The incident store: survives restarts, prunes oldest-first under its cap, fails loudly but
harmlessly on a full disk, and refuses a corrupt or unusable data directory with a clear error."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from hangwatch.coordinator.incidents import Finding, Incident
from hangwatch.coordinator.store import IncidentStore, StoreError


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


def test_full_disk_is_counted_and_loses_nothing_in_memory(tmp_path: Path) -> None:
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


def test_corrupt_database_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "hangwatch.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot use data directory"):
        IncidentStore(tmp_path)


def test_data_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_text("a file, not a directory")
    with pytest.raises(StoreError, match="cannot use data directory"):
        IncidentStore(path)


def test_wal_mode(tmp_path: Path) -> None:
    IncidentStore(tmp_path).save(incident(1))
    mode = sqlite3.connect(tmp_path / "hangwatch.sqlite3").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
