"""Where two ranks' traces part (``hangwatch.model.align``), on the traces the story table's
programs leave (``tests/e2e/test_story.py``), each against the look-alike that must read as the
same trace."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hangwatch import records as r
from hangwatch.model.align import EditKind, Forward, align, trace
from tests.factories import call

CXX = "issued from C++ (gloo:all_reduce)"


class Rank:
    """A rank's program, played call by call: its calls (numbered per group) and DDP forwards."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ids: Iterator[int] = itertools.count(1)
        self.seqs: dict[str, int] = {}
        self.calls: list[r.CallRecord] = []
        self.forwards: list[Forward] = []
        self.step = 0

    def call(self, site: str, op: str = "all_reduce", group: str = "0", shape: tuple[int, ...] = (4,)) -> None:
        seq = self.seqs[group] = self.seqs.get(group, 0) + 1
        self.calls.append(
            call(self.rank, seq, op, call_id=next(self.ids), group=group, shape=shape, call_site=site, step=self.step)
        )

    def forward(self, group: str = "0") -> None:
        self.forwards.append((len(self.forwards) + 1, group, self.seqs.get(group, 0), self.step))

    def marks(self) -> list[object]:
        return trace(self.calls, self.forwards)  # type: ignore[return-value]


def _edit(mine: Rank, theirs: Rank) -> object:
    return align(trace(mine.calls, mine.forwards), trace(theirs.calls, theirs.forwards))


def test_the_same_program_is_the_same_trace() -> None:
    a, b = Rank(0), Rank(1)
    for _ in range(10):
        for rk in (a, b):
            rk.call("train.py:9")
            rk.step += 1
    b.call("train.py:9")  # one further on
    assert _edit(a, b).kind is EditKind.SHORT
    assert _edit(b, a).kind is EditKind.SAME


def test_a_skipped_object_collective_is_told_neutrally_until_later_calls_say_more() -> None:
    """Rank 2 skips broadcast_object_list and is in the loop's all_reduce; the others are stuck
    in the broadcast, so nothing after it shows which call is the program's own."""
    ranks = [Rank(k) for k in range(3)]
    for rk in ranks:
        for _ in range(3):
            rk.call("train.py:9")  # the warm-up every rank runs
        if rk.rank != 2:
            rk.call("train.py:12", op="broadcast_object_list", shape=(1,))
        else:
            rk.call("train.py:14")
    edit = _edit(ranks[2], ranks[0])
    assert edit.kind is EditKind.DIFFERENT  # never "an extra all_reduce at the warm-up"
    assert edit.mine is not None and edit.mine.call_site == "train.py:14"
    assert edit.theirs is not None and edit.theirs.op == "broadcast_object_list"


def _ddp(rank: int, skip_at: int | None, steps: int = 20, barrier: bool = True) -> Rank:
    rk = Rank(rank)
    rk.call("train.py:4", op="broadcast")  # DDP's start: the parameters from rank 0
    for step in range(steps):
        rk.forward()
        if step == skip_at:
            continue
        rk.call(CXX)  # the backward's bucket, from C++
        rk.step += 1
    if barrier:
        rk.call("train.py:19", op="barrier", shape=())
    return rk


def test_a_forward_without_its_backward_pins_the_skip_under_ddp() -> None:
    culprit, other = _ddp(1, skip_at=6), _ddp(0, skip_at=None)
    other.calls.pop()  # rank 0 is still in its last bucket: no barrier yet
    edit = _edit(culprit, other)
    assert edit.kind is EditKind.SKIPPED and edit.pinned and edit.confirmed
    assert edit.forward == 7 and edit.theirs is not None and edit.theirs.step == 6
    assert edit.ahead == 1  # its barrier, past the reference's end


def test_where_every_round_looks_alike_a_skip_has_no_place() -> None:
    """No forward passes (a hand-written loop of one all_reduce): one call fewer reads the same
    whether it was skipped anywhere or the loop left one round early."""
    culprit, other = Rank(1), Rank(0)
    for step in range(20):
        for rk in (culprit, other):
            if rk is culprit and step == 6:
                continue
            rk.call("train.py:9")
    edit = _edit(culprit, other)
    assert edit.kind is EditKind.SHORT and edit.behind == 1


def _async(rank: int, skip_at: int | None, steps: int) -> Rank:
    rk = Rank(rank)
    for step in range(steps):
        rk.call("train.py:8", shape=(1,))  # the loss, for the log
        if step == skip_at:
            continue
        rk.call("train.py:12")  # the gradients
        rk.step += 1
    return rk


def test_a_skipped_call_whose_next_call_meets_it_is_told_from_the_program_s_own_rounds() -> None:
    """Rank 1 skips the gradients' all_reduce at step 6 and goes on to the next step's loss
    all_reduce, which meets rank 0's gradients: rank 0 is stuck there, so nothing after it
    lines up, but every earlier round made the loss all_reduce right after the gradients'."""
    culprit = _async(1, skip_at=6, steps=8)
    culprit.calls = culprit.calls[:14]  # its loss all_reduce of step 7 is its last
    other = _async(0, skip_at=None, steps=7)  # its step-6 gradients are the call it waits in
    edit = _edit(culprit, other)
    assert edit.kind is EditKind.SKIPPED and edit.confirmed
    assert edit.theirs is not None and edit.theirs.call_site == "train.py:12" and edit.theirs.step == 6
    assert edit.went_on is not None and edit.went_on.call_site == "train.py:8"


def test_an_extra_call_is_told_once_later_calls_line_up_after_it() -> None:
    culprit, other = Rank(1), Rank(0)
    for step in range(12):
        for rk in (culprit, other):
            rk.call("train.py:6")
            if rk is culprit and step == 4:
                rk.call("train.py:9")  # the gradient norm, for its own log
            rk.step += 1
    edit = _edit(culprit, other)
    assert edit.kind is EditKind.EXTRA and edit.confirmed and edit.pinned
    assert edit.mine is not None and edit.mine.call_site == "train.py:9" and edit.mine.step == 4
    assert edit.ahead == 0 and edit.behind == 0
    # seen from the other side, the same edit is a skip: which side is wrong is the caller's call
    assert _edit(other, culprit).kind is EditKind.SKIPPED


def test_a_rank_dependent_branch_issuing_one_collective_from_two_lines_is_no_edit() -> None:
    a, b = Rank(0), Rank(1)
    for _ in range(6):
        a.call("train.py:10", op="broadcast")  # if rank == 0: broadcast(t, 0)
        b.call("train.py:12", op="broadcast")  # else: broadcast(t, 0)
        for rk in (a, b):
            rk.call("train.py:14")
    assert _edit(a, b).kind is EditKind.SAME


def test_the_same_call_made_with_another_shape_is_different() -> None:
    a, b = Rank(0), Rank(1)
    for step in range(5):
        a.call("train.py:7", shape=(10,))
        b.call("train.py:7", shape=(20,) if step == 4 else (10,))
    edit = _edit(b, a)
    assert edit.kind is EditKind.DIFFERENT and edit.mine is not None and edit.mine.inputs[0].shape == (20,)


def test_a_branch_taken_once_before_the_loop_is_passed_over_for_the_edit_after_it() -> None:
    a, b = Rank(0), Rank(1)
    a.call("train.py:5", op="broadcast")  # if rank == 0: broadcast(t, 0), once
    b.call("train.py:7", op="broadcast")  # else: broadcast(t, 0)
    for step in range(10):
        for rk in (a, b):
            rk.call("train.py:10", shape=(1,))
            if not (rk is b and step == 6):
                rk.call("train.py:12")
            rk.step += 1
    edit = _edit(b, a)
    assert edit.kind is EditKind.SKIPPED and edit.theirs is not None and edit.theirs.call_site == "train.py:12"
    assert edit.theirs.seq == 15 and edit.theirs.step == 6 and edit.confirmed


def test_a_skip_every_rank_agreed_on_is_no_edit() -> None:
    """The look-alike: the NaN is all-reduced first, so every rank skips the same step."""
    assert _edit(_ddp(1, skip_at=6), _ddp(0, skip_at=6)).kind is EditKind.SAME


# ---- the claims of the rules the model replaced (``rules.shift``), as edits ---------------------

BASE = [("all_reduce", 4), ("all_reduce", 4), ("barrier", 0), ("all_reduce", 8), ("broadcast", 2)]


def _rank(rank: int, ops: list[tuple[str, int]], sites: dict[int, str] | None = None) -> Rank:
    """A rank making ``ops``, each from its line in the program (``BASE``'s; ``sites``: by index)."""
    rk = Rank(rank)
    for k, (op, n) in enumerate(ops):
        line = (sites or {}).get(k) or f"train.py:{20 + BASE.index((op, n))}"
        rk.call(line, op=op, shape=(n,) if n else ())
    return rk


def test_an_extra_call_among_alike_ones_is_told_once_the_shift_shows() -> None:
    """The extra all_reduce [4] looks like the loop's next one: the later calls tell."""
    extra = [BASE[0], BASE[1], ("all_reduce", 4), *BASE[2:]]
    edit = _edit(_rank(1, extra, {2: "train.py:30"}), _rank(0, BASE))
    assert edit.kind is EditKind.EXTRA and edit.confirmed and edit.mine is not None
    assert edit.mine.call_site == "train.py:30" and edit.mine.seq == 3


def test_what_is_not_one_extra_call_is_not_told_as_one() -> None:
    substituted = _edit(_rank(1, [*BASE[:2], ("all_reduce", 1), *BASE[3:]], {2: "train.py:22"}), _rank(0, BASE))
    assert substituted.kind is EditKind.DIFFERENT
    unconfirmed = _edit(_rank(1, [*BASE[:2], ("all_reduce", 1)], {2: "train.py:30"}), _rank(0, BASE))
    assert unconfirmed.kind is not EditKind.EXTRA or not unconfirmed.confirmed
    assert _edit(_rank(1, BASE), _rank(0, BASE)).kind is EditKind.SAME


def _ddp_buckets(rank: int, forwards: int, buckets: int, skip_at: int | None) -> Rank:
    rk = Rank(rank)
    for n in range(forwards):
        rk.forward()
        if n == skip_at:
            continue
        for _ in range(buckets):
            rk.call(CXX)
        rk.step += 1
    return rk


def test_several_buckets_a_backward_are_skipped_together_after_their_forward() -> None:
    culprit, other = _ddp_buckets(1, 30, 3, skip_at=9), _ddp_buckets(0, 30, 3, skip_at=None)
    edit = _edit(culprit, other)
    assert edit.kind is EditKind.SKIPPED and edit.forward == 10 and edit.pinned and edit.confirmed
    assert edit.count == 3  # the backward's three buckets


def test_the_look_alikes_of_a_skipped_backward_are_not_one() -> None:
    # it left the loop early: one forward and its backward fewer, level while it ran
    assert _edit(_ddp_buckets(1, 29, 1, None), _ddp_buckets(0, 30, 1, None)).kind is EditKind.SHORT
    # level all along
    assert _edit(_ddp_buckets(1, 30, 1, None), _ddp_buckets(0, 30, 1, None)).kind is EditKind.SAME
