"""The coordinator's own lateness (``diagnosis.lag``) is never evidence against a rank."""

from __future__ import annotations

from hangwatch.diagnosis.detectors import frozen
from hangwatch.diagnosis.lag import MIN_SAMPLES, WINDOW_S, Lag
from hangwatch.records import ProcState
from tests.factories import T0, SimJob, only


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
