"""Detector ``straggler``: the same rank last to arrive, slot after slot.

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context, straggler
from hangwatch.diagnosis.state.base import ARRIVALS_SPREAD_S
from tests.factories import T0, SimJob, call, only


def _arrivals(last_of: Callable[[int], int], n: int = 4, slots: int = 20, lag: float = 1.0) -> SimJob:
    sim = SimJob(n)
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


def test_one_hang_in_the_window_is_not_a_straggler() -> None:
    """Rank 1 comes a few milliseconds after rank 0 at every slot (2 ranks: someone is last), and
    once 30 s late: that was a hang (its own incident), not a persistently late rank."""
    sim = SimJob(2)
    for seq in range(1, 22):
        t = T0 + seq * 40
        sim.call(0, t, seq=seq)
        sim.call(1, t + (30.0 if seq == 20 else 0.005), seq=seq)
        for rk in range(2):
            sim.exit(sim.states[rk].open_calls[max(sim.states[rk].open_calls)], t + 30.1)
    assert straggler.detect(sim.job, sim.ctx(T0 + 900)) == []


def test_the_culprit_of_an_open_hang_is_not_also_a_straggler() -> None:
    sim = _arrivals(lambda seq: 2)
    ctx = sim.ctx(T0 + 200)
    ctx.hangs[2] = "stuck:0:21"
    assert straggler.detect(sim.job, ctx) == []


def test_the_window_is_the_latest_seqs_whatever_order_they_completed_in() -> None:
    """Found by review: slots and runs complete in the order their last rank's batch comes, so
    ``arrivals`` may hold seqs out of order, and "the last 20" taken in that order differed
    between calls sent one by one and in runs (the same straggler, told with another onset)."""
    sim = _arrivals(lambda seq: 2, slots=24)
    arrivals = sim.job.arrivals["0"]
    in_order = straggler.detect(sim.job, sim.ctx(T0 + 200))
    shuffled = sorted(arrivals, key=lambda a: (a[2] % 3, a[2]))  # every third seq completed late, say
    arrivals.clear()
    arrivals.extend(shuffled)
    (f,) = straggler.detect(sim.job, sim.ctx(T0 + 200))
    assert (f.onset_time, f.seq) == (in_order[0].onset_time, in_order[0].seq) == (T0 + 5 * 5, 24)


def _delivered(late: int, lag: float, waited: float) -> SimJob:
    """Four ranks' 24 collectives, each a batch of its own sent at once (``JobState.ingest``):
    rank ``late`` enters ``lag`` s after the others, and each of its batches waits ``waited`` s
    more than theirs before the coordinator takes it (its clock offset that much too late)."""
    sim = SimJob(4, registered=T0)
    for seq in range(1, 25):
        t = T0 + seq * 5
        for rk in range(4):
            enter = t + (lag if rk == late else 0.01 * rk)
            done = enter + 0.05 if rk == late else t + lag + 0.05
            delay = 0.002 + (waited if rk == late else 0.0)
            sim.deliver(rk, [call(rk, seq, call_id=seq, enter_time=enter, exit_time=done)], done + delay,
                        sent_time=done)  # fmt: skip
    return sim


def test_a_rank_whose_batches_all_waited_is_no_straggler() -> None:
    """Every batch of rank 2 waited 0.7 s in a saturated coordinator's queue: its times map 0.7 s
    late and it arrives last everywhere, by that much. Not a straggler: the others' batches did
    not wait. A rank that is truly 0.7 s late, its batches on time, still is one."""
    waited = _delivered(2, 0.0, 0.7)
    assert {a[0] for a in waited.job.arrivals["0"]} == {2}
    assert straggler.detect(waited.job, waited.ctx(T0 + 200)) == []
    late = _delivered(2, 0.7, 0.0)
    f = only(straggler.detect(late.job, late.ctx(T0 + 200)), "straggler")
    assert f.culprit_ranks == [2]
    both = _delivered(2, 1.4, 0.7)  # late by 1.4 s, of which 0.7 s its batches' wait
    assert only(straggler.detect(both.job, both.ctx(T0 + 200)), "straggler").culprit_ranks == [2]


def _hundreds_in_runs(late_at: Callable[[int], int], read: Callable[[SimJob], None]) -> SimJob:
    """300 ranks whose calls come in runs, 40 collectives a second for 24 s, each second's batch
    of rank ``late_at(second)`` 0.9 s late; ``read`` after each second, as the detector reads."""
    n = 300
    sim = SimJob(n)
    for rk in range(n):
        sim.apply(call(rk, 1, call_id=1, enter_time=T0, exit_time=T0 + 0.1), T0)
    template = dataclasses.replace(call(0, 0, call_id=0), exit_time=None)
    seq = 2
    for tick in range(1, 25):
        now = T0 + tick
        late = late_at(tick)
        for rk in range(n):
            times = [now - 1 + 0.025 * i + (0.9 if rk == late else 0.0) for i in range(40)]
            run = r.CallRun(rk, dataclasses.replace(template, rank=rk), seq, seq, 0, times, [t + 0.001 for t in times])
            sim.deliver(rk, [run], now + 1, sent_time=now + 1)
        seq += 40
        read(sim)
    return sim


def test_a_straggler_among_hundreds_in_runs_is_found_from_a_sample_spread_in_time() -> None:
    """300 ranks whose calls come in runs, 40 collectives a second: a read counts a few of the
    newest (each costs a sort of 300 arrivals), half a second apart at least, so that the rank
    named is last across seconds of batches (here one a second, the newest of each batch);
    that sample names the rank that is always last."""
    late = 17

    def spread(sim: SimJob) -> None:
        firsts = [first for _, _, _, first in sim.job.arrivals["0"]]
        assert all(b - a >= ARRIVALS_SPREAD_S for a, b in itertools.pairwise(firsts[1:]))  # (the first: a slot)

    sim = _hundreds_in_runs(lambda tick: late, spread)
    assert sim.job.runs_taken == 24 * 300
    found = only(straggler.detect(sim.job, sim.ctx(T0 + 26)), "straggler")
    assert found.culprit_ranks == [late]


def test_batches_mapped_late_by_turns_among_hundreds_raise_no_straggler() -> None:
    """The look-alike: 300 healthy ranks, and at each read one rank's batch, a different one
    each time, mapped 0.9 s late (a coordinator late for a moment as it took it). Every
    collective of that batch has it last; the sample, one collective a read, names no rank
    persistently last."""

    def read(sim: SimJob) -> None:
        assert sim.job.arrivals["0"]  # read every tick, as the detector does

    sim = _hundreds_in_runs(lambda tick: 7 * tick % 300, read)
    assert len(sim.job.arrivals["0"]) >= 20
    assert straggler.detect(sim.job, sim.ctx(T0 + 26)) == []
