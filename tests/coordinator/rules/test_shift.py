"""One rank's extra call shifting every later one (hangwatch.coordinator.rules.shift)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from hangwatch.coordinator.rules import explain_extra_call, explain_skipped_backward
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


def _forwards(seqs: list[int], group: str = "0", first: int = 1) -> list[tuple[int, str, int, int]]:
    """A rank's DDP forwards: the n-th (from ``first``) began at ``seqs[n - first]``; step = n - 1."""
    return [(first + i, group, seq, first + i - 1) for i, seq in enumerate(seqs)]


def test_a_forward_without_its_backward_is_named() -> None:
    """Rank 1 skipped the backward of forward 6 (one all-reduce a step): from forward 7 on its
    seq at each forward is one behind rank 0's, and it ran as many forwards."""
    ref = list(range(1, 31))  # rank 0: one all-reduce per step
    mine = ref[:6] + [s - 1 for s in ref[6:]]
    found = explain_skipped_backward({0: _forwards(ref), 1: _forwards(mine)}, 1, [0], "0")
    assert found is not None
    text, facts = found
    assert facts == {"forward": 6, "step": 5, "behind": 1}
    assert text.startswith("rank 1 ran forward pass 6 (step 5) without its backward")


def test_several_buckets_per_backward_and_a_window_that_starts_late() -> None:
    ref = [3 * n for n in range(40, 70)]  # three buckets a step, forwards 40-69 kept
    mine = ref[:10] + [s - 3 for s in ref[10:]]
    ranks = {0: _forwards(ref, first=40), 2: _forwards(ref, first=40), 1: _forwards(mine, first=40)}
    found = explain_skipped_backward(ranks, 1, [0, 2], "0")
    assert found is not None and found[1] == {"forward": 49, "step": 48, "behind": 3}


def test_look_alikes_are_not_told_as_a_skipped_backward() -> None:
    ref = list(range(1, 31))
    # it left the loop early: fewer forwards than the others, level while it ran
    assert explain_skipped_backward({0: _forwards(ref), 1: _forwards(ref[:29])}, 1, [0], "0") is None
    # the waiting rank ran an extra forward with no backward (a metric with grad on): it is ahead
    extra = [*ref[:6], ref[5], *ref[6:29]]
    assert explain_skipped_backward({0: _forwards(extra), 1: _forwards(ref)}, 1, [0], "0") is None
    # level all along (the culprit is absent for another reason)
    assert explain_skipped_backward({0: _forwards(ref), 1: _forwards(ref)}, 1, [0], "0") is None
    # behind from before the forwards kept: when it skipped is unknown
    assert explain_skipped_backward({0: _forwards(ref), 1: _forwards([s - 1 for s in ref])}, 1, [0], "0") is None
    # a gap that grows (two skips, or something else): not one skipped backward
    two = ref[:6] + [s - 1 for s in ref[6:15]] + [s - 2 for s in ref[15:]]
    assert explain_skipped_backward({0: _forwards(two), 1: _forwards(two[:6] + two[6:])}, 1, [0], "0") is None
    assert explain_skipped_backward({0: _forwards(ref), 1: _forwards(two)}, 1, [0], "0") is None
    # another group's forwards, or none at all
    assert explain_skipped_backward({0: _forwards(ref, "1"), 1: _forwards(ref[:6], "1")}, 1, [0], "0") is None
    assert explain_skipped_backward({}, 1, [0], "0") is None
