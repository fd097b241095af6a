"""Detectors and the engine on constructed record sequences: no processes, no gRPC, explicit clock.

``Sim`` registers N ranks into a ``JobState`` and applies events with the times the test gives,
so every test controls ``now`` (``Context(now=...)``, ``Engine.tick(now)``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

from hangwatch import config
from hangwatch.coordinator.detectors import Context, ends, frozen, mismatch, p2p, straggler, stuck
from hangwatch.coordinator.engine import Engine
from hangwatch.coordinator.incidents import Finding, Incident
from hangwatch.coordinator.state import JobState, RankState
from hangwatch.records import (
    CallExit,
    CallRecord,
    EndKind,
    Frame,
    GroupEvent,
    GroupEventKind,
    GroupInfo,
    ProcessStatus,
    ProcState,
    RankEnd,
    RankIdentity,
    StackDump,
    StepEvent,
    Target,
    TensorMeta,
    ThreadStack,
)

T0 = 1_000.0
F32 = "float32"
F64 = "float64"
SITE = "train.py:42 in step"


class Sim:
    """A job of ``n`` ranks registered at ``T0``; every event is applied at the time it names."""

    def __init__(self, n: int) -> None:
        self.job = JobState()
        self.ids = itertools.count(1)
        self.states: dict[int, RankState] = {}
        for rk in range(n):
            identity = RankIdentity(
                job_id="job",
                rank=rk,
                world_size=n,
                host=f"node{rk // 8}",
                pid=4000 + rk,
                start_time=500.0 + rk,
                session=f"session-{rk}",
            )
            self.states[rk] = self.job.register(identity, T0)

    def call(
        self,
        rank: int,
        t: float,
        op: str = "all_reduce",
        seq: int = 1,
        *,
        group: str = "0",
        shape: tuple[int, ...] | None = (4,),
        dtype: str = F32,
        reduce_op: str | None = None,
        peer: int | None = None,
        source: str = "python",
        site: str = SITE,
        exit_time: float | None = None,
    ) -> CallRecord:
        inputs = (TensorMeta(shape, dtype),) if shape is not None else ()
        record = CallRecord(
            rank=rank,
            call_id=next(self.ids),
            op=op,
            group=group,
            seq=seq,
            inputs=inputs,
            reduce_op=reduce_op,
            peer=peer,
            call_site=site,
            enter_time=t,
            exit_time=exit_time,
            source=source,
        )
        self.job.apply(self.states[rank], record, t)
        return record

    def exit(self, call: CallRecord, t: float, error: str | None = None) -> None:
        self.job.apply(self.states[call.rank], CallExit(call.rank, call.call_id, t, error), t)

    def collective(self, seq: int, t: float, ranks: list[int] | None = None, duration: float = 0.1) -> None:
        """A collective every listed rank enters at ``t`` and leaves ``duration`` later."""
        for rk in ranks if ranks is not None else list(self.states):
            self.exit(self.call(rk, t, seq=seq), t + duration)

    def end(self, rank: int, kind: EndKind, t: float, detail: str = "", site: str = "") -> None:
        self.job.apply(self.states[rank], RankEnd(rank, kind, t, detail=detail, call_site=site), t)

    def beat(self, t: float, ranks: list[int] | None = None, where_user: str | None = None) -> None:
        """Heartbeats received at ``t`` (what the servicer records for a report batch)."""
        for rk in ranks if ranks is not None else list(self.states):
            st = self.states[rk]
            st.last_seen = t
            st.last_sent = max(st.last_sent, t)
            if where_user is not None:
                st.where_user = where_user

    def proc(self, rank: int, state: ProcState, t: float) -> None:
        self.states[rank].proc = ProcessStatus(pid=4000 + rank, state=state, time=t)

    def ctx(self, now: float, stuck_after: float = 10.0, silence_after: float = 5.0) -> Context:
        return Context(now=now, stuck_after=stuck_after, silence_after=silence_after)

    def engine(self, **kwargs: object) -> Engine:
        kwargs.setdefault("stuck_after", 10.0)
        return Engine(self.job, threading.RLock(), **kwargs)  # type: ignore[arg-type]


def only(findings: list[Finding], kind: str | None = None) -> Finding:
    assert len(findings) == 1, [f.summary for f in findings]
    if kind is not None:
        assert findings[0].kind == kind, findings[0].summary
    return findings[0]


def open_incidents(engine: Engine) -> list[Incident]:
    return [inc for inc in engine.incidents.values() if inc.status == "open"]


# ---- stuck_collective ---------------------------------------------------------------------------


def test_stuck_two_ranks_not_before_threshold() -> None:
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.beat(T0 + 11.9, where_user="train.py:88 in save_checkpoint")
    assert stuck.detect(sim.job, sim.ctx(T0 + 11.9)) == []
    sim.beat(T0 + 12.5)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert (f.op, f.group, f.seq, f.key) == ("all_reduce", "0", 2, "stuck:0:2")
    assert "is busy in train.py:88 in save_checkpoint" in f.details["absent"]["1"]
    assert "rank 1 is busy in train.py:88 in save_checkpoint" in f.summary
    assert f.stack_ranks == [1, 0]


def test_absent_rank_is_not_blamed_on_news_older_than_the_slot() -> None:
    """At scale a rank's batches arrive up to seconds after they leave it. Rank 1's latest batch
    arrived recently but was sent before rank 0 entered: its absence is not known yet. Once a
    batch sent after that arrives without the call, it is."""
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    st = sim.states[1]
    st.last_seen, st.last_sent = T0 + 12, T0 + 1.9  # delivered late, written before rank 0 entered
    sim.states[0].last_seen = sim.states[0].last_sent = T0 + 12
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []
    sim.beat(T0 + 12.6)
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.6)), "stuck_collective").culprit_ranks == [1]


def test_absent_rank_gets_a_flight_recorder_read_before_blame() -> None:
    """A collective issued from C++ (DDP) is reported after the rank's next Flight Recorder read:
    a batch sent just after the others entered does not prove the absent rank skipped it."""
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2, source="flight_recorder")
    sim.states[0].last_seen = sim.states[0].last_sent = T0 + 12
    st = sim.states[1]
    st.last_seen, st.last_sent = T0 + 12, T0 + 2 + config.FR_POLL_INTERVAL_S / 2
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []
    st.last_sent = T0 + 2 + config.FR_POLL_INTERVAL_S + 0.1
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective").culprit_ranks == [1]


def test_stuck_eight_ranks_one_absent() -> None:
    sim = Sim(8)
    for seq in range(1, 4):
        sim.collective(seq, T0 + seq)
    for rk in range(8):
        if rk != 5:
            sim.call(rk, T0 + 5 + rk * 0.01, seq=4)
    sim.beat(T0 + 20)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 20)), "stuck_collective")
    assert f.culprit_ranks == [5]
    assert f.waiting_ranks == [0, 1, 2, 3, 4, 6, 7]
    assert f.seq == 4
    assert f.details["absent"]["5"] == "is outside any collective"


def test_stuck_absent_rank_waiting_elsewhere_is_described() -> None:
    sim = Sim(2)
    sim.call(0, T0 + 1, seq=1)
    sim.call(1, T0 + 1, op="recv", peer=0, site="eval.py:9 in evaluate")
    sim.beat(T0 + 15)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 15)), "stuck_collective")
    assert f.culprit_ranks == [1]
    assert "is waiting in recv (group 0, seq 1) at eval.py:9 in evaluate for 14 s" in f.details["absent"]["1"]


def test_no_transport_stall_claimed_for_a_group_of_unknown_members() -> None:
    sim = Sim(2)
    sim.call(0, T0 + 1, group="7")
    sim.call(1, T0 + 1, group="7")
    sim.beat(T0 + 30)
    assert [f.kind for f in stuck.detect(sim.job, sim.ctx(T0 + 30))] == []


def test_stuck_64_ranks_is_one_incident() -> None:
    sim = Sim(64)
    sim.collective(1, T0 + 1)
    for rk in range(1, 64):
        sim.call(rk, T0 + 2, seq=2)
    engine = sim.engine()
    for now in (T0 + 5, T0 + 13, T0 + 14, T0 + 20):
        sim.beat(now, where_user="train.py:120 in log_metrics")
        engine.tick(now)
    assert len(engine.incidents) == 1
    (inc,) = engine.incidents.values()
    assert inc.kind == "stuck_collective"
    assert inc.culprit_ranks == [0]
    assert inc.waiting_ranks == list(range(1, 64))
    assert "ranks 1-63 wait" in inc.summary
    assert "rank 0 is busy in train.py:120 in log_metrics" in inc.summary


def test_stuck_unregistered_rank() -> None:
    sim = Sim(2)
    sim.job.world_size = 3  # rank 2 never registered
    sim.call(0, T0 + 1)
    sim.call(1, T0 + 1)
    sim.beat(T0 + 12)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 12)), "stuck_collective")
    assert f.culprit_ranks == [2]
    assert "never registered" in f.summary


# ---- early_exit ---------------------------------------------------------------------------------


def test_early_exit_absent_rank_exited_cleanly() -> None:
    for kind, action in ((EndKind.CLEAN_EXIT, "has exited its script"), (EndKind.DESTROYED, "destroy_process_group")):
        sim = Sim(3)
        sim.collective(1, T0 + 1)
        sim.end(2, kind, T0 + 2, site="train.py:99 in main")
        sim.call(0, T0 + 2.5, seq=2)
        sim.call(1, T0 + 2.5, seq=2)
        sim.beat(T0 + 15, ranks=[0, 1])
        f = only(stuck.detect(sim.job, sim.ctx(T0 + 15)), "early_exit")
        assert f.culprit_ranks == [2]
        assert f.waiting_ranks == [0, 1]
        assert (f.op, f.seq, f.key) == ("all_reduce", 2, "early:0:2")
        assert action in f.details["absent"]["2"]
        assert "train.py:99 in main" in f.details["absent"]["2"]


def test_early_exit_from_ends_peer_connection_closed() -> None:
    sim = Sim(2)
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
    sim = Sim(2)
    for seq in (1, 2):
        sim.collective(seq, T0 + seq)
    sim.end(0, EndKind.CLEAN_EXIT, T0 + 5)
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 5.1)
    assert ends.detect(sim.job, sim.ctx(T0 + 30)) == []
    assert sim.engine().tick(T0 + 30) == []


def test_early_exit_final_barrier_in_mismatch() -> None:
    sim = Sim(2)
    for seq in range(1, 5):
        sim.collective(seq, T0 + seq)
    sim.call(0, T0 + 6, op="barrier", seq=5, shape=None, site="train.py:130 in main")
    sim.call(1, T0 + 6.2, seq=5)
    f = only(mismatch.detect(sim.job, sim.ctx(T0 + 6.3)), "early_exit")
    assert f.culprit_ranks == [0]
    assert f.waiting_ranks == [1]
    assert (f.op, f.seq, f.key) == ("all_reduce", 5, "mismatch:0:5")
    assert "final barrier" in f.summary


# ---- transport_stall ----------------------------------------------------------------------------


def _all_entered(sources: tuple[str, str] = ("python", "python")) -> Sim:
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    for rk, source in enumerate(sources):
        sim.call(rk, T0 + 2, seq=2, source=source)
    return sim


def test_transport_stall() -> None:
    sim = _all_entered()
    sim.beat(T0 + 11)
    assert stuck.detect(sim.job, sim.ctx(T0 + 11)) == []
    sim.beat(T0 + 13)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 13)), "transport_stall")
    assert f.culprit_ranks == []
    assert f.waiting_ranks == [0, 1]
    assert f.native is True
    assert f.key == "stall:0:2"


def test_no_transport_stall_with_flight_recorder_calls() -> None:
    sim = _all_entered(("python", "flight_recorder"))
    sim.beat(T0 + 30)
    assert stuck.detect(sim.job, sim.ctx(T0 + 30)) == []


def test_no_transport_stall_when_one_returned() -> None:
    sim = _all_entered()
    sim.exit(sim.states[0].open_calls[next(iter(sim.states[0].open_calls))], T0 + 3)
    sim.beat(T0 + 30)
    assert stuck.detect(sim.job, sim.ctx(T0 + 30)) == []


# ---- rank_died ----------------------------------------------------------------------------------


def test_rank_died_exception_and_peer_failure_is_affected() -> None:
    sim = Sim(2)
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
    sim = Sim(2)
    sim.call(0, T0 + 1)
    sim.call(1, T0 + 1, site="model.py:7 in forward")
    sim.end(1, EndKind.SIGNAL, T0 + 2, detail="SIGSEGV")
    f = only(ends.detect(sim.job, sim.ctx(T0 + 3)), "rank_died")
    assert "it received SIGSEGV" in f.summary
    assert "inside" in f.summary and "all_reduce" in f.summary
    assert (f.op, f.group, f.seq) == ("all_reduce", "0", 1)


def test_rank_vanished_without_a_word() -> None:
    sim = Sim(2)
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
    sim = Sim(3)
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
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    sim.end(1, EndKind.SIGNAL, T0 + 10, detail="SIGTERM")
    sim.call(0, T0 + 10.2, seq=2)
    assert ends.detect(sim.job, sim.ctx(T0 + 11.9)) == []
    f = only(ends.detect(sim.job, sim.ctx(T0 + 12.1)), "rank_died")
    assert f.culprit_ranks == [1]
    assert f.waiting_ranks == [0]
    assert "SIGTERM" in f.summary


def test_ends_after_abort_are_ignored() -> None:
    sim = Sim(2)
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


# ---- rank_frozen --------------------------------------------------------------------------------


def test_rank_frozen_stopped_or_sleeping() -> None:
    for state, text in ((ProcState.STOPPED, "is stopped"), (ProcState.SLEEPING, "holding the interpreter")):
        sim = Sim(2)
        sim.collective(1, T0 + 1)
        sim.call(0, T0 + 2, seq=2)
        sim.beat(T0 + 2)
        sim.proc(1, state, T0 + 9)
        sim.beat(T0 + 9, ranks=[0])
        f = only(frozen.detect(sim.job, sim.ctx(T0 + 9)), "rank_frozen")
        assert f.culprit_ranks == [1]
        assert f.waiting_ranks == [0]
        assert f.native is True
        assert f.stack_ranks == [1]
        assert text in f.summary
        assert f.details["process"] == state.value
        # a rank silent but not yet for silence_after is not frozen
        assert frozen.detect(sim.job, sim.ctx(T0 + 6.5)) == []
        # and the hang is left to the frozen detector, not blamed as a stuck collective
        assert stuck.detect(sim.job, sim.ctx(T0 + 20)) == []


def test_not_frozen_with_fresh_heartbeats() -> None:
    sim = Sim(2)
    sim.proc(1, ProcState.STOPPED, T0 + 9)
    sim.beat(T0 + 9)
    assert frozen.detect(sim.job, sim.ctx(T0 + 9.5)) == []


def test_frozen_resolved_when_heartbeats_resume() -> None:
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    sim.proc(1, ProcState.STOPPED, T0 + 8)
    engine = sim.engine()
    sim.beat(T0 + 9, ranks=[0])
    (inc,) = engine.tick(T0 + 9)
    assert (inc.kind, inc.culprit_ranks, inc.status) == ("rank_frozen", [1], "open")
    sim.beat(T0 + 10, ranks=[0])
    assert engine.tick(T0 + 10) == []
    assert inc.status == "open"
    sim.proc(1, ProcState.RUNNING, T0 + 11)
    sim.beat(T0 + 11)
    assert engine.tick(T0 + 11) == []
    assert inc.status == "resolved"
    assert inc.resolution == "the rank's heartbeats resumed"
    assert inc.resolved_time == T0 + 11


# ---- straggler ----------------------------------------------------------------------------------


def _arrivals(last_of: Callable[[int], int], n: int = 4, slots: int = 20, lag: float = 1.0) -> Sim:
    sim = Sim(n)
    for seq in range(1, slots + 1):
        t = T0 + seq * 5
        late = last_of(seq)
        for rk in range(n):
            sim.call(rk, t + (lag if rk == late else 0.01 * rk), seq=seq)
        for rk in range(n):
            sim.exit(sim.states[rk].open_calls[max(sim.states[rk].open_calls)], t + lag + 0.1)
    return sim


def test_straggler_warning() -> None:
    sim = _arrivals(lambda seq: 2 if seq % 10 else 1)  # rank 2 last in 18 of 20
    f = only(straggler.detect(sim.job, sim.ctx(T0 + 200)), "straggler")
    assert f.culprit_ranks == [2]
    assert f.waiting_ranks == [0, 1, 3]
    assert f.details["share_last"] == 0.9
    engine = sim.engine()
    sim.beat(T0 + 200)
    (inc,) = engine.tick(T0 + 200)
    assert (inc.kind, inc.severity, inc.culprit_ranks) == ("straggler", "warning", [2])
    assert engine.tick(T0 + 201) == []


def test_straggler_needs_a_full_window_and_margin() -> None:
    assert straggler.detect(_arrivals(lambda seq: 2, slots=19).job, Context(T0 + 200, 10.0, 5.0)) == []
    assert straggler.detect(_arrivals(lambda seq: 2, lag=0.3).job, Context(T0 + 200, 10.0, 5.0)) == []


def test_no_straggler_when_last_arrivals_rotate() -> None:
    sim = _arrivals(lambda seq: seq % 4)
    assert straggler.detect(sim.job, sim.ctx(T0 + 200)) == []


# ---- mismatch -----------------------------------------------------------------------------------


def test_mismatch_kinds() -> None:
    cases: list[tuple[str, dict[str, object]]] = [
        ("op_mismatch", {"op": "broadcast"}),
        ("shape_mismatch", {"shape": (8,)}),
        ("dtype_mismatch", {"dtype": F64}),
        ("arg_mismatch", {"reduce_op": "max"}),
    ]
    for kind, odd in cases:
        sim = Sim(2)
        sim.collective(1, T0 + 1)
        sim.call(0, T0 + 2, seq=2, reduce_op="sum")
        args: dict[str, object] = {"reduce_op": "sum", **odd}
        sim.call(1, T0 + 2.1, seq=2, **args)  # type: ignore[arg-type]
        f = only(mismatch.detect(sim.job, sim.ctx(T0 + 2.2)), kind)
        assert f.culprit_ranks == [1], kind
        assert f.waiting_ranks == [0], kind
        assert (f.group, f.seq, f.key) == ("0", 2, "mismatch:0:2")
        # checked once per slot: nothing new, nothing reported again
        assert mismatch.detect(sim.job, sim.ctx(T0 + 3)) == []


def test_mismatch_third_rank_updates_not_duplicates() -> None:
    sim = Sim(3)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.call(1, T0 + 2.1, seq=2, shape=(8,))
    persisted: list[str] = []
    engine = sim.engine(persist=lambda inc: persisted.append(inc.status))
    sim.beat(T0 + 2.2)
    (inc,) = engine.tick(T0 + 2.2)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks) == ("shape_mismatch", [1], [0])
    sim.call(2, T0 + 3, seq=2)
    sim.beat(T0 + 3.1)
    assert engine.tick(T0 + 3.1) == []
    assert len(engine.incidents) == 1
    assert (inc.culprit_ranks, inc.waiting_ranks) == ([1], [0, 2])
    assert "ranks 0, 2: [4]; rank 1: [8]" in inc.summary
    assert len(persisted) >= 2
    # the mismatched slot is not diagnosed again as a hang later on
    sim.beat(T0 + 30)
    engine.tick(T0 + 30)
    assert len(engine.incidents) == 1


def test_mismatch_after_agreeing_ticks_is_still_found() -> None:
    """Slots whose calls all agree skip the full rule check when more of the same arrive; a
    different call arriving after several agreeing ticks must still be compared in full."""
    sim = Sim(8)
    for rk in range(4):
        sim.call(rk, T0 + 1 + rk * 0.01)
        assert mismatch.detect(sim.job, sim.ctx(T0 + 1.5 + rk)) == []
    sim.call(4, T0 + 6, dtype=F64)
    f = only(mismatch.detect(sim.job, sim.ctx(T0 + 6.1)), "dtype_mismatch")
    assert f.culprit_ranks == [4]


def test_rooted_slots_are_always_compared_in_full() -> None:
    """For rooted ops a call identical to the others can still be wrong for its rank (the root
    of a scatter must pass the list), so the agreeing-slot shortcut never applies to them."""
    sim = Sim(2)
    slot_calls = []
    for rk in range(2):
        record = CallRecord(
            rank=rk,
            call_id=rk + 1,
            op="broadcast",
            group="0",
            seq=1,
            inputs=(TensorMeta((4,), F32),),
            root=0,
            call_site=SITE,
            enter_time=T0 + 1,
        )
        sim.job.apply(sim.states[rk], record, T0 + 1)
        slot_calls.append(record)
    slot = sim.job.slots["0"][1]
    assert not slot.uniform
    assert slot.open == 2
    sim.exit(slot_calls[0], T0 + 1.5)
    assert slot.open == 1


def test_slot_open_count_follows_exits_replacements_and_completed_reports() -> None:
    sim = Sim(3)
    a = sim.call(0, T0 + 1)
    sim.call(1, T0 + 1, exit_time=T0 + 1.2)  # reported already complete
    slot = sim.job.slots["0"][1]
    assert slot.open == 1
    sim.call(2, T0 + 1.1)
    assert slot.open == 2
    sim.exit(a, T0 + 1.3)
    assert slot.open == 1
    sim.call(2, T0 + 2, seq=2)  # a later collective on the group closes rank 2's older one
    assert slot.open == 0
    # completed slots are pruned once the job is well past them
    for seq in range(3, 30):
        for rk in range(3):
            sim.call(rk, T0 + seq, seq=seq, exit_time=T0 + seq + 0.1)
    assert 1 not in sim.job.slots["0"]
    assert len(sim.job.wait_durations) > 0


def test_mismatch_third_rank_can_change_the_culprit() -> None:
    sim = Sim(3)
    sim.call(0, T0 + 2)
    sim.call(1, T0 + 2.1, shape=(8,))
    engine = sim.engine()
    (inc,) = engine.tick(T0 + 2.2)
    assert inc.culprit_ranks == [1]
    sim.call(2, T0 + 3, shape=(8,))  # ranks 1 and 2 agree: rank 0 is the odd one
    engine.tick(T0 + 3.1)
    assert len(engine.incidents) == 1
    assert (inc.culprit_ranks, inc.waiting_ranks) == ([0], [1, 2])


def test_group_membership_mismatch() -> None:
    sim = Sim(3)
    views = {0: (0, 1), 1: (0, 1), 2: (1, 2)}
    for rk, members in views.items():
        event = GroupEvent(rk, GroupEventKind.CREATED, GroupInfo(name="5", ranks=members, index=1), T0 + 1)
        sim.job.apply(sim.states[rk], event, T0 + 1)
    f = only(mismatch.detect(sim.job, sim.ctx(T0 + 2)), "arg_mismatch")
    assert f.culprit_ranks == [2]
    assert f.waiting_ranks == [0, 1]
    assert f.key == "group:5"
    assert "new_group" in f.summary
    # one incident however often it is seen
    engine = sim.engine()
    engine.tick(T0 + 2)
    engine.tick(T0 + 3)
    assert [inc.kind for inc in engine.incidents.values()] == ["arg_mismatch"]


# ---- p2p ----------------------------------------------------------------------------------------


def test_p2p_size_mismatch() -> None:
    sim = Sim(2)
    sim.call(0, T0 + 1, op="send", peer=1, shape=(4,), site="pipe.py:10 in forward")
    sim.call(1, T0 + 1, op="recv", peer=0, shape=(8,), site="pipe.py:20 in forward")
    f = only(p2p.detect(sim.job, sim.ctx(T0 + 1.5)), "p2p_mismatch")
    assert f.culprit_ranks == [0, 1]
    assert "sizes differ" in f.summary


def test_p2p_matching_sizes_is_fine() -> None:
    sim = Sim(2)
    sim.call(0, T0 + 1, op="send", peer=1, shape=(2, 4))
    sim.call(1, T0 + 1, op="recv", peer=0, shape=(8,))
    assert p2p.detect(sim.job, sim.ctx(T0 + 30)) == []


def test_p2p_wrong_peer_after_grace() -> None:
    sim = Sim(3)
    sim.call(0, T0 + 1, op="send", peer=1)
    sim.call(1, T0 + 1, op="recv", peer=2)
    assert p2p.detect(sim.job, sim.ctx(T0 + 2)) == []  # within the grace
    f = only(p2p.detect(sim.job, sim.ctx(T0 + 4)), "p2p_mismatch")
    assert f.culprit_ranks == [0, 1]
    assert "rank 0 sends to rank 1, but rank 1 is receiving from rank 2" in f.summary
    engine = sim.engine()
    sim.beat(T0 + 4)
    engine.tick(T0 + 4)
    sim.beat(T0 + 5)
    engine.tick(T0 + 5)
    assert [inc.kind for inc in engine.incidents.values()] == ["p2p_mismatch"]


# ---- engine -------------------------------------------------------------------------------------


def test_engine_stuck_incident_lifecycle_persist_and_stacks() -> None:
    sim = Sim(2)
    sim.collective(1, T0 + 1)
    waiting = sim.call(0, T0 + 2, seq=2)
    persisted: list[tuple[str, str]] = []
    requests: list[tuple[list[Target], bool, Callable[[dict[int, StackDump]], None]]] = []
    engine = sim.engine(
        persist=lambda inc: persisted.append((inc.id, inc.status)),
        request_stacks=lambda targets, native, done: requests.append((targets, native, done)),
    )
    sim.beat(T0 + 10)
    assert engine.tick(T0 + 10) == []
    sim.beat(T0 + 13)
    (inc,) = engine.tick(T0 + 13)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks, inc.status) == ("stuck_collective", [1], [0], "open")
    assert persisted == [(inc.id, "open")]
    assert len(requests) == 1
    targets, native, done = requests[0]
    assert targets == [Target(1, 4001, 501.0), Target(0, 4000, 500.0)]
    assert native is False
    # later ticks: the same incident (its slot is claimed), no new stack request, no churn
    for now in (T0 + 14, T0 + 15, T0 + 18):
        sim.beat(now)
        assert engine.tick(now) == []
    assert len(engine.incidents) == 1
    assert len(requests) == 1
    assert persisted == [(inc.id, "open")]
    # stacks arrive
    main = ThreadStack(4001, "MainThread", (Frame("save", "/w/train.py", 88),), owns_gil=True)
    dumps = {
        1: StackDump(pid=4001, time=T0 + 15, threads=(main,), text="Thread 4001 (idle): MainThread\n  save"),
        0: StackDump(pid=4000, time=T0 + 15, error="ptrace: Operation not permitted"),
    }
    count = len(persisted)
    done(dumps)
    assert inc.stacks == {1: "Thread 4001 (idle): MainThread\n  save"}
    assert inc.stack_notes == {0: "ptrace: Operation not permitted"}
    assert "train.py:88" in inc.details["stack_summary"]["1"]
    assert inc.stacks_time is not None
    assert len(persisted) == count + 1
    # the late rank arrives and every call completes: resolved
    late = sim.call(1, T0 + 20, seq=2)
    sim.beat(T0 + 20.05)
    engine.tick(T0 + 20.05)
    assert inc.status == "open"  # arrived, not completed yet
    sim.exit(waiting, T0 + 20.1)
    sim.exit(late, T0 + 20.1)
    sim.beat(T0 + 20.2)
    assert engine.tick(T0 + 20.2) == []
    assert inc.status == "resolved"
    assert inc.resolved_time == T0 + 20.2
    assert "every rank completed all_reduce (seq 2)" in inc.resolution
    assert "late rank(s): 1" in inc.resolution
    assert persisted[-1] == (inc.id, "resolved")
    assert len(engine.incidents) == 1


def test_engine_without_agents_notes_missing_stacks() -> None:
    sim = Sim(2)
    sim.call(0, T0 + 1)
    engine = sim.engine()
    sim.beat(T0 + 12)
    (inc,) = engine.tick(T0 + 12)
    assert inc.stack_notes == {1: "no node agent is connected to dump stacks", 0: inc.stack_notes[0]}


def test_engine_requests_native_stacks_for_frozen() -> None:
    sim = Sim(2)
    sim.proc(1, ProcState.STOPPED, T0 + 8)
    sim.beat(T0 + 9, ranks=[0])
    requests: list[tuple[list[Target], bool]] = []
    engine = sim.engine(request_stacks=lambda targets, native, done: requests.append((targets, native)))
    engine.tick(T0 + 9)
    assert requests == [([Target(1, 4001, 501.0)], True)]


def test_stuck_threshold_adapts_within_bounds() -> None:
    lo, hi = config.MIN_STUCK_AFTER, config.DEFAULT_STUCK_AFTER
    sim = Sim(2)
    engine = sim.engine(stuck_after=None)
    assert engine.stuck_threshold() == lo  # nothing known yet
    for seq in range(1, 11):
        sim.collective(seq, T0 + seq, duration=0.05)
    assert engine.stuck_threshold() == lo  # fast collectives: the floor
    slow = Sim(2)
    slow_engine = slow.engine(stuck_after=None)
    for seq in range(1, 11):
        slow.collective(seq, T0 + seq * 100, duration=50.0)
    assert slow_engine.stuck_threshold() == hi  # 4 x p99 = 200 s: capped
    mid = Sim(2)
    mid_engine = mid.engine(stuck_after=None)
    for step in range(1, 6):
        mid.job.apply(mid.states[0], StepEvent(0, step, T0 + step * 3.0), T0 + step * 3.0)
    assert mid_engine.stuck_threshold() == 9.0  # 3 x the 3 s step time
    assert lo <= mid_engine.stuck_threshold() <= hi
    assert slow.engine(stuck_after=120.0).stuck_threshold() == 120.0
    assert slow.engine(stuck_after=1.0).stuck_threshold() == 1.0


def test_engine_tick_uses_the_adaptive_threshold() -> None:
    sim = Sim(2)
    sim.call(0, T0 + 1)
    engine = sim.engine(stuck_after=None)
    sim.beat(T0 + 1 + config.MIN_STUCK_AFTER - 0.5)
    assert engine.tick(T0 + 1 + config.MIN_STUCK_AFTER - 0.5) == []
    sim.beat(T0 + 1 + config.MIN_STUCK_AFTER + 0.5)
    (inc,) = engine.tick(T0 + 1 + config.MIN_STUCK_AFTER + 0.5)
    assert inc.kind == "stuck_collective"


def test_incidents_in_memory_are_capped_and_forgotten_ones_stay_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from hangwatch.coordinator import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MAX_INCIDENTS_IN_MEMORY", 3)
    job = JobState()
    eng = engine_mod.Engine(job, threading.RLock(), detectors=[])
    for n in range(5):
        finding = Finding("straggler", f"k{n}", [1], [0], f"s{n}", "h", onset_time=float(n))
        incident, new = eng._absorb(finding, now=float(n))
        assert new and incident is not None
        incident.status = "resolved"
    assert len(eng.incidents) == 3
    assert sorted(eng.incidents) == ["inc-0003", "inc-0004", "inc-0005"]
    again, new = eng._absorb(Finding("straggler", "k0", [1], [0], "s0", "h", onset_time=0.0), now=9.0)
    assert again is None and not new  # the same root cause is not reported twice


def test_most_of_the_job_silent_at_once_is_not_a_freeze() -> None:
    # an overloaded coordinator or a network cut silences everyone: not rank_frozen x N
    sim = Sim(8)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    sim.beat(T0 + 20, ranks=[0, 1])  # six of eight ranks silent for 18 s
    assert frozen.detect(sim.job, sim.ctx(T0 + 20)) == []
    sim.beat(T0 + 20, ranks=[2, 3, 4, 5, 6])  # now only rank 7 is silent: that one is frozen
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 20)), "rank_frozen").culprit_ranks == [7]


def test_many_silent_ranks_on_many_hosts_need_an_agents_word() -> None:
    """64 ranks on 8 hosts: 20 silent on 3 hosts is an overloaded coordinator or the network,
    unless an agent sees one of them stopped; 8 silent on one host (a node) is reported."""
    sim = Sim(64)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    sim.beat(T0 + 20, ranks=list(range(20, 64)))  # ranks 0-19 (hosts 0-2) silent for 18 s
    assert frozen.detect(sim.job, sim.ctx(T0 + 20)) == []
    sim.proc(5, ProcState.STOPPED, T0 + 20)
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 20)), "rank_frozen").culprit_ranks == [5]
    sim.beat(T0 + 20, ranks=list(range(0, 8)) + list(range(16, 20)))  # only node 1 (ranks 8-15) silent
    found = frozen.detect(sim.job, sim.ctx(T0 + 20))
    assert sorted(f.culprit_ranks[0] for f in found) == list(range(8, 16))


def test_single_member_group_is_not_a_straggler_candidate() -> None:
    job = JobState()
    st = job.register(RankIdentity("job", 0, 2, "h", 1, session="s0"), T0)
    job.apply(st, GroupEvent(0, GroupEventKind.CREATED, GroupInfo("2", (0,)), T0), T0)
    job.apply(st, CallRecord(rank=0, call_id=1, op="all_reduce", group="2", seq=1, enter_time=T0), T0)
    assert job.arrivals == {}


def test_clock_offset_ignores_queueing_and_relay_holding() -> None:
    """Rank times are mapped with the smallest recent (arrival - sent) sample: a batch that waited
    in a busy coordinator or was held by a relay does not shift its rank's times (which would
    make it look late), while a real clock change is learnt once the window has passed."""
    st = Sim(1).states[0]
    st.observe_clock(1000.05, 1000.0)
    st.observe_clock(1001.9, 1001.0)  # queued 0.85 s in the coordinator
    st.observe_clock(1002.45, 1002.0, held_s=0.4)  # held 0.4 s by the node's relay
    assert st.clock_offset == pytest.approx(0.05)
    for i in range(40):
        st.observe_clock(2000.0 + i + 3.0, 2000.0 + i)
    assert st.clock_offset == pytest.approx(3.0)
    st.observe_clock(3000.0, 3000.0 - 3600.0)  # the rank's clock was set back an hour
    assert st.clock_offset == pytest.approx(3600.0)  # learnt at once, not after the window
