"""Detector ``ends``: rank_died and early_exit from how ranks ended (exceptions, signals, clean exits).

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

from hangwatch.coordinator.detectors import ends, frozen, stuck
from hangwatch.records import (
    EndKind,
    ProcState,
)
from tests.factories import T0, SimJob, only


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
    assert f.onset_time == T0 + 3  # last heard
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
