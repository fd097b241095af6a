"""The job state's bookkeeping the detectors rely on: slots, arrivals, clock offsets.

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

import pytest

from hangwatch.diagnosis.state import JobState
from hangwatch.records import (
    CallRecord,
    GroupEvent,
    GroupEventKind,
    GroupInfo,
    RankIdentity,
    TensorMeta,
)
from tests.factories import F32, SITE, T0, SimJob


def test_rooted_slots_are_always_compared_in_full() -> None:
    """For rooted ops a call identical to the others can still be wrong for its rank (the root
    of a scatter must pass the list), so the agreeing-slot shortcut never applies to them."""
    sim = SimJob(2)
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
    sim = SimJob(3)
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
    st = SimJob(1).states[0]
    st.observe_clock(1000.05, 1000.0)
    st.observe_clock(1001.9, 1001.0)  # queued 0.85 s in the coordinator
    st.observe_clock(1002.45, 1002.0, held_s=0.4)  # held 0.4 s by the node's relay
    assert st.clock_offset == pytest.approx(0.05)
    for i in range(40):
        st.observe_clock(2000.0 + i + 3.0, 2000.0 + i)
    assert st.clock_offset == pytest.approx(3.0)
    st.observe_clock(3000.0, 3000.0 - 3600.0)  # the rank's clock was set back an hour
    assert st.clock_offset == pytest.approx(3600.0)  # learnt at once, not after the window


def test_a_rank_s_own_word_that_it_is_inside_an_unseen_collective_is_not_believed() -> None:
    """``flight_unseen`` spares a rank blame (``detectors.stuck``): only a batch of a rank a node
    agent registered (its pid the kernel's word, its rings read by that agent) may say it."""
    job = JobState()
    direct = job.register(RankIdentity("job", 0, 2, "h", 1, session="s0"), T0)
    agent = job.register(RankIdentity("job", 1, 2, "h", 2, session="s1"), T0, via="agent")
    for rank, session in ((0, "s0"), (1, "s1")):
        job.ingest(session, rank, [], now=T0 + 1, sent_time=T0 + 1, flight_unseen=("0",))
    assert (direct.unseen, agent.unseen) == ((), ("0",))
    job.ingest("s1", 1, [], now=T0 + 2, sent_time=T0 + 2)  # the agent's latest word: none now
    assert agent.unseen == ()
