"""The table of kinds (hangwatch.kinds) refuses a table that does not hold together."""

from __future__ import annotations

import dataclasses

import pytest

from hangwatch import kinds
from hangwatch.kinds import KINDS, IncidentKind, KeyFamily


def _broken(monkeypatch: pytest.MonkeyPatch, table: tuple[kinds.KindRow, ...], says: str) -> None:
    monkeypatch.setattr(kinds, "KINDS", table)
    with pytest.raises(AssertionError, match=says):
        kinds._check()


def test_the_table_holds_together() -> None:
    kinds._check()
    assert {IncidentKind.STRAGGLER} == kinds.WARNING_KINDS
    assert KeyFamily.DIED.value not in kinds.HOLDING_FAMILIES  # a death is a root cause of its own
    assert KeyFamily.STUCK.value in kinds.HOLDING_FAMILIES


def test_a_kind_without_a_row_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _broken(monkeypatch, KINDS[:-1], "kinds without one row")


def test_a_warning_that_holds_its_ranks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    last = dataclasses.replace(KINDS[-1], holds=True)
    _broken(monkeypatch, (*KINDS[:-1], last), "a warning holds no rank")


def test_a_family_both_holding_and_not_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    died = next(i for i, row in enumerate(KINDS) if row.kind is IncidentKind.RANK_DIED)
    table = list(KINDS)
    table[died] = dataclasses.replace(KINDS[died], families=(KeyFamily.DIED, KeyFamily.STUCK))
    _broken(monkeypatch, tuple(table), "both holding and not")


def test_every_kind_is_in_the_readme_table() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert [row.kind.value for row in KINDS if f"| `{row.kind.value}` |" not in readme] == []
