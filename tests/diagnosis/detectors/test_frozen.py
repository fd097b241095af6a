"""Detector ``frozen``: rank_frozen (silent, stopped or sleeping ranks).

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

from hangwatch.diagnosis.detectors import frozen, stuck
from hangwatch.records import (
    ProcState,
)
from tests.factories import T0, SimJob, only


def test_rank_frozen_stopped_or_sleeping() -> None:
    for state, text in ((ProcState.STOPPED, "is stopped"), (ProcState.SLEEPING, "holding the interpreter")):
        sim = SimJob(2)
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
    sim = SimJob(2)
    sim.proc(1, ProcState.STOPPED, T0 + 9)
    sim.beat(T0 + 9)
    assert frozen.detect(sim.job, sim.ctx(T0 + 9.5)) == []


def test_frozen_resolved_when_heartbeats_resume() -> None:
    sim = SimJob(2)
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


def test_a_rank_that_freezes_again_after_it_came_back_is_reported_again() -> None:
    """A first freeze resolves when the rank's heartbeats resume; the same rank freezing later
    (the same session) is a new incident, not the first one's key seen again and ignored."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    sim.proc(1, ProcState.STOPPED, T0 + 8)
    engine = sim.engine()
    sim.beat(T0 + 9, ranks=[0])
    (first,) = engine.tick(T0 + 9)
    sim.beat(T0 + 10, ranks=[0])
    assert engine.tick(T0 + 10) == []  # the same freeze, one tick later: the same incident
    sim.proc(1, ProcState.RUNNING, T0 + 11)
    sim.beat(T0 + 11)
    assert engine.tick(T0 + 11) == [] and first.status == "resolved"
    sim.beat(T0 + 20, ranks=[0])
    sim.proc(1, ProcState.STOPPED, T0 + 20)
    (second,) = engine.tick(T0 + 20)
    assert (second.kind, second.culprit_ranks, second.status) == ("rank_frozen", [1], "open")
    assert second.id != first.id and second.onset_time == T0 + 11


def test_most_of_the_job_silent_at_once_is_not_a_freeze() -> None:
    # an overloaded coordinator or a network cut silences everyone: not rank_frozen x N
    sim = SimJob(8)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    sim.beat(T0 + 20, ranks=[0, 1])  # six of eight ranks silent for 18 s
    assert frozen.detect(sim.job, sim.ctx(T0 + 20)) == []
    sim.beat(T0 + 20, ranks=[2, 3, 4, 5, 6])  # now only rank 7 is silent: that one is frozen
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 20)), "rank_frozen").culprit_ranks == [7]


def test_many_silent_ranks_on_many_hosts_need_an_agents_word() -> None:
    """64 ranks on 8 hosts: 20 silent on 3 hosts is an overloaded coordinator or the network,
    unless an agent sees one of them stopped; 8 silent on one host (a node) is reported."""
    sim = SimJob(64)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    sim.beat(T0 + 20, ranks=list(range(20, 64)))  # ranks 0-19 (hosts 0-2) silent for 18 s
    assert frozen.detect(sim.job, sim.ctx(T0 + 20)) == []
    sim.proc(5, ProcState.STOPPED, T0 + 20)
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 20)), "rank_frozen").culprit_ranks == [5]
    sim.beat(T0 + 20, ranks=list(range(0, 8)) + list(range(16, 20)))  # only node 1 (ranks 8-15) silent
    found = frozen.detect(sim.job, sim.ctx(T0 + 20))
    assert sorted(f.culprit_ranks[0] for f in found) == list(range(8, 16))


def test_ranks_whose_relay_went_silent_are_not_frozen() -> None:
    """The agent relaying node 1's ranks is killed: all eight fall silent together. That is the
    relay, not eight frozen ranks; a rank the same node's agent had seen stopped still is; and a
    rank silent alone behind a relay that still carries its neighbours is frozen."""
    sim = SimJob(24)
    sim.collective(1, T0 + 1)
    for st in sim.job.ranks.values():
        st.relay = f"node{st.rank // 8}"
    sim.beat(T0 + 2)
    others = [rk for rk in range(24) if not 8 <= rk < 16]
    sim.beat(T0 + 20, ranks=others)
    for rk in range(24):
        sim.job.ranks[rk].relay = f"node{rk // 8}"  # (beat records the header's relay: none)
    assert frozen.detect(sim.job, sim.ctx(T0 + 20)) == []
    sim.proc(9, ProcState.STOPPED, T0 + 20)
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 20)), "rank_frozen").culprit_ranks == [9]
    sim.beat(T0 + 20, ranks=[rk for rk in range(8, 16) if rk != 12])
    for rk in range(24):
        sim.job.ranks[rk].relay = f"node{rk // 8}"
    found = sorted(f.culprit_ranks[0] for f in frozen.detect(sim.job, sim.ctx(T0 + 20)))
    assert found == [12]  # its neighbours' heartbeats come through the relay: rank 12 froze


def test_a_few_ranks_silent_at_once_on_three_hosts_are_the_coordinators_stall() -> None:
    """16,384 ranks in a replay at full load: a stall of the coordinator left 8 ranks on 3 nodes
    unheard past the threshold (their batches were next when it stalled). Not 8 frozen ranks;
    an agent's word that one is stopped still makes it frozen, and a node's ranks silent
    together (one host) still are."""
    sim = SimJob(64)
    sim.collective(1, T0 + 1)
    sim.beat(T0 + 2)
    silent = [8, 9, 10, 11, 24, 25, 40, 41]  # hosts 1, 3 and 5
    sim.beat(T0 + 20, ranks=[rk for rk in range(64) if rk not in silent])
    assert frozen.detect(sim.job, sim.ctx(T0 + 20)) == []
    sim.proc(24, ProcState.STOPPED, T0 + 20)
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 20)), "rank_frozen").culprit_ranks == [24]
    sim.beat(T0 + 20, ranks=[24, 25, 40, 41])  # only host 1's four silent now
    assert sorted(f.culprit_ranks[0] for f in frozen.detect(sim.job, sim.ctx(T0 + 20))) == [8, 9, 10, 11]
