"""Wording shared by incidents and the CLI (hangwatch.wording)."""

from __future__ import annotations

import io

import pytest

from hangwatch.cli import render
from hangwatch.records import CallRecord
from hangwatch.wording import KIND_TITLES, describe_call, format_ranks, format_shape, ranks_label
from tests.diagnosis.rules._calls import F64, call, objs, t


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


def test_ranks_label() -> None:
    assert ranks_label([3]) == "rank 3"
    assert ranks_label([5, 0, 1, 2, 3]) == "ranks 0-3, 5"


def test_cli_uses_the_same_wording() -> None:
    """The CLI's rank ranges and titles are hangwatch.wording's (``-`` for no ranks), and the
    rules re-export the wording functions rather than keeping their own."""
    from hangwatch.diagnosis import rules

    assert render.KIND_TITLES is KIND_TITLES
    assert render.format_ranks([]) == "-"
    assert render.format_ranks([0, 1, 2, 3, 5]) == format_ranks([0, 1, 2, 3, 5]) == "0-3, 5"
    assert rules.describe_call is describe_call and rules.format_ranks is format_ranks
    assert rules.format_shape is format_shape


def test_every_incident_kind_has_a_title() -> None:
    from hangwatch.diagnosis.incidents import IncidentKind

    assert {k.value for k in IncidentKind} <= set(KIND_TITLES)


def test_status_says_which_path_each_ranks_records_take() -> None:
    out = io.StringIO()
    ranks = [
        {"rank": 0, "state": "running", "via": "agent"},
        {"rank": 1, "state": "running", "via": "agent"},
        {"rank": 2, "state": "running", "via": "direct"},
    ]
    render.render_status({"job": {"id": "j", "registered": 3, "world_size": 3, "time": 1.0}, "ranks": ranks}, out)
    lines = out.getvalue().splitlines()
    assert lines[1] == (
        "records: ranks 0, 1 read by their node agent; rank 2 shipped by the rank itself (no agent linked)"
    )


def test_status_says_what_a_budget_slowed_down() -> None:
    out = io.StringIO()
    note = "Flight Recorder read every 5.0 s, not every 1 s: a read costs the rank about 50 ms"
    ranks = [
        {"rank": 0, "state": "running", "via": "agent", "budget": note},
        {"rank": 1, "state": "running", "via": "agent", "budget": note},
        {"rank": 2, "state": "running", "via": "agent"},
    ]
    render.render_status({"job": {"id": "j", "registered": 3, "world_size": 3, "time": 1.0}, "ranks": ranks}, out)
    assert f"budget: ranks 0, 1: {note}" in out.getvalue().splitlines()
