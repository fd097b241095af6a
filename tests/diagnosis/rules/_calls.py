"""Call builders for the rules tests: CallRecords from a few keywords, whole slots, and the
Case tables the parametrised rule tests read. Local to these tests (a shared record factory
may replace the builders later)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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


@dataclass
class Case:
    """One parametrised slot: its calls and, for a mismatch, what must be found."""

    name: str
    calls: dict[int, CallRecord]
    group_size: int | None = None
    kind: str | None = None
    culprits: tuple[int, ...] = ()
    in_summary: tuple[str, ...] = field(default_factory=tuple)


def with_(calls: dict[int, CallRecord], rank: int, **kw: object) -> dict[int, CallRecord]:
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


def check_mismatch(case: Case) -> None:
    """``case.calls`` disagree as ``case`` says: kind, culprits, the rest agreeing, every rank's
    call described, the summary's texts, one line, and a hint."""
    from hangwatch.diagnosis.rules import compare_collective

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
