"""The coordinator's own lateness (``diagnosis.lag``) is never evidence against a rank."""

from __future__ import annotations

import pytest

from hangwatch.diagnosis.detectors import frozen
from hangwatch.diagnosis.lag import BASE_MAX_S, MIN_SAMPLES, WINDOW_S, Heard, Lag
from hangwatch.records import ProcState
from tests.factories import T0, SimJob, only, open_incidents


def test_behind_is_the_median_excess_of_recent_batches() -> None:
    lag = Lag()
    for _ in range(MIN_SAMPLES - 1):
        lag.observe(T0, 3.0)
    assert lag.behind(T0) == 0.0  # too few to tell
    lag.observe(T0, 3.0)
    assert lag.behind(T0 + 1) == 3.0
    for i in range(3 * MIN_SAMPLES):  # one rank's slow link among many prompt batches
        lag.observe(T0 + 1, 0.01 if i % 4 else 9.0)
    assert lag.behind(T0 + 2) < 0.1
    assert lag.behind(T0 + 2 + WINDOW_S + 1) == 0.0  # old samples say nothing
    assert lag.worst == 3.0


def test_a_coordinator_behind_its_batches_blames_no_rank_for_the_silence() -> None:
    """Saturated, the coordinator hears every rank late: a rank silent as long as it is behind
    is not frozen; one silent longer than that still is."""
    sim = SimJob(2)
    sim.collective(1, T0 + 1)
    sim.call(0, T0 + 2, seq=2)
    sim.beat(T0 + 2)
    sim.proc(1, ProcState.SLEEPING, T0 + 9)
    sim.beat(T0 + 9, ranks=[0])
    assert only(frozen.detect(sim.job, sim.ctx(T0 + 9)), "rank_frozen").culprit_ranks == [1]
    behind = sim.ctx(T0 + 9)
    behind.behind = 3.0  # silent 7 s, the coordinator 3 s behind: 4 s of it are the rank's
    assert frozen.detect(sim.job, behind) == []
    later = sim.ctx(T0 + 10.5)
    later.behind = 3.0
    assert only(frozen.detect(sim.job, later), "rank_frozen").culprit_ranks == [1]


def test_heard_is_the_frontier_of_most_ranks_past_its_least_distance() -> None:
    heard = Heard()
    on_time = [T0 - 0.05 * rk for rk in range(40)]  # forty ranks, each heard within 2 s
    assert heard.late(T0, lambda: on_time) == 0.0
    # one rank alone silent for a minute leaves the frontier where it is
    assert heard.late(T0 + 1, lambda: [t + 1 for t in on_time[1:]] + [T0 - 60]) < 0.1
    # everyone heard 4 s late: 4 s that no rank caused
    assert heard.late(T0 + 6, lambda: [t + 2 for t in on_time]) == pytest.approx(4.0)
    assert heard.late(T0 + 6.5, lambda: []) == pytest.approx(4.0)  # worked out once a second
    assert heard.late(T0 + 7, lambda: []) == 0.0  # nobody heard yet: nothing to tell
    assert heard.worst == pytest.approx(4.0)
    # a coordinator late from its start: at most BASE_MAX_S of it is taken as a healthy job's
    late = Heard()
    assert late.late(T0, lambda: [T0 - 5.0] * 8) == 5.0 - BASE_MAX_S


def test_a_coordinator_that_stalls_blames_none_of_the_ranks_it_has_not_caught_up_with() -> None:
    """The detectors held the state for 6 s (or gRPC queued its batches): it then takes the
    batches in the order they were sent, and a tick comes before it has caught up. Ranks whose
    next batch is still queued were heard 8 s ago, and none is frozen; the rank that really
    went silent is, before the stall and after it."""
    sim = SimJob(40)
    for rk in range(40):
        sim.proc(rk, ProcState.SLEEPING, T0)
    frozen_rank = 7
    t = T0
    sent: dict[int, float] = {}

    def send_until(until: float, arrive: float | None = None) -> None:
        # every rank sends every 2 s on its own phase; ``arrive``: the coordinator takes them then
        for rk in range(40):
            phase = T0 + 0.05 * rk
            at = sent.get(rk, phase - 2.0) + 2.0
            while at <= until:
                if not (rk == frozen_rank and at > T0 + 10):
                    sim.deliver(rk, [], arrive or at, sent_time=at)
                sent[rk] = at
                at += 2.0

    told = []
    while t < T0 + 20:
        send_until(t)
        told += sim.tick(t)
        t += 1.0
    assert [inc.culprit_ranks for inc in told] == [[frozen_rank]]
    # stalled from T0 + 20 to T0 + 26; by T0 + 26.5 it has taken what was sent up to T0 + 20.5:
    # ranks 11-20 were last heard at T0 + 18.5-19
    send_until(T0 + 20.5, arrive=T0 + 26.2)
    assert sim.job.behind(T0 + 26.5) > 4.0
    assert sim.tick(T0 + 26.5) == []
    assert [inc.culprit_ranks for inc in open_incidents(sim.tick_engine)] == [[frozen_rank]]


def test_a_whole_job_stopped_is_told_though_its_frontier_stops_with_it() -> None:
    """Every rank of a one-node job SIGSTOPped: nobody is heard, so the frontier falls behind
    with the silence; the agent's word, heard now, is that the processes are stopped."""
    sim = SimJob(4)
    for s in range(10):
        sim.beat(T0 + s)
        assert sim.tick(T0 + s) == []
    for s in range(10, 18):
        for rk in range(4):
            sim.proc(rk, ProcState.STOPPED, T0 + s)
        sim.tick(T0 + s)
    assert sim.job.behind(T0 + 17) > 5.0
    frozen_ranks = sorted(rk for inc in open_incidents(sim.tick_engine) for rk in inc.culprit_ranks)
    assert frozen_ranks == [0, 1, 2, 3]
