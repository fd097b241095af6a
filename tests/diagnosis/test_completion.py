"""Completion on the device (NCCL): a collective is open from its enqueue to its completion.

On NCCL the host thread returns from a collective when it is enqueued; the node agent reads each
group's progress (enqueued / started / completed seq) from the rank's NCCL Flight Recorder ring
and the job state keeps the call open until that progress completes it. Driven through the real
``JobState`` with an explicit clock (``tests.factories.SimJob``).
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.diagnosis import views
from hangwatch.diagnosis.state import PROGRESS_FRESH_S
from tests.factories import T0, SimJob, call


def _nccl_job(n: int = 1) -> SimJob:
    sim = SimJob(n)
    for rk in range(n):
        sim.progress(rk, T0, enqueued=0, completed=0)  # the agent reads the ring: completion is watched
    return sim


def test_a_returned_collective_stays_open_until_the_gpu_completes_it() -> None:
    sim = _nccl_job()
    rec = sim.call(0, T0 + 1, seq=1)
    sim.exit(rec, T0 + 1.001)  # enqueued: the host thread returns at once
    st = sim.states[0]
    assert rec.exit_time is None and rec.returned_time == T0 + 1.001
    assert st.oldest_open() is rec
    sim.progress(0, T0 + 2, enqueued=1, completed=0)
    assert rec.exit_time is None  # still on the GPU
    sim.progress(0, T0 + 3, enqueued=1, completed=1, completed_time=T0 + 2.5)
    assert rec.exit_time == T0 + 2.5  # when torch's watchdog found it complete
    assert st.open_calls == {}
    assert sim.job.wait_durations[-1] == 1.5  # the threshold learns completion, not return


def test_views_say_the_call_is_on_the_gpu_and_when_torch_gives_up() -> None:
    sim = _nccl_job()
    sim.progress(0, T0 + 0.5, enqueued=0, completed=0, timeout_ms=600_000)
    rec = sim.call(0, T0 + 1, seq=1)
    sim.exit(rec, T0 + 1.001)
    sim.beat(T0 + 2, where_user="train.py:40 in step")
    data = views.rank_json(sim.states[0], T0 + 3, silence_after=5.0)
    assert data["state"] == "waiting" and data["completion"] == "device"
    assert data["host_returned"] == T0 + 1.001
    assert data["timeout_at"] == T0 + 1 + 600


def test_completion_is_not_held_for_gloo_or_without_progress() -> None:
    sim = SimJob(1)
    rec = sim.call(0, T0 + 1, seq=1)
    sim.exit(rec, T0 + 1.2)
    assert rec.exit_time == T0 + 1.2 and rec.returned_time is None
    assert views.rank_json(sim.states[0], T0 + 2, silence_after=5.0)["completion"] == "host"


def test_a_record_that_arrives_complete_is_held_while_the_gpu_has_not_completed_it() -> None:
    """The ring may carry a call's enter and exit in one read: it arrives as one finished record."""
    sim = _nccl_job()
    rec = call(0, 1, enter_time=T0 + 1, exit_time=T0 + 1.001, call_id=7)
    sim.apply(rec, T0 + 1.1)
    assert rec.exit_time is None and rec.returned_time == T0 + 1.001
    sim.progress(0, T0 + 2, enqueued=1, completed=1)
    assert rec.exit_time == T0 + 2


def test_several_enqueued_collectives_complete_in_order() -> None:
    sim = _nccl_job()
    recs = []
    for seq in (1, 2, 3):
        rec = sim.call(0, T0 + seq * 0.01, seq=seq)
        sim.exit(rec, T0 + seq * 0.01 + 0.001)
        recs.append(rec)
    # the next call's enter does not close the one before it: both are on the GPU
    assert [rc.exit_time for rc in recs] == [None, None, None]
    sim.progress(0, T0 + 1, enqueued=3, completed=2)
    assert [rc.exit_time is not None for rc in recs] == [True, True, False]
    sim.progress(0, T0 + 2, enqueued=3, completed=3)
    assert all(rc.exit_time is not None for rc in recs)


def test_everything_enqueued_completed_settles_a_call_whatever_its_seq() -> None:
    """A seq torch counts differently from the hook must not hold a call open for good: a read
    after the return that shows everything enqueued completed settles it."""
    sim = _nccl_job()
    rec = sim.call(0, T0 + 1, seq=9)  # numbered ahead of what the ring says
    sim.exit(rec, T0 + 1.001)
    sim.progress(0, T0 + 0.5, enqueued=4, completed=3)  # a read from before it: not settled
    assert rec.exit_time is None
    sim.progress(0, T0 + 2, enqueued=4, completed=4)
    assert rec.exit_time == T0 + 2


def test_progress_that_stops_coming_releases_the_calls_it_held() -> None:
    """The agent is gone (or the worker server no longer answers): completion is no longer
    watched, so held calls count as complete when they returned and new ones close at return."""
    sim = _nccl_job()
    rec = sim.call(0, T0 + 1, seq=1)
    sim.exit(rec, T0 + 1.001)
    sim.job.lapse_progress(T0 + PROGRESS_FRESH_S - 0.5)
    assert rec.exit_time is None
    sim.job.lapse_progress(T0 + PROGRESS_FRESH_S + 1)
    assert rec.exit_time == T0 + 1.001
    later = sim.call(0, T0 + 10, seq=2)
    sim.exit(later, T0 + 10.001)
    assert later.exit_time == T0 + 10.001


def test_records_made_from_flight_recorder_keep_their_own_completion() -> None:
    sim = _nccl_job()
    rec = call(0, 1, enter_time=T0 + 1, exit_time=T0 + 1.4, call_id=(1 << 62) + 1, source="flight_recorder")
    sim.apply(rec, T0 + 1.5)
    assert rec.exit_time == T0 + 1.4


def test_an_async_call_s_exit_is_its_completion() -> None:
    """``async_op=True``: the hook reports the exit when ``work.is_completed()``, on the GPU."""
    sim = _nccl_job()
    rec = sim.call(0, T0 + 1, seq=1, async_op=True)
    sim.exit(rec, T0 + 1.3)
    assert rec.exit_time == T0 + 1.3


def test_failed_and_p2p_calls_are_not_held() -> None:
    sim = _nccl_job()
    failed = sim.call(0, T0 + 1, seq=1)
    sim.exit(failed, T0 + 1.1, error="DistBackendError: NCCL error")
    assert failed.exit_time == T0 + 1.1
    send = sim.call(0, T0 + 2, op="send", seq=1, peer=1)
    sim.exit(send, T0 + 2.1)
    assert send.exit_time == T0 + 2.1


def test_progress_on_many_groups_is_bounded() -> None:
    sim = _nccl_job()
    for g in range(50):
        sim.apply(r.GroupProgress(0, str(g), 1, -1, 1, T0 + 1), T0 + 1)
    assert len(sim.states[0].progress) == 50
