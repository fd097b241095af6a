"""Runs of a job on one coordinator: a rerun, the next job, a restart by the launcher.

Every run of a job gets a state of its own and incident keys of its own: the same hang in a
rerun is reported again, and nothing of one run (its ranks, world size, groups, thresholds) leaks
into the next. The real ``JobState`` and ``Engine``, explicit clock (``tests.factories``).
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.coordinator import views
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
    assert sim.job.runs == 2


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
    assert sim.job.runs == 2 and sim.job.attempt == 1
    _hang(sim, T0 + 26)
    (again,) = engine.tick(T0 + 46)
    assert again.id != first.id


def test_a_rank_restarted_alone_in_a_live_run_stays_in_it() -> None:
    """The look-alike: one rank re-registers (a new session, same launch and attempt) while the
    others run: the same run goes on."""
    sim = SimJob(2)
    run = sim.job.run
    sim.register(1, T0 + 5, identity(1, 2, session="restarted-1"))
    assert sim.job.run == run and sim.job.runs == 1


def test_another_launch_waits_for_the_current_run_to_fall_silent() -> None:
    """A second job (another rendezvous endpoint) starting while the first still reports does not
    wipe the first; one that starts once the first has been silent for a while is a new run."""
    sim = SimJob(0, register_all=False)
    sim.world = 2
    for rk in range(2):
        sim.register(rk, T0, identity(rk, 2, session=f"a{rk}", launch="10.0.0.1:29500"))
    run = sim.job.run
    sim.register(0, T0 + 1, identity(0, 2, session="b0", launch="10.0.0.2:29500"))
    assert sim.job.run == run
    sim.register(1, T0 + 60, identity(1, 2, session="b1", launch="10.0.0.2:29500"))
    assert sim.job.run != run


def test_a_rank_registering_after_the_first_has_already_ended_joins_its_run() -> None:
    """Ranks register at their own pace: gloo's root of a broadcast can finish, and exit, before
    its peer's registration reaches the coordinator. That peer is the same run, not the next."""
    sim = SimJob(0, register_all=False)
    sim.world = 2
    sim.register(0, T0, identity(0, 2, session="s0"))
    sim.end(0, r.EndKind.CLEAN_EXIT, T0 + 0.1)
    run = sim.job.run
    sim.register(1, T0 + 0.2, identity(1, 2, session="s1"))
    assert sim.job.run == run and sorted(sim.job.ranks) == [0, 1]
