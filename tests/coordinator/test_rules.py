"""Op-aware comparison rules (hangwatch.coordinator.rules), on constructed CallRecords."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch.coordinator.detectors.p2p_unmatched import unmatched_p2p
from hangwatch.coordinator.rules import (
    Mismatch,
    canonical_op,
    compare_collective,
    describe_call,
    explain_extra_call,
    format_ranks,
    format_shape,
    match_p2p,
)
from hangwatch.records import CallRecord, TensorMeta

F32 = "float32"
F64 = "float64"
OBJ = "object"


def t(*shape: int, dtype: str = F32) -> TensorMeta:
    return TensorMeta(shape=tuple(shape), dtype=dtype)


def objs(n: int) -> TensorMeta:
    return TensorMeta(shape=(n,), dtype=OBJ)


def call(
    rank: int,
    op: str = "all_reduce",
    *,
    ins: Sequence[TensorMeta] = (),
    outs: Sequence[TensorMeta] = (),
    seq: int = 7,
    group: str = "0",
    root: int | None = None,
    reduce_op: str | None = None,
    peer: int | None = None,
    site: str = "train.py:42 in step",
    extra: Mapping[str, str] | None = None,
    enter: float = 0.0,
    exit_time: float | None = None,
    call_id: int = 1,
    async_op: bool = False,
) -> CallRecord:
    return CallRecord(
        rank=rank,
        call_id=call_id,
        op=op,
        group=group,
        seq=seq,
        inputs=tuple(ins),
        outputs=tuple(outs),
        reduce_op=reduce_op,
        root=root,
        peer=peer,
        async_op=async_op,
        call_site=site,
        enter_time=enter,
        exit_time=exit_time,
        extra=dict(extra or {}),
    )


def same(n: int, **kw: object) -> dict[int, CallRecord]:
    return {r: call(r, **kw) for r in range(n)}  # type: ignore[arg-type]


def splits(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def a2a_single(matrix: Sequence[Sequence[int]], row: int = 1) -> dict[int, CallRecord]:
    """matrix[i][j]: rows rank i sends to rank j."""
    n = len(matrix)
    calls = {}
    for i in range(n):
        send = list(matrix[i])
        recv = [matrix[j][i] for j in range(n)]
        tail = (row,) if row > 1 else ()
        calls[i] = call(
            i,
            "all_to_all_single",
            ins=[t(sum(send), *tail)],
            outs=[t(sum(recv), *tail)],
            extra={"input_split_sizes": splits(send), "output_split_sizes": splits(recv)},
        )
    return calls


def a2a_list(shapes: Sequence[Sequence[tuple[int, ...]]]) -> dict[int, CallRecord]:
    """shapes[i][j]: shape of the tensor rank i sends to rank j."""
    n = len(shapes)
    return {
        i: call(
            i,
            "all_to_all",
            ins=[t(*shapes[i][j]) for j in range(n)],
            outs=[t(*shapes[j][i]) for j in range(n)],
        )
        for i in range(n)
    }


UNEVEN = [[1, 2, 0], [3, 0, 1], [2, 2, 2]]


# --------------------------------------------------------------------------------------------
# Healthy slots: no mismatch


@dataclass
class Case:
    name: str
    calls: dict[int, CallRecord]
    group_size: int | None = None
    kind: str | None = None
    culprits: tuple[int, ...] = ()
    in_summary: tuple[str, ...] = field(default_factory=tuple)


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
    a2a_group_rank = a2a_list([[(1,), (2,)], [(3,), (4,)]])
    # ranks 5 and 3 in a group [5, 3]: group index order differs from rank order
    swapped = {
        5: call(5, "all_to_all", ins=[t(1), t(2)], outs=[t(1), t(3)], extra={"group_rank": "0"}),
        3: call(3, "all_to_all", ins=[t(3), t(4)], outs=[t(2), t(4)], extra={"group_rank": "1"}),
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
        Case("all_to_all lists", a2a_group_rank, 2),
        Case("all_to_all group_rank order", swapped, 2),
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


def _with(calls: dict[int, CallRecord], rank: int, **kw: object) -> dict[int, CallRecord]:
    out = dict(calls)
    base = calls[rank]
    args: dict[str, object] = {
        "op": base.op,
        "ins": base.inputs,
        "outs": base.outputs,
        "root": base.root,
        "reduce_op": base.reduce_op,
        "extra": base.extra,
        "site": base.call_site,
    }
    args.update(kw)
    out[rank] = call(rank, **args)  # type: ignore[arg-type]
    return out


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
    bad_a2a = a2a_single(UNEVEN)
    # rank 2 sends [3, 1, 2] instead of [2, 2, 2]: same total, wrong split
    bad_a2a = _with(bad_a2a, 2, extra={**bad_a2a[2].extra, "input_split_sizes": "3,1,2"})
    a2a_even = same(3, op="all_to_all_single", ins=[t(6)], outs=[t(6)])
    a2al = a2a_list([[(1,), (2,)], [(3,), (4,)]])
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
    m = compare_collective(case.calls, case.group_size)
    assert m is not None
    assert m.kind == case.kind, m.summary
    assert m.culprit_ranks == case.culprits, m.summary
    assert set(m.agreeing_ranks) == set(case.calls) - set(case.culprits)
    assert set(m.details) == set(case.calls)
    for text in case.in_summary:
        assert text in m.summary
    assert "\n" not in m.summary
    assert m.hint


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


# --------------------------------------------------------------------------------------------
# Formatting


@pytest.mark.parametrize(("shape", "text"), [((), "[]"), ((5,), "[5]"), ((1, 2, 5), "[1, 2, 5]"), ((0, 3), "[0, 3]")])
def test_format_shape(shape: tuple[int, ...], text: str) -> None:
    assert format_shape(shape) == text


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([0, 1, 2, 3, 5], "0-3, 5"),
        ([], ""),
        ([3], "3"),
        ([0, 1], "0, 1"),
        ([9, 3, 4, 5, 5], "3-5, 9"),
        ([0, 2, 4], "0, 2, 4"),
        ([0, 1, 2, 4, 5, 6, 7, 10], "0-2, 4-7, 10"),
    ],
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


@pytest.mark.parametrize(
    ("c", "text"),
    [
        (
            call(1, "broadcast", ins=[t(1, 2, 5)], root=0),
            "broadcast(src=0) [1, 2, 5] float32 at train.py:42 in step",
        ),
        (call(0, ins=[t(4)], reduce_op="ReduceOp.SUM", site=""), "all_reduce(op=SUM) [4] float32"),
        (
            call(0, "reduce", ins=[t(4)], root=2, reduce_op="max", site=""),
            "reduce(dst=2, op=MAX) [4] float32",
        ),
        (call(0, "isend", ins=[t(3)], peer=1, site="x.py:1"), "isend(dst=1) [3] float32 at x.py:1"),
        (call(1, "recv", ins=[t(3)], peer=0, site=""), "recv(src=0) [3] float32"),
        (call(0, "barrier", site="", async_op=True), "barrier(async)"),
        (
            call(0, "all_reduce_coalesced", ins=[t(1), t(2), t(3), t(4), t(5)], site=""),
            "all_reduce_coalesced() [1], [2], [3] … (+2) float32",
        ),
        (
            call(0, "all_reduce_coalesced", ins=[t(1), t(2, dtype=F64)], site=""),
            "all_reduce_coalesced() [1] float32, [2] float64",
        ),
        (
            call(0, "_allgather_base", ins=[t(3)], outs=[t(6)], site=""),
            "_allgather_base() [3] float32 -> [6] float32",
        ),
        (
            call(0, "broadcast_object_list", ins=[objs(3)], root=0, site=""),
            "broadcast_object_list(src=0) 3 objects",
        ),
        (
            call(
                0,
                "all_to_all_single",
                ins=[t(3)],
                outs=[t(4)],
                site="",
                extra={"input_split_sizes": "1,2", "output_split_sizes": "[2, 2]"},
            ),
            "all_to_all_single(in_splits=[1, 2], out_splits=[2, 2]) [3] float32 -> [4] float32",
        ),
    ],
)
def test_describe_call(c: CallRecord, text: str) -> None:
    assert describe_call(c) == text


@pytest.mark.parametrize(
    ("op", "canon"),
    [
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("_allgather_base", "all_gather_into_tensor"),
        ("all_gather_into_tensor", "all_gather_into_tensor"),
        ("_reduce_scatter_base", "reduce_scatter_tensor"),
        ("nccl:all_reduce", "all_reduce"),
        ("gloo:alltoall_base", "all_to_all_single"),
        ("torch.distributed.broadcast", "broadcast"),
        ("monitored_barrier", "monitored_barrier"),
    ],
)
def test_canonical_op(op: str, canon: str) -> None:
    assert canonical_op(op) == canon


# --------------------------------------------------------------------------------------------
# Point-to-point


def test_match_p2p_same_numel_is_fine() -> None:
    send = call(0, "send", ins=[t(2, 5)], peer=1, seq=3)
    recv = call(1, "recv", ins=[t(10)], peer=0, seq=3)
    assert match_p2p(send, recv) is None


def test_match_p2p_size() -> None:
    send = call(0, "isend", ins=[t(10)], peer=1, seq=3, site="a.py:1")
    recv = call(1, "irecv", ins=[t(20)], peer=0, seq=3, site="b.py:2")
    m = match_p2p(send, recv)
    assert m is not None
    assert m.kind == "p2p_mismatch"
    assert m.culprit_ranks == (0, 1)
    assert m.summary == (
        "p2p mismatch in group 0 (pair seq 3): rank 0 sends [10] float32 (10 elements) to rank 1, "
        "but rank 1 receives [20] float32 (20 elements) (sizes differ)"
    )
    assert "a.py:1 on rank 0" in m.hint and "b.py:2 on rank 1" in m.hint
    assert set(m.details) == {0, 1}


def test_match_p2p_dtype() -> None:
    m = match_p2p(call(0, "send", ins=[t(4)], peer=1), call(1, "recv", ins=[t(4, dtype=F64)], peer=0))
    assert m is not None and "dtypes differ" in m.summary


def test_match_p2p_object_lists() -> None:
    send = call(0, "send_object_list", ins=[objs(2)], peer=1)
    assert match_p2p(send, call(1, "recv_object_list", ins=[objs(2)], peer=0)) is None
    m = match_p2p(send, call(1, "recv_object_list", ins=[objs(3)], peer=0))
    assert m is not None and "lengths differ" in m.summary


def test_match_p2p_unrecorded_tensors() -> None:
    assert match_p2p(call(0, "send", peer=1), call(1, "recv", ins=[t(3)], peer=0)) is None


def _p2p(rank: int, op: str, peer: int, *, enter: float = 0.0, group: str = "0", cid: int = 1) -> CallRecord:
    return call(rank, op, ins=[t(4)], peer=peer, enter=enter, group=group, call_id=cid, site=f"p.py:{rank}")


def test_unmatched_send_to_busy_receiver() -> None:
    calls = [_p2p(1, "send", 2), _p2p(2, "recv", 0)]
    found = unmatched_p2p(calls, now=100.0, grace_s=10.0)
    assert len(found) == 1
    m = found[0]
    assert m.kind == "p2p_mismatch"
    assert "rank 1 sends to rank 2, but rank 2 is receiving from rank 0" in m.summary
    assert m.culprit_ranks == (1, 2)


def test_unmatched_send_send_deadlock_reported_once() -> None:
    found = unmatched_p2p([_p2p(0, "send", 1), _p2p(1, "send", 0)], now=100.0, grace_s=10.0)
    assert len(found) == 1
    assert "rank 0 sends to rank 1, but rank 1 is also sending to rank 0" in found[0].summary
    assert "receives first" in found[0].hint


def test_unmatched_recv_recv_deadlock() -> None:
    found = unmatched_p2p([_p2p(0, "recv", 1), _p2p(1, "irecv", 0)], now=100.0, grace_s=10.0)
    assert len(found) == 1
    assert "also receiving from rank 0" in found[0].summary


def test_unmatched_different_group() -> None:
    found = unmatched_p2p([_p2p(0, "send", 1), _p2p(1, "recv", 0, group="7")], now=100.0, grace_s=10.0)
    assert len(found) == 1  # one disagreement, seen from both sides
    assert "rank 0 sends to rank 1, but rank 1 is receiving from rank 0 in group 7" in found[0].summary


@pytest.mark.parametrize(
    "calls",
    [
        pytest.param([_p2p(0, "send", 1), _p2p(1, "recv", 0)], id="in flight"),
        pytest.param([_p2p(0, "isend", 1), _p2p(1, "irecv", 0)], id="in flight async"),
        pytest.param([_p2p(0, "send", 1, enter=95.0), _p2p(1, "recv", 2, enter=95.0)], id="young"),
        pytest.param([_p2p(0, "send", 1)], id="peer not in p2p"),
        pytest.param(
            [
                _p2p(0, "isend", 1, cid=1),
                _p2p(0, "irecv", 1, cid=2),
                _p2p(1, "isend", 0, cid=1),
                _p2p(1, "irecv", 0, cid=2),
            ],
            id="batched exchange",
        ),
        pytest.param([_p2p(0, "all_reduce", 1), _p2p(1, "recv", 2)], id="not p2p"),
    ],
)
def test_unmatched_p2p_none(calls: list[CallRecord]) -> None:
    assert unmatched_p2p(calls, now=100.0, grace_s=10.0) == []


def test_unmatched_p2p_ignores_finished_calls() -> None:
    done = call(2, "recv", ins=[t(4)], peer=0, exit_time=50.0)
    assert unmatched_p2p([_p2p(1, "send", 2), done], now=100.0, grace_s=10.0) == []


# --------------------------------------------------------------------------------------------
# Extra calls


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


# --------------------------------------------------------------------------------------------
# Properties

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


def test_explain_extra_call_at_a_thousand_ranks() -> None:
    """Ranks with the same history are compared once (this took minutes when every rank was
    compared with every other one)."""
    extra = [*BASE[:2], ("all_reduce", 1), *BASE[2:]]
    history = {rk: _hist(extra if rk == 700 else BASE, rk, sites={12: "train.py:30"}) for rk in range(1024)}
    text = explain_extra_call(history, 12)
    assert text is not None and text.startswith("rank 700 made an extra all_reduce at train.py:30 (seq 12)")
    history[701] = _hist(extra, 701)  # two ranks made it: not one rank's extra call
    assert explain_extra_call(history, 12) is None


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
