"""The cross-rank rule chain (hangwatch.diagnosis.rules.collective and its single-call checks),
on constructed CallRecords."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch.diagnosis.rules import Mismatch, canonical_op, compare_collective
from hangwatch.records import CallRecord, TensorMeta
from tests.diagnosis.rules._calls import F32, F64, Case, call, check_mismatch, objs, same, t
from tests.diagnosis.rules._calls import with_ as _with

# --------------------------------------------------------------------------------------------
# Healthy slots: no mismatch


def _healthy() -> list[Case]:
    gather = {0: call(0, "gather", ins=[t(4)], outs=[t(4)] * 3, root=0)}
    gather.update({r: call(r, "gather", ins=[t(4)], root=0) for r in (1, 2)})
    gather_junk = dict(gather)
    gather_junk[2] = call(2, "gather", ins=[t(4)], outs=[t(9), t(1)], root=0)  # never compared
    scatter = {1: call(1, "scatter", ins=[t(2, 2)] * 3, outs=[t(2, 2)], root=1)}
    scatter.update({r: call(r, "scatter", outs=[t(2, 2)], root=1) for r in (0, 2)})
    mixed_spelling = {
        0: call(0, "all_reduce", ins=[t(8)], reduce_op="SUM"),
        1: call(1, "allreduce", ins=[t(8)], reduce_op="ReduceOp.SUM", async_op=True),
        2: call(2, "gloo:all_reduce", ins=[t(8)], reduce_op="sum"),
    }
    agit = {
        0: call(0, "_allgather_base", ins=[t(3, 2)], outs=[t(6, 2)]),
        1: call(1, "all_gather_into_tensor", ins=[t(3, 2)], outs=[t(6, 2)]),
    }
    rst = {
        0: call(0, "_reduce_scatter_base", ins=[t(8)], outs=[t(4)], reduce_op="SUM"),
        1: call(1, "reduce_scatter_tensor", ins=[t(8)], outs=[t(4)], reduce_op="SUM"),
    }
    unknown_inputs = {r: call(r, ins=[t(4)], reduce_op="SUM") for r in range(3)}
    unknown_inputs[1] = call(1, reduce_op="SUM")  # nothing recorded: not compared
    return [
        Case("all_reduce 8 ranks", same(8, ins=[t(1, 5)], reduce_op="SUM"), 8),
        Case("all_reduce spellings, async, FR prefix", mixed_spelling, 3),
        Case("broadcast", same(3, op="broadcast", ins=[t(1, 5)], root=0), 3),
        Case("reduce", same(2, op="reduce", ins=[t(3)], root=1, reduce_op="MAX"), 2),
        Case("gather root-only list", gather, 3),
        Case("gather non-root outputs ignored", gather_junk, 3),
        Case("scatter root-only list", scatter, 3),
        Case("all_gather", same(4, op="all_gather", ins=[t(2)], outs=[t(2)] * 4), 4),
        Case("all_gather_into_tensor aliases", agit, 2),
        Case("all_gather_into_tensor no group size", agit, None),
        Case("reduce_scatter_tensor aliases", rst, 2),
        Case(
            "reduce_scatter lists",
            same(3, op="reduce_scatter", ins=[t(2)] * 3, outs=[t(2)], reduce_op="SUM"),
            3,
        ),
        Case("barrier", same(5, op="barrier"), 5),
        Case("monitored_barrier", same(2, op="monitored_barrier"), 2),
        Case("broadcast_object_list", same(3, op="broadcast_object_list", ins=[objs(3)], root=0), 3),
        Case(
            "all_gather_object payloads differ",
            {r: call(r, "all_gather_object", ins=[objs(r + 1)], outs=[objs(2)]) for r in range(2)},
            2,
        ),
        Case(
            "gather_object payloads differ",
            {r: call(r, "gather_object", ins=[objs(r * 7 + 1)], root=0) for r in range(3)},
            3,
        ),
        Case(
            "scatter_object_list",
            {0: call(0, "scatter_object_list", ins=[objs(2)], outs=[objs(1)], root=0)}
            | {1: call(1, "scatter_object_list", outs=[objs(1)], root=0)},
            2,
        ),
        Case("all_reduce_coalesced", same(2, op="all_reduce_coalesced", ins=[t(2), t(3, 3)]), 2),
        Case(
            "all_gather_into_tensor_coalesced",
            same(2, op="all_gather_into_tensor_coalesced", ins=[t(2), t(3)], outs=[t(4), t(6)]),
            2,
        ),
        Case("a rank with nothing recorded", unknown_inputs, 3),
        Case("single rank", same(1, ins=[t(3)]), None),
        Case("unknown collective", same(3, op="my_custom_collective", ins=[t(1)]), 3),
        Case(
            "group_ranks agree",
            same(2, op="barrier", extra={"group_ranks": "0,2"}),
            None,
        ),
    ]


@pytest.mark.parametrize("case", _healthy(), ids=lambda c: c.name)
def test_healthy_calls_give_none(case: Case) -> None:
    assert compare_collective(case.calls, case.group_size) is None


def test_empty_slot() -> None:
    assert compare_collective({}) is None


# --------------------------------------------------------------------------------------------
# Mismatches


def _mismatches() -> list[Case]:
    ar8 = same(8, ins=[t(1, 5)], reduce_op="SUM")
    ar3 = same(3, ins=[t(10)], reduce_op="SUM")
    ar2 = same(2, ins=[t(10)], reduce_op="SUM")
    bc2 = same(2, op="broadcast", ins=[t(1, 5)], root=0)
    bc4 = same(4, op="broadcast", ins=[t(3)], root=0)
    ag2 = same(2, op="all_gather", ins=[t(2)], outs=[t(2)] * 2)
    agit2 = same(2, op="all_gather_into_tensor", ins=[t(3)], outs=[t(6)])
    gather = {0: call(0, "gather", ins=[t(4)], outs=[t(4)] * 3, root=0)}
    gather.update({r: call(r, "gather", ins=[t(4)], root=0) for r in (1, 2)})
    scatter = {0: call(0, "scatter", ins=[t(2)] * 3, outs=[t(2)], root=0)}
    scatter.update({r: call(r, "scatter", outs=[t(2)], root=0) for r in (1, 2)})
    rs3 = same(3, op="reduce_scatter", ins=[t(2)] * 3, outs=[t(2)], reduce_op="SUM")
    rst2 = same(2, op="reduce_scatter_tensor", ins=[t(8)], outs=[t(4)], reduce_op="SUM")
    obj3 = same(3, op="broadcast_object_list", ins=[objs(3)], root=0)
    return [
        Case(
            "op: all_reduce vs barrier (tie -> lowest rank is reference)",
            {0: call(0, ins=[t(4)]), 1: call(1, "barrier")},
            2,
            "op_mismatch",
            (1,),
            ("op mismatch in group 0 seq 7: rank 0: all_reduce; rank 1: barrier",),
        ),
        Case(
            "op: majority",
            _with(same(4, op="broadcast", ins=[t(3)], root=0), 2, op="all_reduce", root=None),
            4,
            "op_mismatch",
            (2,),
            ("ranks 0, 1, 3: broadcast; rank 2: all_reduce",),
        ),
        Case(
            "all_reduce shape, 8 ranks",
            _with(ar8, 7, ins=[t(1, 2, 5)]),
            8,
            "shape_mismatch",
            (7,),
            ("all_reduce shape mismatch in group 0 seq 7: ranks 0-6: [1, 5]; rank 7: [1, 2, 5]",),
        ),
        Case(
            "all_reduce dtype",
            _with(ar2, 1, ins=[t(10, dtype=F64)]),
            2,
            "dtype_mismatch",
            (1,),
            ("rank 0: float32; rank 1: float64",),
        ),
        Case(
            "dtype wins over shape",
            _with(ar3, 0, ins=[t(20, dtype=F64)]),
            3,
            "dtype_mismatch",
            (0,),
        ),
        Case(
            "all_reduce size (10 vs 20 floats)",
            _with(ar2, 1, ins=[t(20)]),
            2,
            "shape_mismatch",
            (1,),
            ("rank 0: [10]; rank 1: [20]",),
        ),
        Case(
            "all_reduce reduce op",
            _with(ar3, 1, reduce_op="ReduceOp.MAX"),
            3,
            "arg_mismatch",
            (1,),
            ("reduce op mismatch", "rank 1: MAX"),
        ),
        Case(
            "broadcast shape tie: root side is the reference",
            _with(same(2, op="broadcast", ins=[t(1, 5)], root=1), 1, ins=[t(1, 2, 5)]),
            2,
            "shape_mismatch",
            (0,),
        ),
        Case(
            "broadcast shape (field notes case)",
            _with(bc2, 1, ins=[t(1, 2, 5)]),
            2,
            "shape_mismatch",
            (1,),
            ("broadcast shape mismatch in group 0 seq 7: rank 0: [1, 5]; rank 1: [1, 2, 5]",),
        ),
        Case("broadcast src majority", _with(bc4, 3, root=3), 4, "arg_mismatch", (3,), ("src=3",)),
        Case(
            "broadcast src tie: side holding its own root wins",
            {
                0: call(0, "broadcast", ins=[t(3)], root=3),
                1: call(1, "broadcast", ins=[t(3)], root=3),
                2: call(2, "broadcast", ins=[t(3)], root=2),
                3: call(3, "broadcast", ins=[t(3)], root=2),
            },
            4,
            "arg_mismatch",
            (0, 1),
        ),
        Case(
            "reduce dst",
            _with(same(3, op="reduce", ins=[t(3)], root=0, reduce_op="SUM"), 2, root=1),
            3,
            "arg_mismatch",
            (2,),
            ("dst=1",),
        ),
        Case(
            "reduce op on reduce",
            _with(same(3, op="reduce", ins=[t(3)], root=0, reduce_op="SUM"), 0, reduce_op="AVG"),
            3,
            "arg_mismatch",
            (0,),
        ),
        Case(
            "all_gather output list too long",
            _with(ag2, 1, outs=[t(2)] * 3),
            2,
            "shape_mismatch",
            (1,),
            ("rank 1 passes 3 tensors in its output list, but the group has 2 ranks",),
        ),
        Case(
            "all_gather output element shape",
            _with(ag2, 0, outs=[t(2), t(3)]),
            None,
            "shape_mismatch",
            (0,),
        ),
        Case(
            "all_gather input shape among 3",
            _with(same(3, op="all_gather", ins=[t(2)]), 2, ins=[t(5)]),
            3,
            "shape_mismatch",
            (2,),
        ),
        Case(
            "all_gather_into_tensor output numel",
            _with(agit2, 1, outs=[t(9)]),
            2,
            "shape_mismatch",
            (1,),
        ),
        Case(
            "all_gather_into_tensor input shape",
            _with(same(3, op="_allgather_base", ins=[t(3)], outs=[t(9)]), 0, ins=[t(4)], outs=[t(12)]),
            3,
            "shape_mismatch",
            (0,),
        ),
        Case(
            "all_gather_into_tensor in/out dtype",
            _with(agit2, 0, outs=[t(6, dtype=F64)]),
            2,
            "dtype_mismatch",
            (0,),
        ),
        Case(
            "gather input shape",
            _with(gather, 1, ins=[t(5)]),
            3,
            "shape_mismatch",
            (1,),
        ),
        Case(
            "gather root's list too short",
            _with(gather, 0, outs=[t(4)] * 2),
            3,
            "shape_mismatch",
            (0,),
            ("gather list",),
        ),
        Case("gather dst", _with(gather, 2, root=2), 3, "arg_mismatch", (2,)),
        Case("scatter output shape", _with(scatter, 2, outs=[t(3)]), 3, "shape_mismatch", (2,)),
        Case(
            "scatter root's list length",
            _with(scatter, 0, ins=[t(2)] * 2),
            3,
            "shape_mismatch",
            (0,),
        ),
        Case(
            "reduce_scatter list element shape",
            _with(rs3, 1, ins=[t(2), t(2), t(3)]),
            3,
            "shape_mismatch",
            (1,),
        ),
        Case("reduce_scatter reduce op", _with(rs3, 2, reduce_op="MIN"), 3, "arg_mismatch", (2,)),
        Case(
            "reduce_scatter_tensor input numel",
            _with(rst2, 0, ins=[t(6)]),
            2,
            "shape_mismatch",
            (0,),
        ),
        Case(
            "reduce_scatter_tensor output shape",
            _with(same(3, op="reduce_scatter_tensor", ins=[t(12)], outs=[t(4)]), 2, ins=[t(15)], outs=[t(5)]),
            3,
            "shape_mismatch",
            (2,),
        ),
        Case(
            "broadcast_object_list length",
            _with(obj3, 2, ins=[objs(4)]),
            3,
            "shape_mismatch",
            (2,),
            ("ranks 0, 1: 3 objects; rank 2: 4 objects",),
        ),
        Case("broadcast_object_list src", _with(obj3, 1, root=1), 3, "arg_mismatch", (1,)),
        Case(
            "gather_object dst",
            _with(same(3, op="gather_object", ins=[objs(1)], root=0), 2, root=2),
            3,
            "arg_mismatch",
            (2,),
        ),
        Case(
            "group membership",
            _with(same(3, op="barrier", extra={"group_ranks": "0,1,2"}), 1, extra={"group_ranks": "0,1"}),
            None,
            "arg_mismatch",
            (1,),
            ("group membership mismatch", "rank 1: {0, 1}"),
        ),
        Case(
            "all_reduce_coalesced element shape",
            _with(same(3, op="all_reduce_coalesced", ins=[t(2), t(3)]), 2, ins=[t(2), t(4)]),
            3,
            "shape_mismatch",
            (2,),
        ),
        Case(
            "all_reduce_coalesced list length",
            _with(same(3, op="allreduce_coalesced", ins=[t(2), t(3)]), 0, ins=[t(2)]),
            3,
            "shape_mismatch",
            (0,),
            ("list length mismatch", "rank 0: 1 tensor"),
        ),
        Case(
            "reduce_scatter_tensor_coalesced numel",
            _with(
                same(2, op="reduce_scatter_tensor_coalesced", ins=[t(4), t(8)], outs=[t(2), t(4)]),
                1,
                ins=[t(4), t(6)],
            ),
            2,
            "shape_mismatch",
            (1,),
        ),
    ]


@pytest.mark.parametrize("case", _mismatches(), ids=lambda c: c.name)
def test_mismatch(case: Case) -> None:
    check_mismatch(case)


def test_shape_hint_names_rank_and_call_site() -> None:
    calls = same(2, ins=[t(10)])
    calls[1] = call(1, ins=[t(20)], site="train.py:57 in step")
    m = compare_collective(calls, 2)
    assert m is not None
    assert m.hint == (
        "every rank must pass a tensor of the same shape to all_reduce; check the code at "
        "train.py:57 in step on rank 1, which builds a different shape"
    )
    assert m.details[1] == "all_reduce() [20] float32 at train.py:57 in step"


def test_several_culprits_collapse_in_summary_and_hint() -> None:
    calls = same(10, ins=[t(4)])
    for r in (7, 8, 9):
        calls[r] = call(r, ins=[t(5)], site="b.py:3")
    m = compare_collective(calls, 10)
    assert m is not None
    assert m.culprit_ranks == (7, 8, 9)
    assert "ranks 0-6: [4]; ranks 7-9: [5]" in m.summary
    assert "check the code at b.py:3 on ranks 7-9, which build a different shape" in m.hint


def test_op_mismatch_hint_mentions_both_sides() -> None:
    m = compare_collective({0: call(0, site="a.py:1"), 1: call(1, "barrier", site="b.py:2")})
    assert m is not None
    assert "rank 1 called barrier at b.py:2 where rank 0 called all_reduce at a.py:1" in m.hint


def test_root_hint_mentions_global_rank() -> None:
    m = compare_collective(_with(same(3, op="broadcast", ins=[t(3)], root=0), 2, root=1), 3)
    assert m is not None
    assert "global rank" in m.hint
    assert m.summary == "broadcast src mismatch in group 0 seq 7: ranks 0, 1: src=0; rank 2: src=1"


# --------------------------------------------------------------------------------------------

_shapes = st.lists(st.integers(min_value=0, max_value=6), min_size=0, max_size=3).map(tuple)
_dtypes = st.sampled_from([F32, F64, "bfloat16", "int64"])


def _consistent(op: str, n: int, shape: tuple[int, ...], dtype: str) -> dict[int, CallRecord]:
    m = TensorMeta(shape, dtype)
    if op == "all_gather":
        return {r: call(r, op, ins=[m], outs=[m] * n) for r in range(n)}
    if op == "all_gather_into_tensor":
        big = TensorMeta((n * max(1, shape[0] if shape else 1), *shape[1:]), dtype)
        small = TensorMeta((max(1, shape[0] if shape else 1), *shape[1:]), dtype)
        return {r: call(r, op, ins=[small], outs=[big]) for r in range(n)}
    if op == "gather":
        return {r: call(r, op, ins=[m], outs=[m] * n if r == 0 else [], root=0) for r in range(n)}
    if op == "all_to_all_single":
        a = TensorMeta((n * 2, *shape), dtype)
        return {r: call(r, op, ins=[a], outs=[a]) for r in range(n)}
    if op == "broadcast_object_list":
        return {r: call(r, op, ins=[objs(len(shape))], root=n - 1) for r in range(n)}
    return {
        r: call(r, op, ins=[m], root=0 if op in ("broadcast", "reduce") else None, reduce_op="SUM") for r in range(n)
    }


@settings(max_examples=200, deadline=None)
@given(
    op=st.sampled_from(
        [
            "all_reduce",
            "broadcast",
            "reduce",
            "barrier",
            "all_gather",
            "all_gather_into_tensor",
            "gather",
            "all_to_all_single",
            "broadcast_object_list",
        ]
    ),
    n=st.integers(min_value=1, max_value=16),
    shape=_shapes,
    dtype=_dtypes,
    pass_size=st.booleans(),
)
def test_identical_calls_never_mismatch(op: str, n: int, shape: tuple[int, ...], dtype: str, pass_size: bool) -> None:
    calls = _consistent(op, n, shape, dtype)
    assert compare_collective(calls, n if pass_size else None) is None


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=3, max_value=16),
    shape=_shapes,
    other=_shapes,
    dtype=_dtypes,
    data=st.data(),
)
def test_one_changed_all_reduce_shape_names_that_rank(
    n: int, shape: tuple[int, ...], other: tuple[int, ...], dtype: str, data: st.DataObject
) -> None:
    if other == shape:
        other = (*shape, 2)
    odd = data.draw(st.integers(min_value=0, max_value=n - 1))
    calls = {r: call(r, ins=[TensorMeta(other if r == odd else shape, dtype)], reduce_op="SUM") for r in range(n)}
    m = compare_collective(calls, n)
    assert isinstance(m, Mismatch)
    assert m.kind == "shape_mismatch"
    assert m.culprit_ranks == (odd,)
    assert odd not in m.agreeing_ranks and len(m.agreeing_ranks) == n - 1


# --------------------------------------------------------------------------------------------
# Private spellings of the tensor collectives (the hook records the name the code called)


@pytest.mark.parametrize(
    ("op", "ins", "outs", "canon"),
    [
        ("_all_gather_base", ((4,), (5,)), ((8,), (10,)), "all_gather_into_tensor"),
        ("_reduce_scatter_base", ((8,), (10,)), ((4,), (5,)), "reduce_scatter_tensor"),
    ],
)
def test_base_spellings_report_shape_mismatch(
    op: str, ins: tuple[tuple[int, ...], ...], outs: tuple[tuple[int, ...], ...], canon: str
) -> None:
    """``_all_gather_base`` is ``all_gather_into_tensor`` under its old name: a [4] vs [5] input
    through it is the same shape mismatch (it used to fall through to the unknown-op rules)."""
    calls = {
        rk: call(rk, op, ins=[t(*ins[rk])], outs=[t(*outs[rk])], reduce_op="SUM" if "reduce" in op else None)
        for rk in (0, 1)
    }
    m = compare_collective(calls, 2)
    assert m is not None
    assert m.kind == "shape_mismatch"
    assert m.culprit_ranks == (1,) and m.agreeing_ranks == (0,)
    assert m.summary.startswith(f"{canon} shape mismatch in group 0 seq 7: ")
    assert canonical_op(op) == canon
