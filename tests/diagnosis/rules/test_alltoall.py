"""All-to-all pairing (hangwatch.diagnosis.rules.alltoall) and the all-to-all single-call
checks, through compare_collective."""

from __future__ import annotations

import pytest

from hangwatch.catalogue import INPUT_SPLITS, OUTPUT_SPLITS, SPLITS_VARY
from hangwatch.diagnosis.rules import compare_collective
from tests.diagnosis.rules._calls import F64, UNEVEN, Case, a2a_list, a2a_single, call, check_mismatch, same, t
from tests.diagnosis.rules._calls import with_ as _with

VARY = {INPUT_SPLITS: SPLITS_VARY, OUTPUT_SPLITS: SPLITS_VARY}
SEEN = {INPUT_SPLITS: "1,1,1", OUTPUT_SPLITS: "1,1,1"}


def _healthy() -> list[Case]:
    a2a_group_rank = a2a_list([[(1,), (2,)], [(3,), (4,)]])
    # ranks 5 and 3 in a group [5, 3]: group index order differs from rank order
    swapped = {
        5: call(5, "all_to_all", ins=[t(1), t(2)], outs=[t(1), t(3)], extra={"group_rank": "0"}),
        3: call(3, "all_to_all", ins=[t(3), t(4)], outs=[t(2), t(4)], extra={"group_rank": "1"}),
    }
    return [
        Case("all_to_all_single uneven consistent", a2a_single(UNEVEN), 3),
        Case("all_to_all_single uneven rows", a2a_single(UNEVEN, row=4), 3),
        Case("all_to_all_single even", same(4, op="all_to_all_single", ins=[t(8, 3)], outs=[t(8, 3)]), 4),
        Case(
            "all_to_all_single even, same numel other shape",
            {
                0: call(0, "all_to_all_single", ins=[t(4, 6)], outs=[t(4, 6)]),
                1: call(1, "all_to_all_single", ins=[t(6, 4)], outs=[t(6, 4)]),
            },
            2,
        ),
        # split sizes a call site changes at every call are not recorded: neither dim 0's even
        # split nor the pairs are asked for, whatever the rows (one rank saw them change first)
        Case(
            "all_to_all_single split sizes that vary",
            {
                0: call(0, "all_to_all_single", ins=[t(7, 4)], outs=[t(5, 4)], extra=VARY),
                1: call(1, "all_to_all_single", ins=[t(9, 4)], outs=[t(11, 4)], extra=VARY),
                2: call(2, "all_to_all_single", ins=[t(3, 4)], outs=[t(3, 4)], extra={**VARY, **SEEN}),
            },
            3,
        ),
        Case("all_to_all lists", a2a_group_rank, 2),
        Case("all_to_all group_rank order", swapped, 2),
    ]


@pytest.mark.parametrize("case", _healthy(), ids=lambda c: c.name)
def test_healthy_all_to_all_gives_none(case: Case) -> None:
    assert compare_collective(case.calls, case.group_size) is None


def _mismatches() -> list[Case]:
    bad_a2a = a2a_single(UNEVEN)
    # rank 2 sends [3, 1, 2] instead of [2, 2, 2]: same total, wrong split
    bad_a2a = _with(bad_a2a, 2, extra={**bad_a2a[2].extra, "input_split_sizes": "3,1,2"})
    a2a_even = same(3, op="all_to_all_single", ins=[t(6)], outs=[t(6)])
    a2al = a2a_list([[(1,), (2,)], [(3,), (4,)]])
    return [
        Case(
            "all_to_all_single split pair",
            bad_a2a,
            3,
            "shape_mismatch",
            (2,),
            ("rank 0 expects 2 elements (output_split_sizes[2] = 2) from rank 2, but rank 2 sends 3 elements",),
        ),
        Case(
            "all_to_all_single splits do not sum to dim 0",
            _with(a2a_single(UNEVEN), 1, extra={"input_split_sizes": "3,0,2", "output_split_sizes": "2,0,2"}),
            3,
            "shape_mismatch",
            (1,),
        ),
        Case(
            "all_to_all_single even split numel",
            _with(a2a_even, 1, ins=[t(9)], outs=[t(9)]),
            3,
            "shape_mismatch",
            (1,),
            ("rank 1: [9] (9 elements)",),
        ),
        Case(
            "all_to_all_single dtype",
            _with(a2a_even, 0, ins=[t(6, dtype=F64)], outs=[t(6, dtype=F64)]),
            3,
            "dtype_mismatch",
            (0,),
        ),
        Case(
            "all_to_all_single pair of two: lowest rank is reference",
            {
                0: call(
                    0,
                    "all_to_all_single",
                    ins=[t(4)],
                    outs=[t(4)],
                    extra={"input_split_sizes": "2,2", "output_split_sizes": "2,2"},
                ),
                1: call(
                    1,
                    "all_to_all_single",
                    ins=[t(4)],
                    outs=[t(4)],
                    extra={"input_split_sizes": "1,3", "output_split_sizes": "2,2"},
                ),
            },
            2,
            "shape_mismatch",
            (1,),
            ("rank 0 expects 2 elements (output_split_sizes[1] = 2) from rank 1, but rank 1 sends 1 element ",),
        ),
        Case(
            "all_to_all list pair",
            _with(a2al, 1, ins=[t(5), t(4)]),
            2,
            "shape_mismatch",
            (1,),
            ("rank 0 expects [3] (output 1) from rank 1, but rank 1 sends [5] (input 0)",),
        ),
        Case(
            "all_to_all list length (tie: lowest rank is reference)",
            _with(a2al, 0, ins=[t(1)], outs=[t(1)]),
            None,
            "shape_mismatch",
            (1,),
        ),
        Case(
            "all_to_all list length vs group size",
            _with(a2al, 0, ins=[t(1), t(2), t(2)]),
            2,
            "shape_mismatch",
            (0,),
        ),
        Case(
            "all_to_all dtype",
            _with(a2al, 1, ins=[t(3, dtype=F64), t(4, dtype=F64)]),
            2,
            "dtype_mismatch",
            (1,),
        ),
    ]


@pytest.mark.parametrize("case", _mismatches(), ids=lambda c: c.name)
def test_all_to_all_mismatch(case: Case) -> None:
    check_mismatch(case)


def test_all_to_all_single_pair_summary_mentions_rows() -> None:
    calls = a2a_single(UNEVEN, row=4)
    calls = _with(calls, 2, extra={**calls[2].extra, "input_split_sizes": "3,1,2"})
    m = compare_collective(calls, 3)
    assert m is not None
    assert m.culprit_ranks == (2,)
    assert (
        "rank 0 expects 2 rows of 4 elements (output_split_sizes[2] = 2) from rank 2, "
        "but rank 2 sends 3 rows of 4 elements (input_split_sizes[0] = 3) to rank 0"
    ) in m.summary
    assert "(1 more pair disagrees)" in m.summary


def test_all_to_all_pairing_needs_group_index_when_ranks_missing() -> None:
    # ranks 1 and 3 of a 4-rank group, no group_rank recorded: their places in the group are
    # unknown, so the pairing is not checked (sorted order would wrongly pair them as 0 and 1)
    four = [t(1), t(2), t(3), t(4)]
    calls = {r: call(r, "all_to_all", ins=four, outs=four) for r in (1, 3)}
    assert compare_collective(calls, 4) is None
    # with group_rank the pairing is checked: rank 1 (index 1) expects [2] from rank 3 (index 3),
    # which sends its input 1, [2]; rank 3 expects [4] from rank 1, which sends [4]: consistent
    outs = {1: [t(1), t(2), t(3), t(2)], 3: [t(1), t(4), t(3), t(4)]}
    calls = {r: call(r, "all_to_all", ins=four, outs=outs[r], extra={"group_rank": str(r)}) for r in (1, 3)}
    assert compare_collective(calls, 4) is None
    outs3 = [t(1), t(9), t(3), t(4)]
    calls[3] = call(3, "all_to_all", ins=four, outs=outs3, extra={"group_rank": "3"})
    m = compare_collective(calls, 4)
    assert m is not None and m.kind == "shape_mismatch"
    assert "rank 3 expects [9] (output 1) from rank 1, but rank 1 sends [4] (input 3)" in m.summary
