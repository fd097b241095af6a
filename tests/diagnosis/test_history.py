"""``History``: a rank's latest calls on a group, a run's calls kept as the run until read."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch import records as r
from hangwatch.diagnosis.state.history import History, RunSlice
from tests.factories import T0, call

COST = 100


def _cost(period: int, i: int) -> int:
    """The bytes of call ``i`` of a run of ``period`` signatures (a cycle's cost more each)."""
    return COST + 10 * (i % period)


def _run(first_seq: int, n: int, period: int = 1) -> r.CallRun:
    enters = [T0 + first_seq + i * 0.01 for i in range(n)]
    template = call(0, 0, call_id=0, cost=COST)
    cycle = tuple(call(0, 0, call_id=0, cost=_cost(period, k), shape=(k,)) for k in range(1, period))
    run = r.CallRun(0, template, 1000 + first_seq, first_seq, 0, enters, [e + 0.005 for e in enters], cycle=cycle)
    run.offset = 2.0
    return run


def _slice(run: r.CallRun, lo: int) -> RunSlice:
    period = len(run.templates)
    n = len(run.enters)
    last = run.call(n - 1, run.offset)
    last.cost, last.holds = _cost(period, n - 1), 1
    return RunSlice(run, lo, last, tuple(_cost(period, k) for k in range(period)))


ops = st.lists(
    st.one_of(
        st.tuples(st.just("call")),
        st.tuples(st.just("run"), st.integers(2, 30), st.integers(0, 29), st.integers(1, 3)),
        st.tuples(st.just("drop"), st.integers(0, 40)),
        st.tuples(st.just("read")),
        st.tuples(st.just("last")),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_history_is_the_list_of_its_calls_whatever_is_read_when(steps: list[tuple[object, ...]]) -> None:
    """Against a plain list of (seq, enter time): order, length, the last call, and what each
    drop hands back (the records, and the bytes of calls never made whole) all agree, whether
    the runs were made whole by a read before or not."""
    hist = History()
    model: list[tuple[int, float]] = []
    costs: dict[int, int] = {}  # seq -> its call's bytes
    made: set[int] = set()  # seqs that have a record (came alone, a run's last, or read since)
    seq = 1
    for step in steps:
        if step[0] == "call":
            c = call(0, seq, enter_time=T0 + seq, cost=COST)
            c.holds = 1  # the history's (as ``JobState._enter`` gives it)
            assert hist.push(c, 1 << 30) is None  # (no cap reached: nothing dropped)
            model.append((seq, c.enter_time))
            costs[seq] = COST
            made.add(seq)
            seq += 1
        elif step[0] == "run":
            n, lo, period = step[1], step[2], step[3]
            assert isinstance(n, int) and isinstance(lo, int) and isinstance(period, int)
            lo = min(lo, n - 1)
            run = _run(seq, n, period)
            hist.append_run(_slice(run, lo))
            model.extend((seq + i, run.enters[i] + run.offset) for i in range(lo, n))
            costs.update((seq + i, _cost(period, i)) for i in range(n))
            made.add(seq + n - 1)
            seq += n
        elif step[0] == "drop":
            k = step[1]
            assert isinstance(k, int)
            records, loose = hist.drop_oldest(k)
            gone, model = model[:k], model[k:]
            assert [c.seq for c in records] == [s for s, _ in gone if s in made]
            assert loose == sum(costs[s] for s, _ in gone if s not in made)
            assert all(c.holds == 1 for c in records)
        elif step[0] == "read":
            calls = list(hist)
            assert [(c.seq, c.enter_time) for c in calls] == model
            assert all(c.cost == costs[c.seq] and c.holds >= 1 for c in calls)
            made.update(s for s, _ in model)
        elif step[0] == "last" and model:
            assert hist[-1].seq == model[-1][0]
        assert len(hist) == len(model)
        assert bool(hist) == bool(model)
    assert [c.seq for c in hist] == [s for s, _ in model]


def test_a_read_makes_a_runs_calls_once_and_keeps_the_last_the_same_record() -> None:
    run = _run(1, 10)
    piece = _slice(run, 4)
    hist = History()
    hist.append_run(piece)
    assert hist[-1] is piece.last
    first = list(hist)
    assert [c.seq for c in first] == list(range(5, 11)) and first[-1] is piece.last
    assert [c.call_id for c in first] == [1005 + i for i in range(6)]
    assert next(iter(hist)) is first[0]  # made once: a second read gives the same records
    assert repr(hist) == "History(6 calls, 0 runs not made whole)"


def test_alone_gives_the_calls_that_came_alone_without_making_runs() -> None:
    hist = History()
    send = call(0, 1, "send", peer=1)
    hist.push(send, 1 << 30)
    hist.append_run(_slice(_run(2, 5), 0))
    assert list(hist.alone()) == [send]
    assert repr(hist) == "History(6 calls, 1 runs not made whole)"
