"""The wrapper's fast path (issue 16): a call site that repeats its call is recorded from what was
remembered of it. What it writes must be what the general path writes, call for call; anything
that differs (a shape, a dtype, another argument, another group, an error) must be seen.

Seams faked as in ``test_recorder``: torch's c10d (``FakeC10d``) and the backend call (a
function that advances the group's sequence number as the backend would). The real wrapper, the
real ``Recorder`` and its ring, read back through ``recorded``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hangwatch import records as r
from hangwatch.client import capture
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.session import Session
from tests.client.fakes import FakeC10d, make_session, recorded


@pytest.fixture
def linked() -> Iterator[Session]:
    """A session as a linked rank has it: Flight Recorder read from outside (``covers`` off)."""
    session = make_session(c10d=FakeC10d(0, world_size=2))
    session.recorder.covers = False
    capture.set_session(session)
    yield session
    capture.set_session(None)


def _backend(session: Session, fail: bool = False) -> Callable[..., Any]:
    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        pg = group if group is not None else session.recorder.default_pg
        pg.seq += 1
        if fail:
            raise RuntimeError("Connection closed by peer")

    return all_reduce


def _calls(events: list[r.RankEvent]) -> list[tuple[Any, ...]]:
    return [
        (e.op, e.group, e.seq, e.inputs, e.reduce_op, e.call_site, e.step)
        for e in events
        if isinstance(e, r.CallRecord)
    ]


def _exits(events: list[r.RankEvent]) -> list[tuple[int, str | None]]:
    return [(e.seq_count, e.error) for e in events if isinstance(e, r.CallExit)]


def test_a_repeated_call_is_recorded_as_the_general_path_records_it(linked: Session) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = torch.ones(4)
    line = sys._getframe().f_lineno + 2
    for _ in range(5):
        wrapped(t)  # one call site: the first call is remembered, the next four take the fast path
    assert len(linked.recorder.memo) == 1
    fast = recorded(linked.recorder)
    for _ in range(5):
        linked.recorder.memo.clear()  # the general path every time
        wrapped(t)
    general = recorded(linked.recorder)
    f32 = (r.TensorMeta((4,), "float32", "cpu"),)
    assert [c[:5] for c in _calls(fast)] == [("all_reduce", "0", seq, f32, "sum") for seq in range(1, 6)]
    assert [c[:5] for c in _calls(general)] == [("all_reduce", "0", seq, f32, "sum") for seq in range(6, 11)]
    site = f"test_fastpath.py:{line} in test_a_repeated_call_is_recorded_as_the_general_path_records_it"
    assert {c[5] for c in _calls(fast)} == {site}
    assert _exits(fast) == _exits(general) == [(1, None)] * 5


@pytest.mark.parametrize(
    "change",
    [
        lambda t: ((torch.ones(5),), {}),  # another shape
        lambda t: ((torch.ones(4, dtype=torch.float64),), {}),  # another dtype
        lambda t: ((t,), {"op": dist.ReduceOp.MAX}),  # another argument
        lambda t: ((t, dist.ReduceOp.MAX), {}),  # the same, positional
    ],
)
def test_a_call_that_differs_is_seen(
    linked: Session, change: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]
) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = torch.ones(4)
    calls = []
    for i in range(4):
        args, kwargs = ((t,), {}) if i < 3 else change(t)
        calls.append((args, kwargs))
        wrapped(*args, **kwargs)  # one call site for all four
    recorded_calls = [e for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    last = recorded_calls[-1]
    args, kwargs = calls[-1]
    tensor = args[0]
    op = kwargs.get("op", args[1] if len(args) > 1 else None)
    assert last.inputs == (r.TensorMeta(tuple(tensor.shape), str(tensor.dtype)[6:], "cpu"),)
    assert last.reduce_op == ("max" if op is not None else "sum")
    assert [c.seq for c in recorded_calls] == [1, 2, 3, 4]


def test_another_group_at_the_same_call_site_is_seen(linked: Session) -> None:
    c10d = linked.recorder.c10d
    pair = c10d.new_group("1", [0, 1], desc="pair")
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = torch.ones(4)
    for group in (None, None, pair, pair, None):
        wrapped(t, group=group)
    groups = [(e.group, e.seq) for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    assert groups == [("0", 1), ("0", 2), ("1", 1), ("1", 2), ("0", 3)]


def test_an_error_on_the_fast_path_is_recorded_and_raised(linked: Session) -> None:
    ok = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    failing = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked, fail=True))
    t = torch.ones(4)
    for fn in (ok, ok, failing):
        try:
            fn(t)  # one call site: the third call takes the fast path into a failing backend
        except RuntimeError as e:
            assert "closed by peer" in str(e)
    exits = _exits(recorded(linked.recorder))
    assert exits[:2] == [(1, None), (1, None)]
    assert exits[2][1] is not None and "Connection closed by peer" in exits[2][1]


def test_the_memo_is_forgotten_when_a_group_is_destroyed(linked: Session) -> None:
    from hangwatch.client import session as session_mod

    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    wrapped(torch.ones(4))
    assert linked.recorder.memo
    previous, session_mod._session = session_mod._session, linked
    try:
        session_mod.before_destroy(linked.recorder.c10d.new_group("2", [0, 1]))
    finally:
        session_mod._session = previous
    assert not linked.recorder.memo


def test_a_broken_memo_never_reaches_the_callers_code(linked: Session) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = torch.ones(4)
    wrapped(t)
    ((key, _),) = linked.recorder.memo.items()
    linked.recorder.memo[key] = ("garbage",)  # type: ignore[assignment]
    wrapped(t)  # the general path takes it: no exception
    assert len([e for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]) == 2


def test_a_rank_reading_flight_recorder_itself_keeps_the_general_path(linked: Session) -> None:
    linked.recorder.covers = True  # no agent reads its Flight Recorder: its Python seqs are kept
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = torch.ones(4)
    for _ in range(3):
        wrapped(t)
    assert [hi for _, hi in linked.recorder.python_seqs["0"]] == [1, 2, 3]
