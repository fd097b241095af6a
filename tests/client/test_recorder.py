"""``Recorder`` (the hot path) directly, on the calling thread, with no process group.

Seam faked: torch's c10d, through the constructor (``Recorder(rank, queue, c10d)``) and the
``group=`` argument: :class:`tests.client.fakes.FakeC10d` and ``FakeProcessGroup``, whose
sequence number the test advances as the backend would while the call runs. Real tensors, the
real ``OPS`` table, the real bounded queue; records are read back through ``materialize``.
Covers: collective seqs per group, p2p pair seqs, object collectives' seq_count, async works
completed later, errors, the bounded queue dropping and counting, and novel-signature tracking.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hangwatch import records as r
from hangwatch.client import capture
from hangwatch.client.callsites import is_library
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.recorder import MAX_NOVEL_SIGNATURES, Recorder
from hangwatch.client.ringsink import RingSink
from tests.client.fakes import FakeC10d, FakeProcessGroup, FakeWork, lost, make_session, recorded


def _recorder(rank: int = 0, capacity: int = 1000) -> tuple[Recorder, FakeC10d]:
    c10d = FakeC10d(rank, world_size=4)
    sink = RingSink(capacity)
    rec = Recorder(rank, sink, c10d)
    rec.default_pg = c10d.default
    rec.group_info(c10d.default)  # as session.after_init does
    _events(rec)
    return rec, c10d


def _call(
    rec: Recorder,
    op_name: str,
    pg: FakeProcessGroup | None = None,
    *,
    issued: int = 1,
    error: BaseException | None = None,
    result: Any = None,
    **params: Any,
) -> int:
    """One call as the wrapper makes it: enter, the backend issues ``issued`` ops, exit. Its call id."""
    if pg is not None:
        params["group"] = pg
    raw, group, before = rec.enter(OPS_BY_NAME[op_name], params)
    (pg or rec.default_pg).seq += issued
    rec.exit(raw, group, before, error, result)
    return int(raw[0])


_events = recorded


def _calls(events: list[r.RankEvent]) -> list[r.CallRecord]:
    return [e for e in events if isinstance(e, r.CallRecord)]


def _exits(events: list[r.RankEvent]) -> dict[int, r.CallExit]:
    return {e.call_id: e for e in events if isinstance(e, r.CallExit)}


def test_collective_seqs_follow_each_groups_own_numbering() -> None:
    rec, c10d = _recorder()
    pair = c10d.new_group("1", [0, 2], desc="pair")
    t = torch.ones(2, 3)
    _call(rec, "all_reduce", tensor=t)
    _call(rec, "all_reduce", pair, tensor=t, op=dist.ReduceOp.MAX)
    _call(rec, "broadcast", tensor=torch.zeros(4, dtype=torch.float64), src=2)
    _call(rec, "all_reduce", pair, tensor=t)
    events = _events(rec)
    calls = _calls(events)
    assert [(c.op, c.group, c.seq) for c in calls] == [
        ("all_reduce", "0", 1),
        ("all_reduce", "1", 1),
        ("broadcast", "0", 2),
        ("all_reduce", "1", 2),
    ]
    assert calls[0].inputs == (r.TensorMeta((2, 3), "float32", "cpu"),)
    assert calls[0].reduce_op == "sum" and calls[1].reduce_op == "max"
    assert calls[2].root == 2 and calls[2].reduce_op is None
    assert calls[2].inputs == (r.TensorMeta((4,), "float64", "cpu"),)
    assert all(c.source == "python" and not c.async_op for c in calls)
    assert sorted(_exits(events)) == [c.call_id for c in calls]
    # the first call on a group announces it once, with its members
    created = [e.group for e in events if isinstance(e, r.GroupEvent)]
    assert created == [r.GroupInfo("1", (0, 2), "gloo", 1, "pair")]  # the default group is index 0
    assert rec.python_seqs["0"][-1] == (2, 2) and rec.in_progress == {}


def test_group_local_root_is_translated_to_a_global_rank() -> None:
    rec, c10d = _recorder()
    sub = c10d.new_group("1", [1, 3])
    _call(rec, "broadcast", sub, tensor=torch.ones(1), group_src=1)
    _call(rec, "reduce", sub, tensor=torch.ones(1), dst=1)
    calls = _calls(_events(rec))
    assert [c.root for c in calls] == [3, 1]


def test_p2p_seqs_count_per_pair_and_do_not_shift_collective_seqs() -> None:
    rec, _ = _recorder(rank=0)
    t = torch.ones(5)
    _call(rec, "all_reduce", tensor=t)
    _call(rec, "send", tensor=t, dst=1)
    _call(rec, "send", tensor=t, dst=1)
    _call(rec, "recv", tensor=t, src=1)
    _call(rec, "send", tensor=t, dst=2)
    _call(rec, "all_reduce", tensor=t)  # the group's 6th op, its 2nd collective
    calls = _calls(_events(rec))
    assert [(c.op, c.peer, c.seq) for c in calls] == [
        ("all_reduce", None, 1),
        ("send", 1, 1),
        ("send", 1, 2),
        ("recv", 1, 1),  # the (1 -> 0) pair, not (0 -> 1)
        ("send", 2, 1),
        ("all_reduce", None, 2),
    ]
    assert rec.groups.p2p_ops == {"0": 4}
    assert calls[3].outputs == (r.TensorMeta((5,), "float32", "cpu"),) and calls[3].inputs == ()


def test_on_nccl_p2p_ops_leave_the_collective_counter_alone() -> None:
    """ProcessGroupNCCL numbers p2p works on a counter of their own: its group counter does not
    move for a send or recv, so nothing is netted out of the next collective's seq."""
    rec, _ = _recorder(rank=0)
    t = torch.ones(5)
    _call(rec, "all_reduce", tensor=t)
    _call(rec, "send", tensor=t, dst=1, issued=0)
    _call(rec, "send", tensor=t, dst=1, issued=0)
    _call(rec, "all_reduce", tensor=t)  # NCCL's collective seq 2
    calls = _calls(_events(rec))
    assert [(c.op, c.seq) for c in calls] == [("all_reduce", 1), ("send", 1), ("send", 2), ("all_reduce", 2)]
    assert rec.groups.p2p_ops == {}


def test_group_local_peer_is_translated_to_a_global_rank() -> None:
    rec, c10d = _recorder(rank=1)
    sub = c10d.new_group("1", [1, 3])
    _call(rec, "send", sub, tensor=torch.ones(1), group_dst=1)
    (call,) = _calls(_events(rec))
    assert (call.peer, call.group, call.seq) == (3, "1", 1)


def test_object_collectives_record_lengths_and_every_collective_they_issue() -> None:
    rec, _ = _recorder()
    cid = _call(rec, "broadcast_object_list", issued=2, object_list=["a", {"b": 1}, None], src=0)
    _call(rec, "all_gather_object", issued=2, object_list=[None] * 4, obj={"x": 1})
    nxt = _call(rec, "all_reduce", tensor=torch.ones(1))
    events = _events(rec)
    calls = {c.call_id: c for c in _calls(events)}
    exits = _exits(events)
    assert calls[cid].inputs == (r.TensorMeta((3,), "object", "cpu"),)
    assert exits[cid].seq_count == 2
    gather = calls[cid + 1]
    assert gather.seq == 3 and gather.inputs == (r.TensorMeta((), "object", "cpu"),)
    assert gather.outputs == (r.TensorMeta((4,), "object", "cpu"),)
    assert calls[nxt].seq == 5  # after the 2 + 2 collectives the object calls issued
    assert list(rec.python_seqs["0"]) == [(1, 2), (3, 4), (5, 5)]


def test_a_call_that_issued_nothing_still_counts_one() -> None:
    rec, _ = _recorder()
    cid = _call(rec, "barrier", issued=0)
    assert _exits(_events(rec))[cid].seq_count == 1


def test_async_work_completes_later_through_poll_pending() -> None:
    rec, _ = _recorder()
    work = FakeWork(done=False)
    cid = _call(rec, "all_reduce", tensor=torch.ones(1), async_op=True, result=work)
    isend = _call(rec, "isend", tensor=torch.ones(1), dst=1, result=FakeWork(done=True))
    events = _events(rec)
    assert {c.call_id: c.async_op for c in _calls(events)} == {cid: True, isend: True}
    assert _exits(events) == {}  # issued, not complete: no exit yet
    rec.poll_pending()
    done = _exits(_events(rec))
    assert list(done) == [isend]
    work.done = True
    rec.poll_pending()
    assert list(_exits(_events(rec))) == [cid]
    assert not rec.pending


def test_async_op_that_returned_no_work_exits_at_once() -> None:
    rec, _ = _recorder()
    cid = _call(rec, "all_reduce", tensor=torch.ones(1), async_op=True, result=None)
    assert list(_exits(_events(rec))) == [cid] and not rec.pending


def test_an_error_is_recorded_on_the_exit() -> None:
    rec, _ = _recorder()
    cid = _call(rec, "all_reduce", tensor=torch.ones(1), error=RuntimeError("Connection closed by peer"))
    (done,) = _exits(_events(rec)).values()
    assert done.call_id == cid and done.error == "RuntimeError: Connection closed by peer"
    assert rec.in_progress == {}


def test_in_progress_marks_the_first_seq_of_the_call_under_way() -> None:
    rec, _ = _recorder()
    _call(rec, "all_reduce", tensor=torch.ones(1))
    raw, pg, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": torch.ones(1)})
    assert rec.in_progress == {"0": 2}
    rec.exit(raw, pg, before, None)
    assert rec.in_progress == {}


def test_a_full_ring_keeps_the_newest_counts_the_rest_and_the_call_still_goes_through() -> None:
    rec, _ = _recorder(capacity=3)
    ids = [_call(rec, "all_reduce", tensor=torch.ones(1)) for _ in range(4)]  # 8 records into 3 slots
    assert ids == [1, 2, 3, 4]
    events = _events(rec)
    assert [type(e).__name__ for e in events] == ["CallExit", "CallRecord", "CallExit"]  # what it did last
    assert [getattr(e, "call_id", 0) for e in events] == [3, 4, 4] and lost(rec) == 5
    assert list(rec.python_seqs["0"]) == [(1, 1), (2, 2), (3, 3), (4, 4)]  # seqs unaffected


def test_enter_records_the_time_and_step_and_uses_the_cached_default_group() -> None:
    rec, c10d = _recorder()
    rec.step = 7
    before = time.time()
    _call(rec, "all_reduce", tensor=torch.ones(1))
    after = time.time()
    (call,) = _calls(_events(rec))
    assert before <= call.enter_time <= after and call.step == 7
    assert c10d.default_lookups == 0  # enter used the cached default_pg


def test_all_to_all_single_records_splits_and_group_rank() -> None:
    rec, _ = _recorder(rank=2)
    _call(
        rec,
        "all_to_all_single",
        output=torch.zeros(6),
        input=torch.ones(6),
        output_split_sizes=[1, 2, 3],
        input_split_sizes=[3, 2, 1],
    )
    (call,) = _calls(_events(rec))
    assert call.extra == {"input_split_sizes": "3,2,1", "output_split_sizes": "1,2,3", "group_rank": "2"}


def test_novel_signatures_are_flagged_once_and_bounded() -> None:
    rec, _ = _recorder()
    spec = OPS_BY_NAME["all_reduce"]

    def novel(shape: tuple[int, ...]) -> bool:
        raw, pg, before = rec.enter(spec, {"tensor": torch.ones(shape)})
        rec.exit(raw, pg, before, None)
        return rec.is_novel(raw)

    assert [novel((2,)), novel((2,)), novel((3,)), novel((2,))] == [True, False, True, False]
    for i in range(MAX_NOVEL_SIGNATURES - 2):
        assert novel((4, i + 1))
    assert rec.flush_novel
    assert not novel((5,))  # the 257th signature: flushing stops for good
    assert not rec.flush_novel and not novel((6,))


def test_call_site_names_the_users_line_through_the_real_wrapper() -> None:
    session = make_session()
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], lambda tensor, op=None, group=None, async_op=False: None)
    capture.set_session(session)
    try:
        line = sys._getframe().f_lineno + 1
        wrapped(torch.ones(1))
    finally:
        capture.set_session(None)
    (call,) = _calls(_events(session.recorder))
    assert call.call_site == f"test_recorder.py:{line} in test_call_site_names_the_users_line_through_the_real_wrapper"


def test_the_ring_size_is_clamped_to_something_usable() -> None:
    assert RingSink(0).capacity == RingSink(1).capacity == 2


@pytest.mark.parametrize(
    ("path", "library"),
    [
        ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", True),
        ("/venv/lib/python3.11/site-packages/accelerate/utils/operations.py", True),
        ("/usr/lib/python3.11/multiprocessing/process.py", True),
        ("<frozen runpy>", True),
        # the user's program, wherever it is installed
        ("/venv/lib/python3.11/site-packages/torch/testing/_internal/distributed/distributed_test.py", False),
        ("/venv/lib/python3.11/site-packages/accelerate/test_utils/scripts/test_ops.py", False),
        ("/venv/lib/python3.11/site-packages/mytrainer/train.py", False),
        ("/home/me/project/train.py", False),
    ],
)
def test_call_sites_skip_plumbing_not_programs_installed_as_packages(path: str, library: bool) -> None:
    """A training script or test harness installed in site-packages is the user's program: its
    line is the call site, not ``<frozen runpy>`` or ``multiprocessing/process.py``."""
    assert is_library(path.replace("/", os.sep) if not path.startswith("<") else path) is library
