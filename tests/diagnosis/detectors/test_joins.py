"""Detector ``joins``: ranks that wait in ``init_process_group`` for others, before any joined."""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context, joins
from hangwatch.diagnosis.state import JobState
from tests.factories import T0, only

INIT_AFTER = 60.0


def _joiner(rank: int, phase: str, world: int = 3, attempt: int = 0) -> r.RankIdentity:
    return r.RankIdentity(
        job_id="j",
        rank=rank,
        world_size=world,
        host="node-a",
        pid=4000 + rank,
        start_time=100.0 + rank,
        session=f"s{rank}",
        launch="10.0.0.1:29500",
        attempt=attempt,
        phase=phase,
    )


def _ctx(now: float) -> Context:
    return Context(now=now, stuck_after_s=10.0, silence_after=5.0, init_after=INIT_AFTER)


def test_ranks_waiting_in_init_for_one_that_never_entered_it_name_it_where_it_is() -> None:
    job = JobState()
    for rank in (0, 2):
        job.join(_joiner(rank, r.STARTING), T0)
        job.join(_joiner(rank, r.IN_INIT), T0 + 1)
    job.join(_joiner(1, r.STARTING), T0)
    assert joins.detect(job, _ctx(T0 + INIT_AFTER)) == []  # under the threshold: a slow start
    f = only(joins.detect(job, _ctx(T0 + 1 + INIT_AFTER)), "stuck_collective")
    assert (f.culprit_ranks, f.waiting_ranks, f.op, f.key) == (
        [1],
        [0, 2],
        "init_process_group",
        "stuck:init_process_group:0",
    )
    assert f.summary == (
        "ranks 0, 2 wait in init_process_group for 60 s; rank 1 never entered init_process_group: its process "
        "(pid 4001 on node-a) runs"
    )
    assert f.stack_ranks == [1, 0]
    job.joining[1].where = "download_dataset at train.py:12"  # from its stack
    f = only(joins.detect(job, _ctx(T0 + 62)))
    assert "rank 1 never entered init_process_group: it is in download_dataset at train.py:12" in f.summary


def test_a_rank_never_seen_and_one_gone_before_it_joined_are_told_so() -> None:
    job = JobState()
    job.join(_joiner(0, r.IN_INIT), T0)
    job.join(_joiner(1, r.GONE), T0)
    f = only(joins.detect(job, _ctx(T0 + INIT_AFTER + 1)), "stuck_collective")
    assert f.culprit_ranks == [1, 2] and f.waiting_ranks == [0]
    assert "rank 1's process (pid 4001 on node-a) ended before it joined" in f.summary
    assert "rank 2 never joined, and no process of it was seen" in f.summary


def test_every_rank_inside_and_none_leaving_is_the_rendezvous() -> None:
    job = JobState()
    for rank in range(3):
        job.join(_joiner(rank, r.IN_INIT), T0)
    f = only(joins.detect(job, _ctx(T0 + INIT_AFTER + 1)), "transport_stall")
    assert f.culprit_ranks == [0, 1, 2]
    assert f.summary.startswith("every rank (0-2) waits in init_process_group")
    assert "the rendezvous at 10.0.0.1:29500 does not complete" in f.summary


def test_once_a_rank_joined_its_collectives_tell_the_rest() -> None:
    """The look-alike of an init hang on NCCL: init returns on each rank without waiting for the
    others; a rank that joined is followed by its own collectives (the stuck detector)."""
    job = JobState()
    job.join(_joiner(0, r.IN_INIT), T0)
    job.join(_joiner(1, r.IN_INIT), T0)
    identity = _joiner(2, "")
    job.register(identity, T0 + 1)
    job.joined(2)
    assert joins.detect(job, _ctx(T0 + INIT_AFTER + 5)) == []


def test_processes_of_an_earlier_attempt_are_not_waited_for() -> None:
    """torchrun restarted the job: what the first attempt's processes said is gone with them."""
    job = JobState()
    job.join(_joiner(0, r.IN_INIT, attempt=1), T0)
    job.join(_joiner(1, r.STARTING, attempt=0), T0)  # a straggler of the first attempt
    job.join(_joiner(1, r.IN_INIT, world=3, attempt=1), T0)
    job.join(_joiner(2, r.IN_INIT, attempt=1), T0)
    f = only(joins.detect(job, _ctx(T0 + INIT_AFTER + 1)), "transport_stall")
    assert f.culprit_ranks == [0, 1, 2]
