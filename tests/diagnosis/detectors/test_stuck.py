"""Detector ``stuck``: stuck_collective, early_exit of absent ranks, transport_stall.

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

import dataclasses

from hangwatch import config
from hangwatch import records as r
from hangwatch.diagnosis import traces
from hangwatch.diagnosis.detectors import horizon, stuck
from hangwatch.records import CallRecord, EndKind
from tests.factories import T0, SimJob, only


def test_stuck_two_ranks_not_before_threshold() -> None:
    sim = SimJob(2)
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
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    st = sim.states[1]
    st.last_seen, st.last_sent = T0 + 12, T0 + 1.9  # delivered late, written before rank 0 entered
    sim.states[0].last_seen = sim.states[0].last_sent = T0 + 12
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []
    sim.beat(T0 + 12.6)
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.6)), "stuck_collective").culprit_ranks == [1]


def test_a_wait_is_counted_to_the_threshold_only_as_far_as_the_waiting_ranks_said_so() -> None:
    """Found at 16,384 ranks (``bench/scale.py``): ranks whose first call was under way as their
    first batch left, their exit in a batch still queued at a coordinator running behind, were
    told waiting 5 s for ranks not heard from since their first word. A wait counts to the
    threshold only where a waiting rank said, close to it, that it still waits."""
    sim = SimJob(3)
    waits = [sim.call(rk, T0 + 0.1, seq=1) for rk in (0, 1)]
    for rk in (0, 1):
        sim.states[rk].last_sent = T0 + 0.9  # their first batch, with the call under way
    sim.states[2].last_seen = sim.states[2].last_sent = T0 + 1.0  # heard, no call yet
    for rk in range(3):
        sim.states[rk].last_seen = T0 + 5.2
    assert stuck.detect(sim.job, sim.ctx(T0 + 5.2, stuck_after=5.0)) == []
    # the hang goes on: they say they still wait, and rank 2 that it has not come
    sim.beat(T0 + 5.5)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 5.5, stuck_after=5.0)), "stuck_collective")
    assert (f.culprit_ranks, f.waiting_ranks, f.seq) == ([2], [0, 1], 1)
    for call in waits:  # the look-alike: their exits were on their way, queued behind the rest
        sim.exit(call, T0 + 1.0)
    assert stuck.detect(sim.job, sim.ctx(T0 + 5.6, stuck_after=5.0)) == []


def test_a_coordinator_running_behind_holds_its_stuck_judgements_until_it_catches_up() -> None:
    """Found at 16,384 ranks x 50/s with device progress (``bench/scale.py``): a coordinator 10 s
    behind told 2,270 ranks waiting in a collective whose absent ranks' batches, which held it,
    were queued. Its own lateness is no evidence against a rank: held until it catches up."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.beat(T0 + 12.5)
    late = dataclasses.replace(sim.ctx(T0 + 12.5), behind=horizon.BEHIND_HOLD_S)
    assert stuck.detect(sim.job, late) == []
    caught_up = dataclasses.replace(late, behind=horizon.BEHIND_HOLD_S - 0.5)
    assert only(stuck.detect(sim.job, caught_up), "stuck_collective").culprit_ranks == [1]


def test_a_rank_inside_an_op_no_read_showed_is_not_absent() -> None:
    """A rank whose node agent found it inside an op of the group that no Flight Recorder read
    showed (its entry overwritten first: ``RankState.unseen``) is not blamed with the rank that
    never came; told inside it, among the waiting. With every absent rank so, nobody is blamed."""
    sim = SimJob(3)
    sim.collective(1, T0 + 1)
    sim.call(1, T0 + 2, seq=2, source="flight_recorder")
    for rk in (0, 2):
        st = sim.states[rk]
        st.last_seen = st.last_sent = st.flight_to = T0 + 12
    sim.states[1].last_seen = sim.states[1].last_sent = T0 + 12
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective").culprit_ranks == [0, 2]
    sim.states[0].unseen = ("0",)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective")
    assert (f.culprit_ranks, f.waiting_ranks, f.details["unseen"]) == ([2], [0, 1], [0])
    assert "rank 0 is inside a collective of group 0 that C++ issued" in f.summary
    assert "rank 2 is" in f.summary and "rank 0 is busy" not in f.summary
    sim.states[0].unseen = ("5",)  # another group's: rank 0 is absent from this one
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective").culprit_ranks == [0, 2]
    sim.states[0].unseen = sim.states[2].unseen = ("0",)
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []


def test_absent_rank_gets_a_flight_recorder_read_before_blame() -> None:
    """A collective issued from C++ (DDP) is reported after the rank's next Flight Recorder read:
    a batch sent just after the others entered does not prove the absent rank skipped it."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2, source="flight_recorder")
    sim.states[0].last_seen = sim.states[0].last_sent = T0 + 12
    st = sim.states[1]
    st.last_seen, st.last_sent = T0 + 12, T0 + 2 + config.FR_POLL_INTERVAL_S / 2
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []
    st.last_sent = T0 + 2 + config.FR_POLL_INTERVAL_S + 0.1
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective").culprit_ranks == [1]


def test_where_its_agent_says_when_its_flight_recorder_was_read_that_decides() -> None:
    """A node agent spaces a rank's Flight Recorder reads by their cost and spares those its
    Python calls account for, and says in each batch when the latest read whose records all
    went was asked (``flight_to``): a C++ collective of the absent rank that began before that
    read would be in its records. Until a read asked after the slot began has come, however
    fresh its batches, the rank's absence is not known (an attacking review saw a waiting rank
    blamed, its wait inside DDP's bucket all-reduce not read yet). A read asked just after the
    slot began is not enough either (under load reads came seconds apart, and a rank that arrived
    right after one was blamed): one asked half the stuck threshold after it is."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2, source="flight_recorder")
    sim.states[0].last_seen = sim.states[0].last_sent = T0 + 12
    st = sim.states[1]
    st.last_seen, st.last_sent = T0 + 12, T0 + 12  # batches well after the slot, from a side thread
    st.flight_to = T0 + 1.5  # its latest read was asked before rank 0 entered
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []
    st.flight_to = T0 + 2.1  # just after: it may have arrived a moment later
    assert stuck.detect(sim.job, sim.ctx(T0 + 12.5)) == []
    st.flight_to = T0 + 2 + 10 / 2  # half the stuck threshold (10 s) after
    assert only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective").culprit_ranks == [1]
    # reads that stopped coming (its worker server no longer answers) say nothing: the allowance
    # is the one-poll one again, rather than never blaming it
    st.flight_to = T0 + 1.5
    st.last_seen = st.last_sent = T0 + 1.5 + horizon.FLIGHT_STALE_S + 1
    found = stuck.detect(sim.job, sim.ctx(T0 + 1.5 + horizon.FLIGHT_STALE_S + 1))
    assert only(found, "stuck_collective").culprit_ranks == [1]


def test_a_wait_inside_a_cxx_call_counts_once_a_read_since_shows_it_still_under_way() -> None:
    """Found in CI: a 24-entry CPU ring turned over between reads spaced seconds apart on a loaded
    machine; one read found rank 2 inside DDP's constructor broadcast, none showed it done, and it
    was told waiting there 3 s for a rank whose own entry had been overwritten. A wait inside a
    call C++ issued counts once a read asked half the threshold after the call began still shows
    it under way; reads that never come hold it ``TRACE_WAIT_S`` at most."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, op="broadcast", seq=2, source="flight_recorder")
    now = T0 + 12.5
    sim.beat(now)
    sim.states[1].flight_to = now  # rank 1 read: no such call
    sim.states[0].flight_to = T0 + 2.1  # the read that found rank 0's in flight, and none since
    assert stuck.detect(sim.job, sim.ctx(now)) == []
    sim.states[0].flight_to = T0 + 2 + 10 / 2  # a read half the threshold (10 s) after: still in it
    f = only(stuck.detect(sim.job, sim.ctx(now)), "stuck_collective")
    assert (f.culprit_ranks, f.waiting_ranks, f.op) == ([1], [0], "broadcast")
    sim.states[0].flight_to = T0 + 2.1
    late = T0 + 2 + 10 + traces.TRACE_WAIT_S + 0.1
    sim.beat(late)
    sim.states[1].flight_to = late
    assert only(stuck.detect(sim.job, sim.ctx(late)), "stuck_collective").culprit_ranks == [1]


def test_stuck_eight_ranks_one_absent() -> None:
    sim = SimJob(8)
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
    sim = SimJob(2)
    sim.call(0, T0 + 1, seq=1)
    sim.call(1, T0 + 1, op="recv", peer=0, site="eval.py:9 in evaluate")
    sim.beat(T0 + 15)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 15)), "stuck_collective")
    assert f.culprit_ranks == [1]
    assert "is waiting in recv (group 0, seq 1) at eval.py:9 in evaluate for 14 s" in f.details["absent"]["1"]


def test_no_transport_stall_claimed_for_a_group_of_unknown_members() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1, group="7")
    sim.call(1, T0 + 1, group="7")
    sim.beat(T0 + 30)
    assert [f.kind for f in stuck.detect(sim.job, sim.ctx(T0 + 30))] == []


def test_stuck_64_ranks_is_one_incident() -> None:
    sim = SimJob(64)
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
    sim = SimJob(2)
    sim.job.world_size = 3  # rank 2 never registered
    sim.call(0, T0 + 1)
    sim.call(1, T0 + 1)
    sim.beat(T0 + 12)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 12)), "stuck_collective")
    assert f.culprit_ranks == [2]
    assert "never registered" in f.summary


def test_an_absent_rank_that_started_and_never_joined_is_told_where_it_is() -> None:
    """On NCCL init returns on each rank alone: ranks 0 and 1 wait in their first all_reduce for
    rank 2, whose process its agent proved and which never entered init_process_group."""
    sim = SimJob(2)
    sim.job.world_size = 3
    sim.job.join(r.RankIdentity("job", 2, 3, "node-b", 4002, start_time=502.0, session="s2", phase=r.STARTING), T0)
    sim.job.joining[2].where = "download_dataset at train.py:12"
    sim.call(0, T0 + 1)
    sim.call(1, T0 + 1)
    sim.beat(T0 + 12)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 12)), "stuck_collective")
    assert f.culprit_ranks == [2] and f.stack_ranks == [2, 0]
    assert f.summary.endswith(
        "; rank 2 never entered init_process_group: it is in download_dataset at train.py:12 (pid 4002 on node-b)"
    )


def test_early_exit_absent_rank_exited_cleanly() -> None:
    for kind, action in ((EndKind.CLEAN_EXIT, "has exited its script"), (EndKind.DESTROYED, "destroy_process_group")):
        sim = SimJob(3)
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


def _all_entered(sources: tuple[str, str] = ("python", "python")) -> SimJob:
    sim = SimJob(2)
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


METRIC, GRADS = "train.py:38 in train", "train.py:44 in train"


def _loop(sim: SimJob, rank: int, steps: int, skip: int | None = None, t0: float = T0) -> int:
    """``rank``'s loop: per step a metric all_reduce, then the gradients' all_reduce and the
    optimizer step; at step ``skip`` (a NaN loss) it ``continue``s after the metric. Its last seq."""
    seq, step = 0, 0
    for i in range(1, steps + 1):
        t = t0 + i
        seq += 1
        sim.exit(sim.call(rank, t, seq=seq, step=step, site=METRIC), t + 0.01)
        if i == skip:
            continue
        seq += 1
        sim.exit(sim.call(rank, t + 0.1, seq=seq, step=step, site=GRADS), t + 0.11)
        step += 1
    return seq


def test_a_rank_that_skipped_one_call_and_carried_on_is_named_with_the_call_it_skipped() -> None:
    """A NaN loss on rank 1 at its 5th iteration: ``continue`` before backward skips that step's
    gradient all_reduce (the same shape as the metric's: a tensor-parallel layer's are alike too),
    so nothing mismatches, but rank 1 runs out of calls one before rank 0: not "left the training
    loop" but "skipped all_reduce in step 4"."""
    sim = SimJob(2)
    last = _loop(sim, 0, 7)
    _loop(sim, 1, 8, skip=5)
    sim.call(0, T0 + 8, seq=last + 1, step=7, site=METRIC)  # iteration 8: rank 0's metric
    sim.call(0, T0 + 8.1, seq=last + 2, step=7, site=GRADS)  # rank 1 has no call left for this one
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 8.5)
    sim.beat(T0 + 30, ranks=[0])
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 30)), "stuck_collective")
    assert f.culprit_ranks == [1] and f.waiting_ranks == [0]
    assert f"rank 1 skipped all_reduce at {GRADS} in step 4 (seq 10)" in f.summary
    assert f.details["skipped"] == {"rank": 1, "op": "all_reduce", "call_site": GRADS, "step": 4, "seq": 10}


def test_a_rank_that_left_the_loop_early_is_still_an_early_exit() -> None:
    """The look-alike: rank 1 breaks out after step 4 (its own early stop): no call skipped."""
    sim = SimJob(2)
    last = _loop(sim, 0, 4)
    _loop(sim, 1, 4)
    sim.call(0, T0 + 5, seq=last + 1, step=4, site=METRIC)
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 5.5)
    sim.beat(T0 + 30, ranks=[0])
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 30)), "early_exit")
    assert f.culprit_ranks == [1] and "skipped" not in f.details


def test_calls_that_call_sites_cannot_tell_apart_claim_no_skip() -> None:
    """One collective in the loop: a skip looks exactly like stopping one call early."""
    sim = SimJob(2)
    for seq in range(1, 10):
        sim.exit(sim.call(0, T0 + seq, seq=seq, step=seq), T0 + seq + 0.01)
        if seq < 9:
            sim.exit(sim.call(1, T0 + seq + (1 if seq >= 5 else 0), seq=seq, step=seq), T0 + seq + 0.01)
    sim.end(1, EndKind.CLEAN_EXIT, T0 + 9.5)
    sim.call(0, T0 + 10, seq=10, step=10)
    sim.beat(T0 + 30, ranks=[0])
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 30)), "early_exit")
    assert "skipped" not in f.details


def test_a_world_barrier_waiting_on_a_subgroup_hang_is_its_aftermath() -> None:
    """Ranks 0 and 1 share a subgroup; rank 1 stalls, so rank 0 waits in the subgroup's
    all_reduce; rank 2 (not in it) goes on to the world barrier and waits there for both. One
    root cause: the subgroup hang, with the barrier told inside it."""
    from tests.factories import group_event

    sim = SimJob(3)
    for rk in (0, 1):
        sim.apply(group_event(rk, "1", (0, 1)), T0)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=1, group="1")
    sim.call(2, T0 + 3, op="barrier", seq=2, shape=None)
    sim.beat(T0 + 30, where_user="train.py:70 in load_batch")
    engine = sim.engine()
    opened = engine.tick(T0 + 30)
    assert [(i.kind, i.group, i.culprit_ranks) for i in opened] == [("stuck_collective", "1", [1])]
    (inc,) = engine.incidents.values()
    assert inc.details["aftermath"]["ranks"] == [0, 1] and "barrier" in inc.summary
    assert engine.tick(T0 + 31) == []


def test_two_unrelated_hangs_are_two_incidents() -> None:
    """The look-alike: hangs on two groups whose absent ranks are not part of each other's."""
    from tests.factories import group_event

    sim = SimJob(4)
    for rk in (0, 1):
        sim.apply(group_event(rk, "1", (0, 1)), T0)
    for rk in (2, 3):
        sim.apply(group_event(rk, "2", (2, 3)), T0)
    sim.call(0, T0 + 2, seq=1, group="1")
    sim.call(2, T0 + 3, seq=1, group="2")
    sim.beat(T0 + 30)
    opened = sim.engine().tick(T0 + 30)
    assert sorted((i.group, tuple(i.culprit_ranks)) for i in opened) == [("1", (1,)), ("2", (3,))]


def test_a_busy_rank_is_not_told_as_having_skipped_a_backward() -> None:
    """Rank 1's DDP forwards show the gap of a skipped backward (or of one extra forward with no
    backward: a logged prediction), but it is busy in user code, not out of calls: the story is
    the plain one ("busy"), never "will never make it"."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.states[0].forwards.extend([(1, "0", 0, 0), (2, "0", 1, 1)])
    sim.states[1].forwards.extend([(1, "0", 0, 0), (2, "0", 0, 0)])  # its second forward at the same seq
    sim.beat(T0 + 12.5, where_user="train.py:88 in save_checkpoint")
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 12.5)), "stuck_collective")
    assert f.culprit_ranks == [1] and "skipped" not in f.details
    assert "never make it" not in f.summary and "busy in train.py:88 in save_checkpoint" in f.summary


def test_a_chain_of_hangs_is_one_incident_told_where_the_waits_end() -> None:
    """Rank 0 waits in group a for rank 1, which waits in group b for rank 2, which waits in
    group c for rank 3, busy in its own work. Whatever order the slots were entered in, one
    incident, on rank 3; the waits held up behind it are its aftermath."""
    from tests.factories import group_event

    for order in ((1, 2, 3), (3, 2, 1)):
        sim = SimJob(4)
        for name, pair in (("a", (0, 1)), ("b", (1, 2)), ("c", (2, 3))):
            for rk in pair:
                sim.apply(group_event(rk, name, pair), T0)
        for rank, group, at in zip((0, 1, 2), "abc", order, strict=True):
            sim.call(rank, T0 + at, seq=1, group=group)
        sim.beat(T0 + 30, where_user="train.py:70 in save")
        engine = sim.engine()
        opened = engine.tick(T0 + 30)
        assert [(i.kind, i.group, i.culprit_ranks) for i in opened] == [("stuck_collective", "c", [3])], order
        (inc,) = engine.incidents.values()
        assert "aftermath" in inc.details
        assert engine.tick(T0 + 31) == []


def test_a_barrier_held_up_by_two_stages_that_both_send_first_is_the_deadlock_s_aftermath() -> None:
    """Ranks 0 and 1 both send to each other first; rank 2 reaches the world barrier and waits
    for them. One incident: the p2p deadlock (a cycle of the wait-for graph); the barrier is
    told in it."""
    sim = SimJob(3)
    sim.call(0, T0 + 1, op="send", peer=1, seq=1)
    sim.call(1, T0 + 1, op="send", peer=0, seq=1)
    sim.call(2, T0 + 2, op="barrier", seq=1, shape=None)
    sim.beat(T0 + 40)
    engine = sim.engine()
    opened = engine.tick(T0 + 40)
    assert [(i.kind, i.culprit_ranks) for i in opened] == [("p2p_mismatch", [0, 1])]
    (inc,) = [i for i in engine.incidents.values() if i.status == "open"]
    assert inc.details["aftermath"]["ranks"] == [0, 1] and "barrier" in inc.summary


def test_a_hang_found_a_moment_before_the_one_its_culprits_wait_in_is_that_one_s_aftermath() -> None:
    """Found by the story table under load: ranks 2 and 3 enter the world barrier a moment
    before rank 0 enters its subgroup's all_reduce, where it waits for rank 1, busy in its own
    work. The barrier waits the threshold first; its culprits are ranks 0 and 1, but rank 0 is
    waiting, in a call younger than the threshold. The barrier is held until the all_reduce is due:
    one incident, on rank 1, the barrier its aftermath (it was the barrier's own, blaming 0 and 1)."""
    from tests.factories import group_event

    sim = SimJob(4)
    for name, pair in (("tp0", (0, 1)), ("tp1", (2, 3))):
        for rk in pair:
            sim.apply(group_event(rk, name, pair), T0)
    sim.call(2, T0 + 1.0, seq=1, op="barrier", shape=None)
    sim.call(3, T0 + 1.0, seq=1, op="barrier", shape=None)
    sim.call(0, T0 + 1.5, seq=1, group="tp0")
    engine = sim.engine()
    threshold = engine.stuck_threshold(sim.job)
    sim.beat(T0 + 1.2 + threshold, where_user="train.py:70 in save")
    assert engine.tick(T0 + 1.2 + threshold) == []  # the barrier is due, the all_reduce not yet
    sim.beat(T0 + 2 + threshold, where_user="train.py:70 in save")
    opened = engine.tick(T0 + 2 + threshold)
    assert [(i.kind, i.group, i.culprit_ranks, i.waiting_ranks) for i in opened] == [
        ("stuck_collective", "tp0", [1], [0])
    ]
    (inc,) = engine.incidents.values()
    assert inc.details["aftermath"]["ranks"] == [0, 1] and "barrier" in inc.summary


def test_a_culprit_always_in_some_young_call_is_blamed_one_threshold_later() -> None:
    """The bound of that hold: ranks 0 and 1 loop on their own subgroup's collectives and never
    reach the barrier ranks 2 and 3 wait in. Each of rank 0's calls is young; the barrier is
    told once it has waited twice the threshold, on ranks 0 and 1."""
    from tests.factories import group_event

    sim = SimJob(4)
    for rk in (0, 1):
        sim.apply(group_event(rk, "tp0", (0, 1)), T0)
    sim.call(2, T0 + 1.0, seq=1, op="barrier", shape=None)
    sim.call(3, T0 + 1.0, seq=1, op="barrier", shape=None)
    engine = sim.engine()
    threshold = engine.stuck_threshold(sim.job)
    told: list[object] = []
    last: dict[int, CallRecord | None] = {}
    for k in range(int(2 * threshold) + 3):
        now = T0 + 1.0 + k
        for rk in (0, 1):  # a step of their own: rank 0 enters first, each finishes the last
            sim.call(rk, now - 0.5 + 0.2 * rk, seq=k + 1, group="tp0")
            if last.get(rk) is not None:
                sim.exit(last[rk], now - 0.3)  # type: ignore[arg-type]
        last = {rk: sim.job.ranks[rk].last_call for rk in (0, 1)}
        sim.beat(now)
        told += [(i.kind, i.group, i.culprit_ranks) for i in engine.tick(now)]
    assert told == [("stuck_collective", "0", [0, 1])]


def test_a_busy_rank_whose_cpp_calls_are_not_read_yet_is_not_told_busy() -> None:
    """Found by the story table under load: rank 1 skipped a backward under DDP and waited in the
    final barrier; rank 0, whose gradient all_reduces come from Flight Recorder reads, was told
    "busy in its backward" 3 s later, because the read that held its all_reduce at the barrier's
    seq had not come. A culprit whose trace is not known through the wait's start is waited for
    (``TRACE_WAIT_S`` past the threshold at most); once read, it is what the read shows."""
    sim = SimJob(2)
    for seq in range(1, 5):
        for rank in (0, 1):
            sim.call(rank, T0 + seq, seq=seq, source="flight_recorder", exit_time=T0 + seq + 0.1)
    for rank in (0, 1):
        sim.job.ranks[rank].flight_to = T0 + 4.5  # read up to the fourth call
    sim.call(1, T0 + 6, op="barrier", seq=5, shape=None, site="train.py:133 in <module>")
    threshold = T0 + 6 + 10.0 + 0.5
    sim.beat(threshold, where_user="train.py:129 in <module>")
    assert stuck.detect(sim.job, sim.ctx(threshold)) == []  # rank 0's C++ calls after 4.5 s: unknown
    # a read past the wait that shows nothing more: busy, as it is
    sim.job.ranks[0].flight_to = threshold
    f = only(stuck.detect(sim.job, sim.ctx(threshold + 0.1)), "stuck_collective")
    assert f.culprit_ranks == [0] and "rank 0 is busy" in f.summary
    # and reads that never come hold it TRACE_WAIT_S at most
    sim.job.ranks[0].flight_to = T0 + 4.5
    late = T0 + 6 + 10.0 + traces.TRACE_WAIT_S + 0.1
    sim.beat(late, where_user="train.py:129 in <module>")
    assert only(stuck.detect(sim.job, sim.ctx(late)), "stuck_collective").culprit_ranks == [0]


def test_a_hang_in_a_nccl_groups_first_collective_says_its_communicator_is_made_there() -> None:
    """On NCCL a group's communicator is created lazily, in its first collective: ranks waiting
    there may wait on a communicator that never forms; the story says so. Gloo's does not."""
    for backend, told in (("nccl", True), ("gloo", False)):
        sim = SimJob(2)
        for st in sim.job.ranks.values():
            st.identity = dataclasses.replace(st.identity, backend=backend)
        sim.call(0, T0 + 1, seq=1)
        sim.beat(T0 + 12, where_user="train.py:88 in load_batch")
        f = only(stuck.detect(sim.job, sim.ctx(T0 + 12)), "stuck_collective")
        assert ("NCCL creates its communicator in it" in f.summary) is told, f.summary
