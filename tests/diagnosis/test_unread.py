"""A batch a node agent sends without reading the rank's ring (``ReportBatch.unread``: a large
job's steady rank between its reads) says the rank is alive and where, and nothing of its calls:
it keeps the rank from looking frozen, and never shows the rank absent from a collective."""

from __future__ import annotations

from hangwatch.diagnosis.detectors import frozen, stuck
from tests.factories import T0, SimJob, only


def test_an_unread_batch_says_the_rank_is_alive_not_that_it_stayed_out_of_a_call() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    st = sim.states[1]
    st.budget_note = "3 CPU Flight Recorder entries overwritten"
    for t in (T0 + 4, T0 + 6, T0 + 8, T0 + 10, T0 + 12):
        sim.beat(t, ranks=[0])
        sim.deliver(1, [], t, sent_time=t, unread=True, where_user="train.py:88 in step", flight_time=t)
    assert st.last_seen == T0 + 12 and st.heard_to == T0 + 12 and st.where_user == "train.py:88 in step"
    assert st.last_sent < T0 + 2 and st.flight_to == 0.0 and st.budget_note.startswith("3 CPU")
    ctx = sim.ctx(T0 + 12.5)
    assert frozen.detect(sim.job, ctx) == []  # said alive
    assert stuck.detect(sim.job, ctx) == []  # and nothing said of its calls: not known absent
    sim.beat(T0 + 12.6, ranks=[1])  # a read: it had not entered
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.6)), "stuck_collective").culprit_ranks == [1]


def test_ranks_read_far_apart_and_said_alive_between_are_not_heard_late() -> None:
    """The coordinator's lateness (``JobState.behind``) is measured on every batch, read or not:
    ranks read every 4 s, all on one beat, do not make it look behind and hold its judgements."""
    sim = SimJob(16)
    for k in range(30):
        t = T0 + 2 * k
        if k % 2:
            for rank in range(16):
                sim.deliver(rank, [], t, sent_time=t, unread=True)
        else:
            sim.beat(t)
        assert sim.job.behind(t + 1.5) < 1.0, k
