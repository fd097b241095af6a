"""A rank is bound to its first registrant: what a registration may claim of a job's run.

The real ``JobState``, explicit clock; ``identity`` builds the claims as a client (honest or not)
would send them."""

from __future__ import annotations

import dataclasses

import pytest

from hangwatch import records as r
from hangwatch.diagnosis.state import ClaimRefused, JobState
from tests.factories import T0, identity


def _job(world: int = 2, via: str = "direct") -> JobState:
    job = JobState()
    for rk in range(world):
        job.register(identity(rk, world, session=f"s{rk}"), T0, via)
    return job


def test_a_second_process_claiming_a_live_rank_is_refused_and_shown() -> None:
    job = _job()
    with pytest.raises(ClaimRefused, match="claims rank 1, held by pid 4001"):
        job.register(identity(1, 2, session="impostor", pid=666), T0 + 1)
    assert job.ranks[1].identity.session == "s1" and "impostor" not in job.sessions
    (conflict,) = job.conflicts
    assert (conflict["rank"], conflict["pid"]) == (1, 666) and str(conflict["what"]).startswith("refused")


def test_a_rank_whose_process_is_gone_or_silent_can_be_claimed_again() -> None:
    job = _job()
    job.ranks[1].proc = r.ProcessStatus(4001, r.ProcState.DEAD, T0 + 1)
    job.register(identity(1, 2, session="restarted", pid=5001), T0 + 2)  # its process restarted alone
    assert job.ranks[1].identity.pid == 5001
    job.register(identity(0, 2, session="later", pid=5000), T0 + 60)  # rank 0 silent for a minute
    assert job.ranks[0].identity.pid == 5000 and not job.conflicts


def test_a_process_an_agent_proved_takes_the_rank_from_an_unproven_claim() -> None:
    """An impostor registered first, over the network; the real rank links to its node's agent."""
    job = JobState()
    job.register(identity(0, 2, session="impostor", pid=666), T0)
    job.register(identity(0, 2, session="real"), T0 + 0.5, via="agent")
    assert job.ranks[0].identity.session == "real" and job.ranks[0].via == "agent"
    assert "took rank 0 from an unproven claim" in str(job.conflicts[-1]["what"])
    with pytest.raises(ClaimRefused):  # and an unproven claim cannot take it back
        job.register(identity(0, 2, session="impostor-2", pid=667), T0 + 1)


def test_world_size_and_attempt_come_from_the_run_not_from_one_registration() -> None:
    job = _job()
    with pytest.raises(ClaimRefused, match="world size 1048576"):
        job.register(identity(5, 1048576, session="huge"), T0 + 1)
    assert job.world_size == 2 and sorted(job.ranks) == [0, 1]
    restarted = _job(via="agent")
    restarted.register(identity(0, 2, session="a1", attempt=1), T0 + 1, via="agent")  # torchrun restarted it
    assert restarted.attempt == 1
    with pytest.raises(ClaimRefused, match="attempt 0"):  # a straggler of the old attempt
        restarted.register(identity(1, 2, session="old"), T0 + 2, via="agent")


def test_an_unproven_claim_of_a_new_attempt_does_not_end_a_run_of_proven_ranks() -> None:
    job = _job(via="agent")
    run = job.incarnation
    for rank in (0, 1):
        with pytest.raises(ClaimRefused, match="attempt 9"):
            job.register(identity(rank, 2, session=f"x{rank}", pid=666, attempt=9), T0 + 1)
    assert job.incarnation == run and job.ranks[0].identity.session == "s0"


def test_the_same_process_registering_a_new_session_keeps_its_rank() -> None:
    """destroy_process_group() then init_process_group() again: a new session, the same process."""
    job = _job()
    job.register(identity(1, 2, session="again"), T0 + 1)
    assert job.ranks[1].identity.session == "again" and not job.conflicts


def test_a_batch_sent_again_is_counted_once() -> None:
    from tests.factories import call

    job = _job()
    batch = [call(0, seq, call_id=seq) for seq in (1, 2, 3)]
    for _ in range(2):  # its reply was lost: the rank sends it again
        job.ingest("s0", 0, [dataclasses.replace(c) for c in batch], now=T0 + 1)
    assert (job.records_received, job.duplicates) == (3, 3)


def test_a_session_s_claim_is_replaced_by_the_process_its_agent_proved() -> None:
    """The attack: a direct claim names another job's proven process (pid and start time are in
    /proc), then the attacker links to the agent itself with the same session. The rank is
    proven as the process of that link, never as the process the claim named."""
    job = JobState()
    job.register(identity(0, 2, session="S", pid=4242, start_time=100.0), T0)  # the victim's pid
    proven = job.register(identity(0, 2, session="S", pid=777, start_time=900.0), T0 + 0.5, via="agent")
    assert proven.proven and (proven.identity.pid, proven.identity.start_time) == (777, 900.0)
    assert job.ranks[0].target().pid == 777
    assert "proved pid 777, not pid 4242 it claimed" in str(job.conflicts[-1]["what"])


def test_the_same_session_shipped_by_itself_then_by_its_agent_is_one_rank() -> None:
    """A rank shipped its own records while its agent was away, then linked again: the agent's
    proof makes it proven, and nothing is said (a pid seen inside a container is not the
    agent's)."""
    job = JobState()
    inside = dataclasses.replace(identity(0, 1, session="S", pid=12, start_time=100.0), pid_namespace="pid:[4026]")
    job.register(inside, T0)
    job.register(identity(0, 1, session="S", pid=31337, start_time=100.2), T0 + 1, via="agent")
    assert job.ranks[0].proven and job.ranks[0].identity.pid == 31337 and not job.conflicts
    job.register(inside, T0 + 2)  # its agent gone again: it ships itself; the proof stands
    assert job.ranks[0].proven and job.ranks[0].identity.pid == 31337


def test_a_direct_claim_never_displaces_a_proven_rank_even_naming_its_own_process() -> None:
    """pid and start time are public: a claim naming them is not "the same process"."""
    job = _job(via="agent")
    for n in range(3):
        with pytest.raises(ClaimRefused, match="which its node's agent proved"):
            job.register(identity(1, 2, session=f"twin{n}"), T0 + 1 + n)
    assert job.ranks[1].identity.session == "s1" and job.ranks[1].proven
    job.register(identity(1, 2, session="again"), T0 + 5, via="agent")  # its own new session, proven
    assert job.ranks[1].identity.session == "again"


def test_unproven_claims_never_shape_a_job_that_proven_ranks_join() -> None:
    """A squatter registers the job's key first with world size 1; the real ranks, proven by
    their agent, are not refused for it: the claims are set aside."""
    job = JobState()
    job.register(identity(0, 1, session="squat", pid=666, launch="127.0.0.1:29500"), T0)
    run = job.incarnation
    for rk in range(4):
        job.register(identity(rk, 4, session=f"real{rk}", launch="127.0.0.1:29500"), T0 + 1, via="agent")
    assert job.world_size == 4 and sorted(job.ranks) == [0, 1, 2, 3] and job.incarnation != run
    assert all(st.proven for st in job.ranks.values()) and "squat" not in job.sessions
    assert "set aside 1 unproven claim" in str(job.conflicts[0]["what"])
    with pytest.raises(ClaimRefused, match="world size 1"):  # and the squatter cannot come back
        job.register(identity(0, 1, session="squat2", pid=666, launch="127.0.0.1:29500"), T0 + 2)
    # a job of claims alone (no agent anywhere) keeps the first claims' shape, as before
    unproven = _job()
    with pytest.raises(ClaimRefused, match="world size 5"):
        unproven.register(identity(2, 5, session="other"), T0 + 1)


def test_a_proven_job_is_not_refused_for_jobs_of_claims_alone() -> None:
    from hangwatch.diagnosis.jobs import MAX_JOBS, Jobs, JobsFull

    jobs = Jobs()
    for n in range(MAX_JOBS):
        jobs.register(identity(0, 2, session=f"q{n}", job_id=f"squat{n}"), T0)
    with pytest.raises(JobsFull):
        jobs.register(identity(0, 2, session="late", job_id="late"), T0 + 1)
    _, state = jobs.register(identity(0, 2, session="real", job_id="real"), T0 + 1, via="agent")
    assert state.proven and "squat0" not in {j.job_id for j in jobs.by_key.values()}
