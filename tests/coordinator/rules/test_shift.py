"""One rank's extra call shifting every later one (hangwatch.coordinator.rules.shift)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from hangwatch.coordinator.rules import explain_extra_call
from hangwatch.records import CallRecord
from tests.coordinator.rules._calls import call, t


def _hist(
    ops: Sequence[tuple[str, int]], rank: int, start: int = 10, sites: Mapping[int, str] | None = None
) -> list[CallRecord]:
    out = []
    for k, (op, n) in enumerate(ops):
        seq = start + k
        ins = [t(n)] if op != "barrier" else []
        site = (sites or {}).get(seq, f"train.py:{20 + k}")
        out.append(call(rank, op, ins=ins, seq=seq, site=site, call_id=seq))
    return out


BASE = [("all_reduce", 4), ("all_reduce", 4), ("barrier", 0), ("all_reduce", 8), ("broadcast", 2)]


def test_explain_extra_call() -> None:
    extra = [*BASE[:2], ("all_reduce", 1), *BASE[2:]]
    history = {
        0: _hist(BASE, 0),
        1: _hist(extra, 1, sites={12: "train.py:30"}),
        2: _hist(BASE, 2),
    }
    assert explain_extra_call(history, 12) == (
        "rank 1 made an extra all_reduce at train.py:30 (seq 12); every later call on rank 1 is shifted by one"
    )


def test_explain_extra_call_two_ranks_says_it_could_be_a_skip() -> None:
    extra = [*BASE[:2], ("all_reduce", 1), *BASE[2:]]
    text = explain_extra_call({0: _hist(extra, 0), 1: _hist(BASE, 1)}, 12)
    assert text is not None
    assert text.startswith("rank 0 made an extra all_reduce")
    assert "rank 1 skipping it" in text


def test_explain_extra_call_when_the_shift_shows_later() -> None:
    # the extra all_reduce [4] looks like the next one, so the shift is visible at seq 13
    extra = [BASE[0], BASE[1], ("all_reduce", 4), *BASE[2:]]
    history = {0: _hist(BASE, 0), 1: _hist(extra, 1), 2: _hist(BASE, 2)}
    text = explain_extra_call(history, 12)
    assert text is not None and text.startswith("rank 1 made an extra all_reduce")


@pytest.mark.parametrize(
    "history",
    [
        pytest.param({0: _hist(BASE, 0), 1: _hist([*BASE[:2], ("all_reduce", 1), *BASE[3:]], 1)}, id="substituted"),
        pytest.param({0: _hist(BASE, 0), 1: _hist([*BASE[:2], ("all_reduce", 1)], 1)}, id="no later call to confirm"),
        pytest.param({0: _hist(BASE, 0), 1: _hist(BASE, 1)}, id="identical"),
        pytest.param({0: _hist(BASE, 0)}, id="one rank"),
        pytest.param(
            {
                0: _hist(BASE, 0),
                1: _hist([*BASE[:2], ("all_reduce", 1), *BASE[2:]], 1),
                2: _hist([*BASE[:2], ("all_reduce", 1), *BASE[2:]], 2),
            },
            id="two ranks with the extra call: not one rank",
        ),
    ],
)
def test_explain_extra_call_none(history: dict[int, list[CallRecord]]) -> None:
    assert explain_extra_call(history, 12) is None


def test_explain_extra_call_at_a_thousand_ranks() -> None:
    """Ranks with the same history are compared once (this took minutes when every rank was
    compared with every other one)."""
    extra = [*BASE[:2], ("all_reduce", 1), *BASE[2:]]
    history = {rk: _hist(extra if rk == 700 else BASE, rk, sites={12: "train.py:30"}) for rk in range(1024)}
    text = explain_extra_call(history, 12)
    assert text is not None and text.startswith("rank 700 made an extra all_reduce at train.py:30 (seq 12)")
    history[701] = _hist(extra, 701)  # two ranks made it: not one rank's extra call
    assert explain_extra_call(history, 12) is None
