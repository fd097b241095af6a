"""A job's wait-for graph from its state, as ``status`` shows it."""

from __future__ import annotations

import io

from hangwatch.cli.render import render_status
from hangwatch.diagnosis import waits
from hangwatch.diagnosis.views import status_json
from hangwatch.model.waitfor import Stand, Wait
from hangwatch.records import EndKind, ProcState
from tests.factories import T0, SimJob, group_event


def test_ranks_in_a_collective_wait_for_the_members_that_have_not_entered_it() -> None:
    sim = SimJob(4)
    for rk in (0, 2, 3):
        sim.call(rk, T0 + 1, seq=7)
    g = waits.graph(sim.job, T0 + 2, silence_after=5.0)
    assert g.waits == [Wait("0", 7, "all_reduce", (0, 2, 3), (1,))]
    assert [(h.ranks, h.stand, h.upstream) for h in g.hangs()] == [((1,), Stand.BUSY, (0, 2, 3))]


def test_a_dead_or_ended_member_is_the_sink_and_a_dead_rank_waits_for_no_one() -> None:
    sim = SimJob(3)
    sim.call(0, T0 + 1, seq=3)
    sim.call(1, T0 + 1, seq=3)
    sim.proc(1, ProcState.DEAD, T0 + 2, signal=9)  # killed inside the call
    sim.end(2, EndKind.CLEAN_EXIT, T0 + 2)
    g = waits.graph(sim.job, T0 + 3, silence_after=5.0)
    assert g.waits == [Wait("0", 3, "all_reduce", (0,), (2,))]  # rank 1 is in the slot: 0 waits only for 2
    assert [(h.ranks, h.stand) for h in g.hangs()] == [((2,), Stand.ENDED)]
    assert g.stand(1) is Stand.DIED


def test_a_silent_member_is_frozen() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1, seq=3)
    sim.beat(T0 + 20, ranks=[0])
    g = waits.graph(sim.job, T0 + 20, silence_after=5.0)
    assert [(h.ranks, h.stand) for h in g.hangs()] == [((1,), Stand.FROZEN)]


def test_a_matched_send_and_recv_wait_on_the_transport_not_on_each_other() -> None:
    """The look-alike of a send/send deadlock: one side sends while the other receives."""
    sim = SimJob(2)
    sim.call(0, T0 + 1, op="send", peer=1, seq=1)
    sim.call(1, T0 + 1, op="recv", peer=0, seq=1)
    g = waits.graph(sim.job, T0 + 2, silence_after=5.0)
    assert g.waits == [] and g.hangs() == []


def test_two_sends_to_each_other_are_a_cycle() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1, op="send", peer=1, seq=1)
    sim.call(1, T0 + 1, op="send", peer=0, seq=1)
    (hang,) = waits.graph(sim.job, T0 + 2, silence_after=5.0).hangs()
    assert hang.cycle and hang.ranks == (0, 1)


def test_a_healthy_job_between_collectives_has_no_waits() -> None:
    sim = SimJob(4)
    for seq in range(1, 6):
        sim.collective(seq, T0 + seq)
    g = waits.graph(sim.job, T0 + 7, silence_after=5.0)
    assert g.waits == [] and g.hangs() == []


def test_status_shows_who_waits_for_whom_and_where_it_ends() -> None:
    sim = SimJob(4)
    for rk in (0, 1):
        sim.apply(group_event(rk, "1", (0, 1)), T0)
    sim.call(0, T0 + 1, seq=5, group="1")
    for rk in (2, 3):
        sim.call(rk, T0 + 2, op="barrier", seq=5, shape=None)
    sim.beat(T0 + 3)
    data = status_json(sim.job, T0 + 3, 5.0, {}, [])
    data["graph"] = waits.graph_json(waits.graph(sim.job, T0 + 3, 5.0))
    assert data["graph"]["hangs"] == [{"ranks": [1], "stand": "busy", "upstream": [0, 2, 3]}]
    out = io.StringIO()
    render_status(data, out)
    text = out.getvalue()
    assert "who waits for whom:\n" in text
    assert "  rank 0 waits in all_reduce (group 1, seq 5) for rank 1\n" in text
    assert "  ranks 2, 3 wait in barrier (group 0, seq 5) for ranks 0, 1\n" in text
    assert "  -> rank 1 is busy outside the call, holding up ranks 0, 2, 3\n" in text
