"""Detector ``ends``: rank_died and early_exit from how ranks ended (exceptions, signals, clean exits).

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

from typing import Any

import pytest

from hangwatch.diagnosis.detectors import ends, frozen, mismatch, stuck
from hangwatch.flight_entries import ENTRY_CALL_IDS
from hangwatch.records import EndKind, GpuStatus, ProcState
from tests.factories import T0, SimJob, only, open_incidents


def test_early_exit_from_ends_peer_connection_closed() -> None:
    sim = SimJob(2)
    for seq in (1, 2, 3):
        sim.collective(seq, T0 + seq)
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 10, site="train.py:77 in main")
    waiting = sim.call(0, T0 + 10.5, seq=4)
    sim.exit(waiting, T0 + 11, error="RuntimeError: Connection closed by peer")
    sim.end(0, EndKind.EXCEPTION, T0 + 11.1, detail="RuntimeError: Connection closed by peer")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12)), "early_exit")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert (f.op, f.group, f.seq) == ("all_reduce", "0", 4)
    assert f.key == "early-end:session-1"
    assert "rank 1 left the training loop" in f.summary and "exited at train.py:77 in main" in f.summary
    # the engine makes one incident of it, not a rank_died for rank 0's consequent failure
    engine = sim.engine()
    engine.tick(T0 + 12)
    engine.tick(T0 + 20)
    assert [inc.kind for inc in engine.incidents.values()] == ["early_exit"]


def test_a_leaver_whose_last_flight_recorder_read_did_not_come_is_not_judged_on_cxx_calls() -> None:
    """Found under load: rank 1's agent could not read its rings within the farewell as it
    ended, so its last DDP buckets never came; rank 0's last bucket, read while under way,
    seemed unanswered and a healthy job was told an early exit. Where the leaver's last read
    was asked before its end, C++'s calls of the others prove nothing; once it comes, they do."""
    sim = SimJob(2)
    for seq in (1, 2, 3):
        sim.collective(seq, T0 + seq)
    sim.call(0, T0 + 9.5, seq=4, source="flight_recorder")  # rank 0's last bucket, seen under way
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 10)
    sim.states[1].flight_to = T0 + 9  # its reads stopped before it ended
    assert ends.detect(sim.job, sim.ctx(T0 + 12)) == []
    sim.states[1].flight_to = T0 + 10.2  # its last read came, without that bucket: it skipped it
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12)), "early_exit")
    assert (f.culprit_ranks, f.waiting_ranks, f.seq) == ([1], [0], 4)


def test_a_leaver_whose_last_read_did_not_come_is_still_judged_on_python_calls() -> None:
    sim = SimJob(2)
    for seq in (1, 2, 3):
        sim.collective(seq, T0 + seq)
    sim.call(0, T0 + 9.5, seq=4)  # a Python call: the leaver's own records tell whether it made it
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 10)
    sim.states[1].flight_to = T0 + 9
    assert only(ends.detect(sim.job, sim.ctx(T0 + 12)), "early_exit").culprit_ranks == [1]


def test_a_leaver_s_last_python_calls_pushed_out_of_its_history_by_a_late_read_still_count() -> None:
    """Found in CI (FSDP2's look-alike on a loaded machine): a rank's history keeps its last calls
    as they came, and a late Flight Recorder read of its older C++ collectives pushed its newer
    Python all_reduce out. Judged on its history, it seemed never to have reached the all_reduce
    its peer had just made, and a healthy job was told an early exit."""
    sim = SimJob(2)
    for rk in (0, 1):
        sim.exit(sim.call(rk, T0 + 9.5, seq=70), T0 + 9.6)  # the Python all_reduce, read at once
    for seq in range(1, 70):  # rank 1's C++ collectives before it, read late and all at once
        cid = ENTRY_CALL_IDS + seq
        sim.exit(sim.call(1, T0 + seq / 10, seq=seq, source="flight_recorder", call_id=cid), T0 + seq / 10 + 0.05)
    assert all(c.seq < 70 for c in sim.states[1].history["0"])  # pushed out
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 10)
    sim.states[1].flight_to = T0 + 10.1
    sim.end(0, EndKind.CLEAN_EXIT, T0 + 10.05)
    assert ends.detect(sim.job, sim.ctx(T0 + 12)) == []
    # it did leave before a call its peer made after: still told
    sim.call(0, T0 + 9.8, seq=71)
    assert only(ends.detect(sim.job, sim.ctx(T0 + 12)), "early_exit").seq == 71


def test_clean_exit_after_everything_completed_is_not_an_incident() -> None:
    sim = SimJob(2)
    for seq in (1, 2):
        sim.collective(seq, T0 + seq)
    sim.end(0, EndKind.CLEAN_EXIT, T0 + 5)
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 5.1)
    assert ends.detect(sim.job, sim.ctx(T0 + 30)) == []
    assert sim.engine().tick(T0 + 30) == []


def test_rank_died_exception_and_peer_failure_is_affected() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.end(1, EndKind.EXCEPTION, T0 + 3, detail="ValueError: bad batch", site="train.py:50 in step")
    waiting = sim.call(0, T0 + 2.5, seq=2)
    engine = sim.engine()
    sim.beat(T0 + 4, ranks=[0])
    engine.tick(T0 + 4)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 4)), "rank_died")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert "rank 1 died: it raised ValueError: bad batch at train.py:50 in step" in f.summary
    assert f.details["exit"]["kind"] == "exception"
    assert f.details["exit"]["call_site"] == "train.py:50 in step"
    # the peer fails afterwards because its connection broke: affected, not a second incident
    sim.exit(waiting, T0 + 5, error="RuntimeError: Connection reset by peer")
    sim.end(0, EndKind.EXCEPTION, T0 + 5.1, detail="RuntimeError: Connection reset by peer")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 6)), "rank_died")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert "Connection reset by peer" in f.details["affected"]["0"]
    for now in (T0 + 6, T0 + 20, T0 + 40):
        engine.tick(now)
    assert len(engine.incidents) == 1
    (inc,) = engine.incidents.values()
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks, inc.status) == ("rank_died", [1], [0], "open")


def test_rank_died_inside_a_call() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1)
    sim.call(1, T0 + 1, site="model.py:7 in forward")
    sim.end(1, EndKind.SIGNAL, T0 + 2, detail="SIGSEGV")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 3)), "rank_died")
    assert "it received SIGSEGV" in f.summary
    assert "inside" in f.summary and "all_reduce" in f.summary
    assert (f.op, f.group, f.seq) == ("all_reduce", "0", 1)


def test_rank_vanished_without_a_word() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.beat(T0 + 3)
    sim.proc(1, ProcState.DEAD, T0 + 4)
    sim.beat(T0 + 5, ranks=[0])
    f = only(ends.detect(sim.job, sim.ctx(T0 + 5)), "rank_died")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert "without a word" in f.summary
    assert f.details["exit"]["kind"] == "vanished"
    assert f.onset_time == T0 + 4  # the moment its process was seen gone (its link closed)
    # the hang it causes is the death, not a stuck collective nor a frozen rank
    sim.beat(T0 + 30, ranks=[0])
    assert stuck.detect(sim.job, sim.ctx(T0 + 30)) == []
    assert frozen.detect(sim.job, sim.ctx(T0 + 30)) == []


def test_job_stopped_by_sigterm_is_not_an_incident() -> None:
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    sim.end(0, EndKind.SIGNAL, T0 + 10, detail="SIGTERM")
    engine = sim.engine()
    sim.beat(T0 + 10.5)
    assert engine.tick(T0 + 10.5) == []  # undecided within the window
    sim.end(1, EndKind.SIGNAL, T0 + 10.8, detail="SIGTERM")
    sim.end(2, EndKind.SIGNAL, T0 + 11.5, detail="SIGINT")
    for now in (T0 + 11.6, T0 + 12.5, T0 + 30):
        sim.beat(now)
        assert ends.detect(sim.job, sim.ctx(now)) == []
        assert engine.tick(now) == []
    assert engine.incidents == {}


def test_one_rank_killed_by_sigterm_alone_is_an_incident_after_the_window() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.end(1, EndKind.SIGNAL, T0 + 10, detail="SIGTERM")
    sim.call(0, T0 + 10.2, seq=2)
    assert ends.detect(sim.job, sim.ctx(T0 + 11.9)) == []
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12.1)), "rank_died")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert "SIGTERM" in f.summary


def test_ends_after_abort_are_ignored() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.job.aborted_at = T0 + 20
    sim.end(0, EndKind.SIGNAL, T0 + 20.1, detail="SIGTERM")
    sim.end(1, EndKind.EXCEPTION, T0 + 20.2, detail="RuntimeError: aborted")
    assert ends.detect(sim.job, sim.ctx(T0 + 30)) == []
    # but an end observed before the abort is still a death
    sim.job.aborted_at = T0 + 20.15
    f = only(ends.detect(sim.job, sim.ctx(T0 + 30)), "rank_died")
    assert f.culprit_ranks == [0]


# ---- deaths told by the moment each process vanished (its link to the node agent closing) ----

SIGKILL, SIGTERM, SIGABRT = 9, 15, 6


def _gone(sim: SimJob, rank: int, t: float, **how: object) -> None:
    sim.proc(rank, ProcState.ZOMBIE, t, **how)


def test_rank_killed_alone_is_the_culprit_though_the_launcher_then_stops_the_rest() -> None:
    """Rank 2 is SIGKILLed inside a broadcast; torchrun stops the others 0.15-0.4 s later."""
    sim = SimJob(4)
    for seq in (1, 2, 3):
        sim.collective(seq, T0 + seq)
    for rk in (1, 2, 3):
        sim.call(rk, T0 + 5, op="broadcast", seq=4, root=0)
    engine = sim.engine()
    _gone(sim, 2, T0 + 10, signal=SIGKILL)
    sim.beat(T0 + 10.1, ranks=[0, 1, 3])
    assert engine.tick(T0 + 10.1) == []  # settling: a stop's other ends would be arriving now
    for rk, dt in ((0, 0.15), (1, 0.3), (3, 0.4)):
        _gone(sim, rk, T0 + 10 + dt, signal=SIGTERM)
    (inc,) = engine.tick(T0 + 10.6)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks) == ("rank_died", [2], [0, 1, 3])
    assert "rank 2 died: its process was killed by SIGKILL (signal 9) inside broadcast" in inc.summary
    assert (inc.op, inc.seq, inc.onset_time) == ("broadcast", 4, T0 + 10)
    assert inc.details["exit"]["signal"] == SIGKILL
    for now in (T0 + 12, T0 + 30):
        engine.tick(now)
    assert [i.kind for i in engine.incidents.values()] == ["rank_died"]


@pytest.mark.parametrize("order", [(2, 0, 1, 3), (0, 3, 2, 1), (1, 0, 3, 2)])
def test_a_kill_and_its_launcher_s_stops_seen_at_once_by_a_starved_agent_are_still_a_death(
    order: tuple[int, ...],
) -> None:
    """The agent's thread woke late (CI load) and saw rank 2's close and the SIGTERMs torchrun
    answered it with in one wake-up, microseconds apart and in any order: the signals tell a kill
    followed by a stop, not a job killed as a whole."""
    sim = SimJob(4)
    sim.collective(1, T0 + 1)
    for rk in (1, 2, 3):
        sim.call(rk, T0 + 5, op="broadcast", seq=2, root=0)
    for i, rk in enumerate(order):
        _gone(sim, rk, T0 + 10 + i * 0.0001, signal=SIGKILL if rk == 2 else SIGTERM)
    engine = sim.engine()
    (inc,) = engine.tick(T0 + 10.6)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks) == ("rank_died", [2], [0, 1, 3])
    assert "killed by SIGKILL (signal 9) inside broadcast" in inc.summary
    for now in (T0 + 12.5, T0 + 30):
        engine.tick(now)
    assert [i.kind for i in engine.incidents.values()] == ["rank_died"]


def test_a_job_stopped_as_a_whole_seen_at_once_is_still_no_death() -> None:
    """The contrast: the same batch, but every rank stopped by SIGTERM (one reaped before the
    agent could see how), or killed by SIGKILL, is the job stopped from outside."""
    for first, rest in ((SIGTERM, SIGTERM), (None, SIGTERM), (SIGKILL, SIGKILL), (SIGKILL, None)):
        sim = SimJob(4)
        sim.collective(1, T0 + 1)
        _gone(sim, 2, T0 + 10, signal=first)
        for rk, dt in ((0, 0.0001), (1, 0.0002), (3, 0.0003)):
            _gone(sim, rk, T0 + 10 + dt, signal=rest)
        engine = sim.engine()
        for now in (T0 + 10.6, T0 + 12.5, T0 + 30):
            assert engine.tick(now) == [], (first, rest)


GLOO_PEER_GONE = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:13034. This is typically caused by a remote worker crashing."
)


def test_a_job_stopped_rank_by_rank_is_no_death_though_one_failed_on_a_closed_connection_first() -> None:
    """Failed CI once: every rank was sent SIGTERM by a loop of ``kill``, the sender preempted
    between two of them. Rank 2 failed on the connection of a rank stopped before it, its
    exception stamped before the starved agent saw any process gone; then its own SIGTERM came."""
    sim = SimJob(4)
    sim.collective(1, T0 + 1)
    for rk in (1, 2, 3):
        sim.call(rk, T0 + 5, seq=2)
    sim.end(2, EndKind.EXCEPTION, T0 + 10, detail=GLOO_PEER_GONE, site="stopped_ranks.py:14 in <module>")
    for rk, dt in ((3, 0.05), (2, 0.058), (1, 0.058), (0, 0.076)):
        _gone(sim, rk, T0 + 10 + dt, signal=SIGTERM, exit_code=1 if rk == 2 else None)
    engine = sim.engine()
    for now in (T0 + 10.6, T0 + 12.5, T0 + 30):
        assert ends.detect(sim.job, sim.ctx(now)) == []
        assert engine.tick(now) == []


def test_the_rank_whose_going_closed_a_peer_s_connection_is_the_culprit_though_seen_later() -> None:
    """The contrast: rank 3 is SIGKILLed alone. Rank 2 fails on its closed connection and says
    so before the starved agent sees rank 3 gone; then torchrun stops the rest. Rank 3 is the
    cause, rank 2 one of those it left behind."""
    sim = SimJob(4)
    sim.collective(1, T0 + 1)
    for rk in (0, 1, 2, 3):
        sim.call(rk, T0 + 5, seq=2)
    sim.end(2, EndKind.EXCEPTION, T0 + 10, detail=GLOO_PEER_GONE, site="train.py:14 in <module>")
    _gone(sim, 3, T0 + 10.3, signal=SIGKILL)
    _gone(sim, 2, T0 + 10.32, exit_code=1)
    assert ends.detect(sim.job, sim.ctx(T0 + 10.6)) == []  # rank 2 alone yet, and settling
    for rk in (0, 1):
        _gone(sim, rk, T0 + 10.5, signal=SIGTERM)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 11)), "rank_died")
    assert (f.culprit_ranks, f.waiting_ranks) == ([3], [0, 1, 2])
    assert "rank 3 died: its process was killed by SIGKILL" in f.summary
    assert "Connection closed by peer" in f.details["affected"]["2"]


@pytest.mark.parametrize("seen", [-0.001, 0.3, 1.0])
def test_a_rank_killed_while_every_peer_failed_on_its_connection_is_the_culprit(seen: float) -> None:
    """Found by an independent review: rank 3 SIGKILLed, ranks 0-2 each raise on its closed
    connection within milliseconds and exit 1; the agent sees rank 3 gone a millisecond before
    (once silent: taken for a job killed as a whole) or up to a second after them."""
    sim = SimJob(4)
    sim.collective(1, T0 + 1)
    for rk in range(4):
        sim.call(rk, T0 + 5, seq=2)
    for rk in (0, 1, 2):
        sim.end(rk, EndKind.EXCEPTION, T0 + 10 + rk * 0.002, detail=GLOO_PEER_GONE, site="train.py:14 in <module>")
        _gone(sim, rk, T0 + 10.2 + rk * 0.002, exit_code=1)
    _gone(sim, 3, T0 + 10 + seen, signal=SIGKILL)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12.5)), "rank_died")
    assert (f.culprit_ranks, f.waiting_ranks) == ([3], [0, 1, 2])


def test_a_bystander_torchrun_stopped_after_the_failures_is_not_the_culprit() -> None:
    """Found by an independent review: rank 3's node is lost (its end never seen); ranks 0-2 fail
    on its connection and exit 1, then torchrun stops rank 4, which never talked to it. Rank 4's
    SIGTERM is the launcher's reaction, not the cause: the ranks that failed are told."""
    sim = SimJob(5)
    sim.collective(1, T0 + 1)
    for rk in (0, 1, 2):
        sim.end(rk, EndKind.EXCEPTION, T0 + 10 + rk * 0.002, detail=GLOO_PEER_GONE)
        _gone(sim, rk, T0 + 10.2, exit_code=1)
    _gone(sim, 4, T0 + 10.3, signal=SIGTERM)
    sim.beat(T0 + 12.5, ranks=[3])
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12.5)), "rank_died")
    assert 4 not in f.culprit_ranks and f.culprit_ranks[0] == 0


def test_a_connection_error_of_the_rank_s_own_is_its_fault() -> None:
    """Not a backend's word that a peer went: the rank's own socket (a data loader reading from
    object storage) reset, and torchrun stopped the rest after it. It stays the culprit."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    own = "ConnectionResetError: [Errno 104] Connection reset by peer"
    sim.end(1, EndKind.EXCEPTION, T0 + 10, detail=own, site="data.py:30 in fetch")
    _gone(sim, 1, T0 + 10.1, exit_code=1)
    for rk in (0, 2):
        _gone(sim, rk, T0 + 10.3, signal=SIGTERM)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 11)), "rank_died")
    assert (f.culprit_ranks, f.waiting_ranks) == ([1], [0, 2])
    assert "ConnectionResetError" in f.summary


def test_a_rank_left_failing_on_a_closed_connection_with_no_peer_seen_gone_is_told_after_the_window() -> None:
    """The peer that went is never seen gone (a node without an agent): the rank that failed on
    its connection is told, once the window for the peer's end has passed."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.end(1, EndKind.EXCEPTION, T0 + 10, detail=GLOO_PEER_GONE)
    assert ends.detect(sim.job, sim.ctx(T0 + 11)) == []
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12.1)), "rank_died")
    assert f.culprit_ranks == [1] and "Connection closed by peer" in f.summary


def test_rank_vanished_without_a_trace_alone_and_earlier_is_the_culprit() -> None:
    """Reaped before anyone saw how it ended: the timing alone tells it went first, alone."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    _gone(sim, 1, T0 + 10)
    _gone(sim, 0, T0 + 10.2)
    _gone(sim, 2, T0 + 10.25)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 10.6)), "rank_died")
    assert f.culprit_ranks == [1] and f.waiting_ranks == [0, 2]
    assert "without a word" in f.summary


def test_a_job_stopped_as_a_whole_is_no_death_though_one_rank_raised_on_a_closed_connection_first() -> None:
    """Failed CI once (the agent's thread late to every close, all reaped before it looked): every
    rank SIGTERMed, rank 1's all_reduce failed on rank 0's closed connection 31 ms before the
    agent saw all four processes gone at once, with no signal known for any. Ranks 2 and 3
    vanished without a word as rank 0 did: the job was stopped. The contrast: where every peer
    raised (none vanished silently besides the first), rank 0's death is told."""
    for silent_peers in (True, False):
        sim = SimJob(4)
        sim.collective(1, T0 + 1)
        for rk in (1, 2, 3):
            sim.call(rk, T0 + 5, seq=2)
        for rk in (1,) if silent_peers else (1, 2, 3):
            sim.end(rk, EndKind.EXCEPTION, T0 + 10, detail=GLOO_PEER_GONE, site="stopped_ranks.py:14 in <module>")
        for rk, dt in ((0, 0.031), (1, 0.0311), (2, 0.0311), (3, 0.0312)):
            _gone(sim, rk, T0 + 10 + dt)
        engine = sim.engine()
        told = [inc for now in (T0 + 10.6, T0 + 12.5, T0 + 30) for inc in engine.tick(now)]
        if silent_peers:
            assert told == [], told
        else:
            assert [(i.kind, i.culprit_ranks) for i in told] == [("rank_died", [0])]


def test_a_job_stopped_as_a_whole_is_no_death_though_ranks_raised_then_died_of_their_sigterm() -> None:
    """Failed ``make test`` once (``test_job_stopped_as_a_whole_raises_nothing[ranks]``, then 1 in
    10 runs under load): every rank SIGTERMed; ranks 1 and 3 raised on a closed connection and
    then died of their SIGTERM, rank 2 died of its SIGTERM, rank 0 was reaped with nothing
    known, all within 22 ms: the job was stopped. The contrast, a real death: rank 0 vanishes,
    ranks 1 and 3 raise at once, and the launcher SIGTERMs them and rank 2 a second later: rank
    0's death is told."""
    for later in (0.0, 1.0):
        sim = SimJob(4)
        sim.collective(1, T0 + 1)
        for rk in (1, 2, 3):
            sim.call(rk, T0 + 5, seq=2)
        for rk in (1, 3):
            sim.end(rk, EndKind.EXCEPTION, T0 + 10.01, detail=GLOO_PEER_GONE, site="stopped_ranks.py:14 in <module>")
        _gone(sim, 0, T0 + 10)
        for rk, dt in ((1, 0.016), (2, 0.022), (3, 0.0)):
            _gone(sim, rk, T0 + 10 + later + dt, signal=SIGTERM)
        engine = sim.engine()
        told = [inc for now in (T0 + 10.6, T0 + 12.5, T0 + 30) for inc in engine.tick(now)]
        if later:
            assert [(i.kind, i.culprit_ranks) for i in told] == [("rank_died", [0])]
        else:
            assert told == [], told


def test_a_one_rank_job_that_vanishes_is_no_death() -> None:
    """A job of one rank whose process vanished with nothing known of how (reaped before the agent
    looked): nobody waits for it, and it cannot be told from a stop."""
    sim = SimJob(1)
    sim.collective(1, T0 + 1)
    _gone(sim, 0, T0 + 10)
    engine = sim.engine()
    assert [inc for now in (T0 + 10.6, T0 + 12.5, T0 + 30) for inc in engine.tick(now)] == []


def test_job_killed_as_a_whole_is_not_a_death() -> None:
    """Every process gone within a few milliseconds (kill -9 of the job, SIGTERM to every rank):
    the job was stopped, whatever the signal."""
    for sig in (SIGKILL, SIGTERM, None):
        sim = SimJob(4)
        sim.collective(1, T0 + 1)
        for rk, dt in ((3, 0.0), (1, 0.009), (0, 0.02), (2, 0.033)):
            _gone(sim, rk, T0 + 10 + dt, signal=sig)
        engine = sim.engine()
        for now in (T0 + 10.6, T0 + 12.5, T0 + 30):
            assert ends.detect(sim.job, sim.ctx(now)) == [], sig
            assert engine.tick(now) == []


def test_stopping_a_hung_job_adds_nothing_to_its_incident() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    engine = sim.engine()
    sim.beat(T0 + 20)
    (stuck_inc,) = engine.tick(T0 + 20)
    summary = stuck_inc.summary
    _gone(sim, 1, T0 + 30, signal=SIGTERM)
    _gone(sim, 0, T0 + 30.004, signal=SIGTERM)
    for now in (T0 + 30.6, T0 + 33, T0 + 40):
        assert engine.tick(now) == []
    assert [i.kind for i in engine.incidents.values()] == ["stuck_collective"]
    assert stuck_inc.summary == summary and "aftermath" not in stuck_inc.details


def test_oom_kill_is_named_as_such() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    _gone(sim, 1, T0 + 3, signal=SIGKILL, oom_killed=True)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 4)), "rank_died")
    assert "killed by the OOM killer" in f.summary and "SIGKILL (signal 9)" in f.summary
    assert f.details["exit"]["oom_killed"] is True


def test_mismatch_that_killed_a_rank_is_one_incident_with_the_death_as_aftermath() -> None:
    """Rank 0 alone syncs a float32 metric where ranks 1 and 2 sync an int64 count; gloo aborts
    rank 0 inside it and torchrun stops the others: one incident, the mismatch."""
    sim = SimJob(3)
    for seq in (1, 2):
        for rk in range(3):
            sim.exit(sim.call(rk, T0 + seq, seq=seq, dtype="int64"), T0 + seq + 0.01)
    sim.call(0, T0 + 5, seq=3, dtype="float32")
    engine = sim.engine()
    updates: list[object] = []
    engine.update_listeners.append(updates.append)  # the webhook's "aftermath" update
    _gone(sim, 0, T0 + 5.01, signal=SIGABRT)  # the death is known before the others' records
    assert engine.tick(T0 + 5.3) == []
    for rk in (1, 2):
        sim.call(rk, T0 + 5.001, seq=3, dtype="int64")
    (inc,) = engine.tick(T0 + 5.4)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks) == ("dtype_mismatch", [0], [1, 2])
    _gone(sim, 1, T0 + 5.2, signal=SIGTERM)
    _gone(sim, 2, T0 + 5.25, signal=SIGTERM)
    for now in (T0 + 5.6, T0 + 8, T0 + 30):
        assert engine.tick(now) == []
    assert [i.kind for i in engine.incidents.values()] == ["dtype_mismatch"]
    assert updates == [inc]  # told once, about the root cause's incident
    aftermath = inc.details["aftermath"]
    assert aftermath["ranks"] == [0] and aftermath["exit"]["signal"] == SIGABRT
    assert inc.summary.endswith("; rank 0 then died: its process was killed by SIGABRT (signal 6) inside "
                                "all_reduce() [4] float32 at train.py:42 in step")  # fmt: skip
    # the mismatch detector telling its finding again keeps the aftermath in the summary
    sim.call(1, T0 + 5.001, seq=3, dtype="int64")
    mismatch.detect(sim.job, sim.ctx(T0 + 31))
    engine.tick(T0 + 31)
    assert "rank 0 then died" in inc.summary


def test_a_death_told_before_its_mismatch_was_known_is_closed_as_its_aftermath() -> None:
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 5, seq=2, shape=(10,))
    engine = sim.engine()
    _gone(sim, 0, T0 + 5.01, signal=SIGABRT)
    sim.beat(T0 + 6, ranks=[1])
    (died,) = engine.tick(T0 + 6)  # the other side's record is late (past the settling time)
    assert died.kind == "rank_died"
    sim.call(1, T0 + 5.002, seq=2, shape=(20,))
    (shape,) = engine.tick(T0 + 6.2)
    engine.tick(T0 + 6.4)
    assert shape.kind == "shape_mismatch" and "aftermath" in shape.details
    assert died.status == "resolved" and shape.id in died.resolution
    assert [i.kind for i in open_incidents(engine)] == ["shape_mismatch"]


def test_job_stopped_while_every_rank_is_inside_a_collective_is_not_a_stall() -> None:
    sim = SimJob(4)
    sim.collective(1, T0 + 1)
    for rk in range(4):
        sim.call(rk, T0 + 10, seq=2)
    for rk, dt in ((1, 0.0), (0, 0.012), (3, 0.023), (2, 0.028)):
        _gone(sim, rk, T0 + 10.01 + dt, signal=SIGTERM)
    engine = sim.engine(stuck_after=3.0)
    for now in (T0 + 10.6, T0 + 14, T0 + 30):
        assert stuck.detect(sim.job, sim.ctx(now, stuck_after=3.0)) == []
        assert engine.tick(now) == []


def _hung(n: int = 3) -> tuple[SimJob, Any]:
    """Ranks 0 and 2 wait in all_reduce seq 2; rank 1 never comes (busy saving): one stuck incident."""
    sim = SimJob(n)
    sim.collective(1, T0 + 1)
    for rk in (0, 2):
        sim.call(rk, T0 + 2, seq=2)
    engine = sim.engine()
    sim.beat(T0 + 20, where_user="train.py:90 in save_checkpoint")
    (inc,) = engine.tick(T0 + 20)
    assert inc.kind == "stuck_collective" and inc.culprit_ranks == [1]
    return sim, (engine, inc)


def test_the_watchdog_aborting_hung_ranks_is_the_hang_s_aftermath() -> None:
    """torch's NCCL watchdog times the waiting ranks out (10 min) and aborts them (SIGABRT): that
    ends the story hangwatch told minutes earlier; it is not a new root cause."""
    sim, (engine, inc) = _hung()
    gpu = GpuStatus(0, name="NVIDIA H100", utilization=100, xid=79, xid_time=T0 + 600)
    _gone(sim, 0, T0 + 602, signal=SIGABRT, gpus=(gpu,))
    sim.end(2, EndKind.EXCEPTION, T0 + 602.1, "DistBackendError: [Rank 2] Watchdog caught collective operation timeout")
    for now in (T0 + 603, T0 + 606, T0 + 640):
        sim.beat(now, ranks=[1])
        assert engine.tick(now) == []
    assert [i.kind for i in engine.incidents.values()] == ["stuck_collective"]
    aftermath = inc.details["aftermath"]
    assert aftermath["ranks"] == [0] and aftermath["exit"]["signal"] == SIGABRT
    assert "rank 0 then died: its process was killed by SIGABRT (signal 6)" in inc.summary
    assert "its GPU 0 (NVIDIA H100) reported Xid 79 at" in inc.summary


def test_a_rank_aborted_with_no_hang_diagnosed_is_its_own_incident() -> None:
    """The look-alike: the same abort, no hang open (a NCCL error out of the blue)."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    engine = sim.engine()
    _gone(sim, 0, T0 + 5, signal=SIGABRT)
    sim.beat(T0 + 8, ranks=[1, 2])
    (inc,) = engine.tick(T0 + 8)
    assert inc.kind == "rank_died" and inc.culprit_ranks == [0]


def test_a_hang_that_ended_long_ago_does_not_swallow_a_later_death() -> None:
    """Rank 1 was 40 s late to seq 2 (a stuck incident), then the job ran on: more collectives
    than the state keeps between two ticks, so the slot was pruned before a tick saw it complete.
    The incident is resolved all the same, and a death an hour later is a root cause of its own."""
    sim = SimJob(2)
    engine = sim.engine()
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.beat(T0 + 20)
    (stuck_inc,) = engine.tick(T0 + 20)
    for seq in range(2, 24):
        sim.collective(seq, T0 + 40 + seq * 0.01, ranks=[1] if seq == 2 else None, duration=0.001)
    sim.beat(T0 + 41)
    assert engine.tick(T0 + 41) == []
    assert stuck_inc.status == "resolved"
    _gone(sim, 0, T0 + 3600, signal=SIGKILL, oom_killed=True)
    sim.beat(T0 + 3602, ranks=[1])
    (died,) = engine.tick(T0 + 3602)
    assert died.kind == "rank_died" and died.culprit_ranks == [0]


def test_the_same_exception_on_two_ranks_is_one_cause_they_share() -> None:
    """A configuration error every rank hits on its own: not "rank 1 died, rank 0 then failed"."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    err = "ValueError: learning rate schedule needs warmup_steps > 0"
    sim.end(1, EndKind.EXCEPTION, T0 + 5, err, site="train.py:12 in build_scheduler")
    sim.end(0, EndKind.EXCEPTION, T0 + 5.2, err, site="train.py:12 in build_scheduler")
    sim.call(2, T0 + 5, seq=2)
    sim.beat(T0 + 8, ranks=[2])
    f = only(ends.detect(sim.job, sim.ctx(T0 + 8)), "rank_died")
    assert f.culprit_ranks == [0, 1] and f.waiting_ranks == [2]
    assert f"ranks 0, 1 each raised {err} at train.py:12 in build_scheduler" in f.summary


def test_a_different_error_after_a_death_is_still_its_consequence() -> None:
    """The look-alike: rank 1 raises; rank 0 then fails with the backend's connection error."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.end(1, EndKind.EXCEPTION, T0 + 5, "KeyError: 'label'", site="data.py:40 in __getitem__")
    sim.end(0, EndKind.EXCEPTION, T0 + 5.3, "DistBackendError: Connection closed by peer", site="train.py:50 in step")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 8)), "rank_died")
    assert f.culprit_ranks == [1] and "then failed or wait for it" in f.summary


def test_a_rank_that_sent_its_last_message_and_left_is_not_an_early_exit() -> None:
    """A pipeline's last stage: rank 0 sends its last activation to rank 1 and destroys its
    group; rank 1's recv has not been reported complete yet. A correct program: nothing."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    for i in range(1, 4):
        sim.exit(sim.call(0, T0 + 1 + i, op="send", seq=i, peer=1), T0 + 1.01 + i)
        recv = sim.call(1, T0 + 1 + i, op="recv", seq=i, peer=0)
        if i < 3:
            sim.exit(recv, T0 + 1.02 + i)
    sim.end(0, EndKind.DESTROYED, T0 + 4.1)
    for now in (T0 + 4.2, T0 + 6, T0 + 20):
        assert ends.detect(sim.job, sim.ctx(now)) == []


def test_a_rank_that_left_without_sending_what_its_peer_waits_for_is_an_early_exit() -> None:
    """The look-alike: rank 0 leaves before its third send; rank 1 waits in that recv."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    for i in range(1, 3):
        sim.exit(sim.call(0, T0 + 1 + i, op="send", seq=i, peer=1), T0 + 1.01 + i)
        sim.exit(sim.call(1, T0 + 1 + i, op="recv", seq=i, peer=0), T0 + 1.02 + i)
    sim.call(1, T0 + 4, op="recv", seq=3, peer=0)
    sim.end(0, EndKind.DESTROYED, T0 + 4.1)
    f = only(ends.detect(sim.job, sim.ctx(T0 + 5)), "early_exit")
    assert f.culprit_ranks == [0] and f.waiting_ranks == [1] and f.op == "recv"


def _on_nodes(sim: SimJob, hosts: dict[int, str]) -> None:
    import dataclasses

    for rank, host in hosts.items():
        st = sim.job.ranks[rank]
        st.identity = dataclasses.replace(st.identity, host=host)


def test_a_node_stopped_from_outside_is_one_incident_naming_the_node() -> None:
    """Issue 38: two launchers of two ranks each; node B's launcher gets SIGTERM (a spot reclaim,
    a drain) and stops ranks 2 and 3; ranks 0 and 1 then fail on the closed connections. Told as
    node B stopped from outside, not as rank 2 dying with 0, 1, 3 its aftermath."""
    sim = SimJob(4)
    _on_nodes(sim, {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"})
    sim.collective(1, T0 + 1)
    sim.end(2, EndKind.SIGNAL, T0 + 10, detail="SIGTERM")
    sim.end(3, EndKind.SIGNAL, T0 + 10.1, detail="SIGTERM")
    for rank in (0, 1):
        sim.end(rank, EndKind.EXCEPTION, T0 + 10.4, detail="RuntimeError: Connection closed by peer")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 13)), "rank_died")
    assert (f.culprit_ranks, f.waiting_ranks) == ([2, 3], [0, 1])
    assert f.summary == (
        "node nodeB was stopped from outside: its ranks 2, 3 got SIGTERM together while the other nodes' ranks "
        "ran on; ranks 0, 1 then failed or wait for them"
    )


def test_a_node_stopped_whose_peers_failures_were_seen_first_is_still_the_node() -> None:
    """The same, the other nodes' failures on the closed connections seen before the stopped
    ranks' ends (an agent starved of CPU wakes to them in no reliable order)."""
    sim = SimJob(4)
    _on_nodes(sim, {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"})
    sim.collective(1, T0 + 1)
    for rank in (0, 1):
        sim.end(rank, EndKind.EXCEPTION, T0 + 10, detail="RuntimeError: Connection closed by peer")
    sim.end(2, EndKind.SIGNAL, T0 + 10.2, detail="SIGTERM")
    sim.end(3, EndKind.SIGNAL, T0 + 10.3, detail="SIGTERM")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 13)), "rank_died")
    assert (f.culprit_ranks, f.waiting_ranks) == ([2, 3], [0, 1]), f.summary
    assert f.summary.startswith("node nodeB was stopped from outside"), f.summary


def test_a_node_stopped_whose_other_rank_was_reaped_unseen_is_still_the_node() -> None:
    """Found under load: node B's rank 3 seen killed by SIGTERM, its rank 2 reaped before the
    starved agent read how it ended (no word, no signal). Both are the node's."""
    sim = SimJob(4)
    _on_nodes(sim, {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"})
    sim.collective(1, T0 + 1)
    sim.end(3, EndKind.SIGNAL, T0 + 10, detail="SIGTERM")
    sim.proc(2, ProcState.DEAD, T0 + 10.05)
    for rank in (0, 1):
        sim.end(rank, EndKind.EXCEPTION, T0 + 10.4, detail="RuntimeError: Connection closed by peer")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 13)), "rank_died")
    assert (f.culprit_ranks, f.waiting_ranks) == ([2, 3], [0, 1]), f.summary


def test_both_nodes_stopped_at_once_raise_nothing_and_one_rank_of_a_node_stopped_is_that_rank() -> None:
    """The look-alikes: the whole job cancelled (both launchers SIGTERMed) raises nothing; one
    rank of a node stopped while its node-mate runs on is that rank's death, not the node's."""
    sim = SimJob(4)
    _on_nodes(sim, {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"})
    sim.collective(1, T0 + 1)
    for rank in range(4):
        sim.end(rank, EndKind.SIGNAL, T0 + 10 + 0.1 * rank, detail="SIGTERM")
    assert ends.detect(sim.job, sim.ctx(T0 + 13)) == []
    sim = SimJob(4)
    _on_nodes(sim, {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"})
    sim.collective(1, T0 + 1)
    sim.end(2, EndKind.SIGNAL, T0 + 10, detail="SIGTERM")
    for rank in (0, 1, 3):
        sim.end(rank, EndKind.EXCEPTION, T0 + 10.4, detail="RuntimeError: Connection closed by peer")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 13)), "rank_died")
    assert f.culprit_ranks == [2] and f.summary.startswith("rank 2 died"), f.summary
