"""``gctune``: the daemons' collector thresholds (the measured reason is in its docstring)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from hangwatch import gctune


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_tune_raises_the_young_threshold_and_keeps_the_others() -> None:
    gc.set_threshold(700, 10, 10)
    gctune.tune()
    assert gc.get_threshold() == (gctune.YOUNG_THRESHOLD, 10, 10)
    assert gc.get_freeze_count() > 0
    gctune.tune()  # idempotent
    assert gc.get_threshold() == (gctune.YOUNG_THRESHOLD, 10, 10)


def test_tune_never_lowers_a_threshold_nor_turns_the_collector_on() -> None:
    gc.set_threshold(500_000, 5, 5)
    gctune.tune()
    assert gc.get_threshold() == (500_000, 5, 5)
    gc.set_threshold(0, 10, 10)  # off: set so by the process, and it stays so
    gctune.tune()
    assert gc.get_threshold()[0] == 0
