"""The engine: incident lifecycle, stacks, the adaptive threshold, incidents kept in memory.

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from hangwatch import config
from hangwatch.diagnosis import traces
from hangwatch.diagnosis.budget import Budget
from hangwatch.diagnosis.engine import BUDGET_HOLD_S
from hangwatch.diagnosis.incidents import Finding
from hangwatch.diagnosis.state import JobState
from hangwatch.records import (
    Frame,
    ProcState,
    StackDump,
    StepEvent,
    Target,
    ThreadStack,
    link_tag,
)
from tests.factories import T0, SimJob, call, group_event


def test_engine_stuck_incident_lifecycle_persist_and_stacks() -> None:
    sim = SimJob(2)
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
    assert [(t.rank, t.pid, t.start_time) for t in targets] == [(1, 4001, 501.0), (0, 4000, 500.0)]
    assert all(t.link == link_tag(sim.job.ranks[t.rank].identity.session) for t in targets)
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
    sim = SimJob(2)
    sim.call(0, T0 + 1)
    engine = sim.engine()
    sim.beat(T0 + 12)
    (inc,) = engine.tick(T0 + 12)
    assert inc.stack_notes == {1: "no node agent is connected to dump stacks", 0: inc.stack_notes[0]}


def test_engine_requests_native_stacks_for_frozen() -> None:
    sim = SimJob(2)
    sim.proc(1, ProcState.STOPPED, T0 + 8)
    sim.beat(T0 + 9, ranks=[0])
    requests: list[tuple[list[Target], bool]] = []
    engine = sim.engine(request_stacks=lambda targets, native, done: requests.append((targets, native)))
    engine.tick(T0 + 9)
    assert requests == [([Target(1, 4001, 501.0, link=link_tag(sim.job.ranks[1].identity.session))], True)]


def test_stuck_threshold_adapts_within_bounds() -> None:
    lo, hi = config.MIN_STUCK_AFTER, config.DEFAULT_STUCK_AFTER
    sim = SimJob(2)
    engine = sim.engine(stuck_after=None)
    assert engine.stuck_threshold() == lo  # nothing known yet
    for seq in range(1, 11):
        sim.collective(seq, T0 + seq, duration=0.05)
    assert engine.stuck_threshold() == lo  # fast collectives: the floor
    slow = SimJob(2)
    slow_engine = slow.engine(stuck_after=None)
    for seq in range(1, 11):
        slow.collective(seq, T0 + seq * 100, duration=50.0)
    assert slow_engine.stuck_threshold() == hi  # 4 x p99 = 200 s: capped
    mid = SimJob(2)
    mid_engine = mid.engine(stuck_after=None)
    for step in range(1, 6):
        mid.job.apply(mid.states[0], StepEvent(0, step, T0 + step * 3.0), T0 + step * 3.0)
    assert mid_engine.stuck_threshold() == 9.0  # 3 x the 3 s step time
    assert lo <= mid_engine.stuck_threshold() <= hi
    assert slow.engine(stuck_after=120.0).stuck_threshold() == 120.0
    assert slow.engine(stuck_after=1.0).stuck_threshold() == 1.0


def test_a_step_whose_first_calls_come_in_its_batch_is_timed() -> None:
    """A batch's calls are applied before its steps (see the proto): a step's first calls, sent
    with its step, have moved the rank to that step already. Its time still counts. (Before,
    it did not: a job sending a step a batch had no step time, and its threshold no rhythm.)"""
    sim = SimJob(2)
    engine = sim.engine(stuck_after=None)
    for step in range(1, 6):
        t = T0 + step * 3.0
        for rk in (0, 1):
            first = call(rk, step, enter_time=t + 0.01, exit_time=t + 0.02, step=step)
            sim.deliver(rk, [first, StepEvent(rk, step, t)], t + 0.1)
    assert engine.stuck_threshold() == 9.0  # 3 x the 3 s step time


def test_engine_tick_uses_the_adaptive_threshold() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1)
    engine = sim.engine(stuck_after=None)
    sim.beat(T0 + 1 + config.MIN_STUCK_AFTER - 0.5)
    assert engine.tick(T0 + 1 + config.MIN_STUCK_AFTER - 0.5) == []
    sim.beat(T0 + 1 + config.MIN_STUCK_AFTER + 0.5)
    (inc,) = engine.tick(T0 + 1 + config.MIN_STUCK_AFTER + 0.5)
    assert inc.kind == "stuck_collective"


def test_incidents_in_memory_are_capped_and_forgotten_ones_stay_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from hangwatch.diagnosis import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MAX_INCIDENTS_IN_MEMORY", 3)
    job = JobState()
    eng = engine_mod.Engine(job, threading.RLock(), detectors=[])
    for n in range(5):
        finding = Finding("straggler", f"k{n}", [1], [0], f"s{n}", "h", onset_time=float(n))
        incident, new = eng._absorb(finding, job, now=float(n))
        assert new and incident is not None
        incident.status = "resolved"
    assert len(eng.incidents) == 3
    assert sorted(eng.incidents) == ["inc-0003", "inc-0004", "inc-0005"]
    again, new = eng._absorb(Finding("straggler", "k0", [1], [0], "s0", "h", onset_time=0.0), job, now=9.0)
    assert again is None and not new  # the same root cause is not reported twice


def test_incident_keys_are_built_from_fields_in_the_stored_form() -> None:
    """The stored key strings (reloaded by the store at startup) stay what they were."""
    from hangwatch.diagnosis.incidents import KeyFamily, incident_key, key_family

    assert incident_key(KeyFamily.STUCK, group="0", seq=2) == "stuck:0:2"
    assert incident_key(KeyFamily.MISMATCH, group="0", seq=5) == "mismatch:0:5"
    assert incident_key(KeyFamily.EARLY_END, session="session-1") == "early-end:session-1"
    assert incident_key(KeyFamily.STRAGGLER, group="tp1", rank=7) == "straggler:tp1:7"
    assert incident_key(KeyFamily.GROUP, group="5") == "group:5"
    assert incident_key(KeyFamily.P2P, group="0", seq=4, ranks=(0, 1)) == "p2p:0:4:0,1"
    assert incident_key(KeyFamily.P2P, group="0", ranks=(1, 0), direction="send") == "p2p:0:1,0:send"
    assert key_family("mismatch:0:5") == KeyFamily.MISMATCH.value


def test_a_hang_told_before_its_calls_were_read_is_told_again_by_the_mismatch_there() -> None:
    """One slot, one story. Rank 1 waits in a barrier; rank 0's C++ calls come from Flight
    Recorder reads that stopped for longer than the wait for them, so it is told busy. When the
    read comes, its all_reduce is at the barrier's seq: the mismatch tells the slot, and the hang
    is resolved into it (not two incidents of one root cause)."""
    sim = SimJob(2)
    for seq in range(1, 5):
        for rank in (0, 1):
            sim.call(rank, T0 + seq, seq=seq, source="flight_recorder", exit_time=T0 + seq + 0.1)
    for rank in (0, 1):
        sim.job.ranks[rank].flight_to = T0 + 4.5
    sim.call(1, T0 + 6, op="barrier", seq=5, shape=None, site="train.py:133 in <module>")
    engine = sim.engine()
    late = T0 + 6 + 10 + traces.TRACE_WAIT_S + 0.5
    sim.beat(late, where_user="train.py:129 in <module>")
    (hang,) = engine.tick(late)
    assert (hang.kind, hang.culprit_ranks) == ("stuck_collective", [0])
    sim.call(0, T0 + 5.5, seq=5, source="flight_recorder")  # the read, at last
    sim.job.ranks[0].flight_to = late + 1
    sim.beat(late + 1, where_user="train.py:129 in <module>")
    (told,) = engine.tick(late + 1)
    assert (told.group, told.seq) == ("0", 5) and told.kind != "stuck_collective"
    assert hang.status == "resolved" and hang.resolution.startswith(f"told again as {told.id}")
    assert [i.id for i in engine.incidents.values() if i.status == "open"] == [told.id]


def test_a_hang_keeps_who_waited_for_whom_when_it_was_told() -> None:
    """``report --graph`` draws what the graph was when the incident was told: its waits, the
    sink they end in, and each node's ranks among them."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    for rank in (0, 2):
        sim.call(rank, T0 + 2, seq=2)
    engine = sim.engine()
    sim.beat(T0 + 13, where_user="train.py:88 in save_checkpoint")
    (inc,) = engine.tick(T0 + 13)
    graph = inc.details["graph"]
    assert graph["waits"] == [{"group": "0", "seq": 2, "op": "all_reduce", "ranks": [0, 2], "waits_for": [1]}]
    assert graph["hangs"] == [{"ranks": [1], "stand": "busy", "upstream": [0, 2]}]
    hosts = {st.identity.host for st in sim.job.ranks.values()}
    assert sorted(rank for ranks in graph["hosts"].values() for rank in ranks) == [0, 1, 2]
    assert set(graph["hosts"]) == hosts


def test_a_job_whose_records_were_refused_for_its_budget_is_judged_once_they_no_longer_are() -> None:
    """At 16,384 ranks over a 2,048 MiB job budget, refused calls left holes in many ranks' traces
    and a shape mismatch was blamed on 2,716 ranks. A job whose records its or the coordinator's
    budget refused is judged ``BUDGET_HOLD_S`` after the last refusal; one rank's own budget,
    which leaves the others' evidence whole, holds nothing (a flooding rank cannot blind it)."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)  # rank 0 waits, rank 1 never comes
    engine = sim.engine()
    ledger = sim.job.ledger
    ledger.budget = Budget(1 << 40, sim.job.held + 2048, 1 << 40)
    for seq in range(1, 40):  # rank 1's calls on another group, refused at the job's budget
        sim.call(1, T0 + 3 + seq / 100, seq=seq, group="side")
    assert sim.job.refused_wide > 0
    sim.beat(T0 + 13)
    assert engine.tick(T0 + 13) == [] and engine.held_for_budget(sim.job, T0 + 13) > 0
    later = T0 + 13 + BUDGET_HOLD_S
    sim.beat(later)
    (inc,) = engine.tick(later)
    assert (inc.kind, inc.culprit_ranks) == ("stuck_collective", [1])
    # a rank's own budget refusing its flood holds nothing
    sim2 = SimJob(2)
    sim2.collective(1, T0 + 1)
    sim2.call(0, T0 + 2, seq=2)
    engine2 = sim2.engine()
    sim2.job.ledger.budget = Budget(sim2.job.ranks[1].held + sim2.job.ranks[1].calls + 2048, 1 << 40, 1 << 40)
    for seq in range(1, 40):
        sim2.call(1, T0 + 3 + seq / 100, seq=seq, group="side")
    assert sim2.job.refused > 0 and sim2.job.refused_wide == 0
    sim2.beat(T0 + 13)
    (inc2,) = engine2.tick(T0 + 13)
    assert inc2.kind == "stuck_collective"


def test_a_hang_told_gains_the_ranks_that_came_to_wait_after_it_and_blames_them_no_more() -> None:
    """A slot's incident, once told, was never diagnosed again: a rank whose call there was read
    later (a device's progress riding with a later batch, a batch late) stayed out of it, and a
    rank blamed for not having come stayed blamed once it came. Ranks that come to wait are
    told in the same incident; a tick with no one new changes nothing."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    sim.call(2, T0 + 2, seq=2)
    persisted: list[tuple[str, str]] = []
    engine = sim.engine(persist=lambda inc: persisted.append((inc.id, inc.status)))
    sim.beat(T0 + 13)
    (inc,) = engine.tick(T0 + 13)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks) == ("stuck_collective", [0, 1], [2])
    sim.call(0, T0 + 13.5, seq=2)  # rank 0 was late, not stuck: it comes
    sim.beat(T0 + 14)
    assert engine.tick(T0 + 14) == []  # (no new incident: the same one, told again)
    assert (inc.kind, inc.culprit_ranks, inc.waiting_ranks) == ("stuck_collective", [1], [0, 2])
    assert inc.summary.startswith("ranks 0, 2 wait in all_reduce (group 0, seq 2)"), inc.summary
    assert "rank 0 is outside" not in inc.summary and "rank 1 is outside any collective" in inc.summary
    assert inc.details["revised"] == 1
    assert len(engine.incidents) == 1 and inc.status == "open"
    count = len(persisted)
    for now in (T0 + 15, T0 + 16, T0 + 19):  # the look-alike: the same slot, no one new
        sim.beat(now)
        assert engine.tick(now) == []
    assert (inc.culprit_ranks, inc.waiting_ranks, inc.details["revised"]) == ([1], [0, 2], 1)
    assert len(persisted) == count


def test_a_hang_told_again_with_who_came_changes_no_other_hang() -> None:
    """Rank 1 waits in a subgroup's all_reduce for rank 3; rank 2 waits in the world's for ranks
    0, 1 and 3: two hangs. Rank 0 then comes to the world's: that hang is told again in its
    own incident (rank 0 no longer blamed, rank 1 told waiting where it waits); the subgroup's
    is untouched, and nothing is opened or folded anew."""
    sim = SimJob(4)
    for rk in (1, 3):
        sim.apply(group_event(rk, "1", (1, 3)), T0)
    sim.collective(1, T0 + 1)
    sim.call(1, T0 + 1.5, seq=1, group="1")
    sim.call(2, T0 + 2, seq=2)
    engine = sim.engine()
    sim.beat(T0 + 12)
    sub, world = sorted(engine.tick(T0 + 12), key=lambda inc: inc.group, reverse=True)
    assert (sub.group, sub.culprit_ranks, sub.waiting_ranks) == ("1", [3], [1])
    assert (world.group, world.culprit_ranks, world.waiting_ranks) == ("0", [0, 1, 3], [2])
    before = (sub.summary, dict(sub.details))
    sim.call(0, T0 + 13.5, seq=2)
    for now in (T0 + 14, T0 + 15):
        sim.beat(now)
        assert engine.tick(now) == []
    assert (world.culprit_ranks, world.waiting_ranks, world.details["revised"]) == ([1, 3], [0, 2], 1)
    assert "rank 1 is waiting in all_reduce (group 1, seq 1)" in world.summary, world.summary
    assert (sub.summary, sub.details) == before
    assert len(engine.incidents) == 2
