"""Runs of a job on one coordinator: a rerun, the next job, a restart by the launcher.

Every run of a job gets a state of its own and incident keys of its own: the same hang in a
rerun is reported again, and nothing of one run (its ranks, world size, groups, thresholds) leaks
into the next. The real ``JobState`` and ``Engine``, explicit clock (``tests.factories``).
"""

from __future__ import annotations

import pytest

from hangwatch import records as r
from hangwatch.diagnosis import jobs as jobs_mod
from hangwatch.diagnosis import views
from hangwatch.diagnosis.jobs import Jobs, JobsFull, SessionOver, job_key
from tests.factories import T0, SimJob, group_event, identity


def _hang(sim: SimJob, t: float) -> None:
    """Rank 0 waits in all_reduce seq 2; rank 1 never comes."""
    for rk in sim.states:
        sim.exit(sim.call(rk, t, seq=1), t + 0.01)
    sim.call(0, t + 1, seq=2)
    sim.beat(t + 20)


def _rerun(sim: SimJob, t: float, world: int = 2, attempt: int = 0) -> None:
    for rk in range(world):
        sim.register(rk, t, identity(rk, world, session=f"rerun-{rk}-{t}", attempt=attempt))
    sim.world = world
    sim.states = {rk: st for rk, st in sim.states.items() if rk < world}


def test_the_same_hang_in_a_rerun_is_reported_again() -> None:
    sim = SimJob(2)
    engine = sim.engine()
    _hang(sim, T0)
    (first,) = engine.tick(T0 + 20)
    for rk in (0, 1):  # the user kills the hung job
        sim.proc(rk, r.ProcState.DEAD, T0 + 30, signal=9)
    _rerun(sim, T0 + 100)
    _hang(sim, T0 + 101)
    (again,) = engine.tick(T0 + 121)
    assert (again.kind, again.culprit_ranks, again.seq) == ("stuck_collective", [1], 2)
    assert again.id != first.id and again.key != first.key
    assert first.status == "resolved" and "run ended" in first.resolution
    assert sim.job.incarnations == 2


def test_the_next_job_on_the_coordinator_starts_from_nothing() -> None:
    """4 ranks with a subgroup, all end; then a 2-rank job: it is 2 ranks, no group of the first
    job is compared with it, and nothing is reported."""
    sim = SimJob(4)
    engine = sim.engine()
    for rk in range(4):
        sim.apply(group_event(rk, "1", (0, 1, 2, 3)), T0)
        sim.exit(sim.call(rk, T0 + 1, seq=1), T0 + 1.01)
        sim.end(rk, r.EndKind.CLEAN_EXIT, T0 + 2)
    assert engine.tick(T0 + 3) == []
    _rerun(sim, T0 + 10, world=2)
    for rk in range(2):
        sim.apply(group_event(rk, "1", (0, 1)), T0 + 10)
        sim.exit(sim.call(rk, T0 + 11, seq=1, group="1"), T0 + 11.01)
    sim.beat(T0 + 12)
    assert engine.tick(T0 + 12) == []
    status = views.status_json(sim.job, T0 + 12, 5.0, {}, [])
    assert (status["job"]["world_size"], status["job"]["registered"]) == (2, 2)


def test_a_restart_by_the_launcher_is_a_new_run() -> None:
    """torchrun --max-restarts: every worker restarted, TORCHELASTIC_RESTART_COUNT=1."""
    sim = SimJob(2)
    engine = sim.engine()
    _hang(sim, T0)
    (first,) = engine.tick(T0 + 20)
    _rerun(sim, T0 + 25, attempt=1)  # the old processes may not even be seen gone yet
    assert sim.job.incarnations == 2 and sim.job.attempt == 1
    _hang(sim, T0 + 26)
    (again,) = engine.tick(T0 + 46)
    assert again.id != first.id


def test_a_rank_restarted_alone_in_a_live_run_stays_in_it() -> None:
    """The look-alike: one rank re-registers (a new session, same launch and attempt) while the
    others run: the same run goes on."""
    sim = SimJob(2)
    run = sim.job.incarnation
    sim.register(1, T0 + 5, identity(1, 2, session="restarted-1"))
    assert sim.job.incarnation == run and sim.job.incarnations == 1


def test_another_launch_is_another_job_and_never_wipes_the_first() -> None:
    """A second job (another rendezvous endpoint, the same default job id) starting while the
    first still runs gets a state of its own; the first keeps its run, its ranks and its slots."""
    jobs = Jobs()
    first = [jobs.register(identity(rk, 2, session=f"a{rk}", launch="10.0.0.1:29500"), T0)[0] for rk in range(2)]
    second, _ = jobs.register(identity(0, 4, session="b0", launch="10.0.0.2:29500"), T0 + 1)
    assert first[0] is first[1] and second is not first[0]
    assert (first[0].world_size, sorted(first[0].ranks)) == (2, [0, 1])
    assert (second.world_size, sorted(second.ranks)) == (4, [0])
    assert jobs.for_session("a0") is first[0] and jobs.for_session("b0") is second
    assert [j.job_id for j in jobs] == ["job", "job"] and len({jobs.key_of(j) for j in jobs}) == 2


def test_a_loopback_endpoint_is_told_apart_by_host() -> None:
    """Two single-node jobs on two nodes, both meeting at 127.0.0.1:29500, are two jobs."""
    a = identity(0, 1, session="a", host="node-a", launch="127.0.0.1:29500")
    b = identity(0, 1, session="b", host="node-b", launch="127.0.0.1:29500")
    assert job_key(a) != job_key(b)
    assert job_key(identity(0, 2, launch="10.0.0.1:29500", host="x")) == job_key(
        identity(1, 2, launch="10.0.0.1:29500", host="y")
    )  # a multi-node job: one endpoint, one job, whatever the host


def test_a_rerun_through_a_new_endpoint_retires_the_job_that_is_over() -> None:
    """torchrun --standalone meets at a new port each time: the rerun of an over job (same id) is
    a new job, and the old one is retired with its run (the engine resolves its incidents)."""
    jobs = Jobs()
    old, _ = jobs.register(identity(0, 1, session="a", launch="127.0.0.1:40001"), T0)
    old.ranks[0].end = r.RankEnd(0, r.EndKind.SIGNAL, T0 + 5, "SIGKILL")
    new, _ = jobs.register(identity(0, 1, session="b", launch="127.0.0.1:40002"), T0 + 10)
    assert list(jobs) == [new] and "new run" in jobs.ended_incarnations[old.incarnation]


def test_a_rank_on_its_way_out_never_registers_again_into_its_retired_job() -> None:
    """Found on a loaded machine: a job's ranks said their end (interpreter exit) and their
    processes lingered (DataLoader workers joining); another job began and retired this one; the
    node agent, told the sessions were unknown, registered them again, which began a new run of
    the job whose ranks then "died" with no word of their end. A session that ended in a retired
    job is refused; the job's rerun (new sessions) is not."""
    jobs = Jobs()
    old, _ = jobs.register(identity(0, 2, session="a0", launch="127.0.0.1:40001", job_id="loader"), T0)
    jobs.register(identity(1, 2, session="a1", launch="127.0.0.1:40001", job_id="loader"), T0)
    for rk in (0, 1):
        old.ranks[rk].end = r.RankEnd(rk, r.EndKind.CLEAN_EXIT, T0 + 5, "interpreter exit")
    other, _ = jobs.register(identity(0, 2, session="b0", launch="127.0.0.1:40009", job_id="other"), T0 + 6)
    assert list(jobs) == [other]
    with pytest.raises(SessionOver):
        jobs.register(identity(0, 2, session="a0", launch="127.0.0.1:40001", job_id="loader"), T0 + 7)
    assert list(jobs) == [other]  # no new run of the old job was begun
    rerun, _ = jobs.register(identity(0, 2, session="c0", launch="127.0.0.1:40001", job_id="loader"), T0 + 8)
    assert rerun is not old and sorted(rerun.ranks) == [0]


def test_a_live_rank_of_a_retired_silent_job_may_register_again() -> None:
    """The look-alike: a job retired while its ranks were only silent (no end seen) takes them
    back when they speak again (a coordinator that was unreachable for long)."""
    jobs = Jobs()
    jobs.register(identity(0, 1, session="a0", launch="127.0.0.1:40001"), T0)
    jobs.retire_over(T0 + jobs_mod.SILENT_GONE_S + jobs_mod.OVER_KEPT_S + 10)
    assert list(jobs) == []
    again, state = jobs.register(identity(0, 1, session="a0", launch="127.0.0.1:40001"), T0 + 5000)
    assert list(jobs) == [again] and state.identity.session == "a0"


def test_jobs_beyond_the_cap_are_refused_never_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_mod, "MAX_JOBS", 2)
    jobs = Jobs()
    for n in range(2):
        jobs.register(identity(0, 1, session=f"s{n}", launch=f"10.0.0.{n}:1"), T0)
    with pytest.raises(JobsFull):
        jobs.register(identity(0, 1, session="s9", launch="10.0.0.9:1"), T0)
    assert jobs.refused == 1 and len(jobs) == 2
    next(iter(jobs)).ranks[0].end = r.RankEnd(0, r.EndKind.CLEAN_EXIT, T0 + 1)  # one is over: it makes room
    jobs.register(identity(0, 1, session="s9", launch="10.0.0.9:1"), T0 + 2)
    assert len(jobs) == 2


def test_a_rank_registering_after_the_first_has_already_ended_joins_its_run() -> None:
    """Ranks register at their own pace: gloo's root of a broadcast can finish, and exit, before
    its peer's registration reaches the coordinator. That peer is the same run, not the next."""
    sim = SimJob(0, register_all=False)
    sim.world = 2
    sim.register(0, T0, identity(0, 2, session="s0"))
    sim.end(0, r.EndKind.CLEAN_EXIT, T0 + 0.1)
    run = sim.job.incarnation
    sim.register(1, T0 + 0.2, identity(1, 2, session="s1"))
    assert sim.job.incarnation == run and sorted(sim.job.ranks) == [0, 1]


def test_ranks_silent_for_long_are_gone_for_the_job_s_end_and_the_next_run() -> None:
    """Ranks SIGKILLed with no agent on their nodes never say they ended: after SILENT_GONE_S of
    silence their job is over (it neither holds a slot of MAX_JOBS nor blocks its resubmission)."""
    from hangwatch.diagnosis.state import SILENT_GONE_S

    jobs = Jobs()
    launch = "10.0.0.1:29500"
    old, _ = jobs.register(identity(0, 2, session="old0", launch=launch), T0)
    jobs.register(identity(1, 2, session="old1", launch=launch), T0)
    later = T0 + SILENT_GONE_S + 60
    new, _ = jobs.register(identity(0, 4, session="new0", launch=launch), later)  # resubmitted, 4 ranks
    assert new is old and new.incarnation != "" and new.world_size == 4 and sorted(new.ranks) == [0]


def test_destroy_then_init_again_keeps_the_job_live() -> None:
    jobs = Jobs()
    job, st = jobs.register(identity(0, 1, session="s", launch="10.0.0.1:1"), T0)
    job.ingest("s", 0, [r.RankEnd(0, r.EndKind.DESTROYED, T0 + 1)], now=T0 + 1)
    assert jobs_mod.over(job, T0 + 1)
    job.ingest("s", 0, [group_event(0, "0", (0,), T0 + 2)], now=T0 + 2)  # init_process_group again
    assert st.end is None and not jobs_mod.over(job, T0 + 2)
    jobs.register(identity(0, 1, session="other", launch="10.0.0.2:1"), T0 + 3)  # another job begins
    assert job in list(jobs)  # not retired


def test_a_job_selector_prefers_an_exact_name() -> None:
    jobs = Jobs()
    train, _ = jobs.register(identity(0, 1, session="a", job_id="train", launch="10.0.0.1:1"), T0)
    big, _ = jobs.register(identity(0, 1, session="b", job_id="train-big", launch="10.0.0.2:1"), T0)
    assert jobs.find("train") == [train] and jobs.find("train-b") == [big]


def test_a_flight_recorder_record_read_after_a_destroy_does_not_revive_the_rank() -> None:
    """The agent's last read of an ended rank's ring ships C++-issued calls made before its end."""
    from tests.factories import call

    jobs = Jobs()
    job, st = jobs.register(identity(0, 1, session="s", launch="10.0.0.1:1"), T0)
    job.ingest("s", 0, [r.RankEnd(0, r.EndKind.DESTROYED, T0 + 5)], now=T0 + 5)
    late = call(0, 3, call_id=2**40, enter_time=T0 + 4, source="flight_recorder")
    job.ingest("s", 0, [late], now=T0 + 6)
    assert st.end is not None and jobs_mod.over(job, T0 + 6)
