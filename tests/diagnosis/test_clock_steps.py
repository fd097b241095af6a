"""A rank's wall clock stepped by seconds (NTP stepping it, a VM migrated or resumed).

Ranks stamp their records with their wall clock; the coordinator maps each rank's times to its
own with a per-rank offset learnt from batches. Every batch also carries the sender's monotonic
clock, so a step of the wall clock shows at once as a change of (wall - monotonic) and the
offset is learnt afresh. Without that, a step back of under 30 s made every later call of the
rank look that much older: a burst of false hangs. Driven batch by batch through the real
``JobState.ingest`` and ``Engine`` (``tests.factories.SimJob``).
"""

from __future__ import annotations

import dataclasses
import itertools

from hangwatch import records as r
from tests.factories import T0, SimJob, call, call_exit

TRANSIT = 0.003  # seconds a batch travels


class Rank:
    """A rank whose wall clock reads ``true + skew``; it sends a batch of its calls every tick."""

    def __init__(self, sim: SimJob, rank: int, mono: bool = True) -> None:
        self.sim, self.rank, self.mono = sim, rank, mono
        self.skew = 0.0
        self.pending: list[tuple[float, r.CallRecord | r.CallExit]] = []
        self.ids = itertools.count(1 + 1000 * rank)

    def wall(self, true: float) -> float:
        return true + self.skew

    def all_reduce(self, seq: int, true: float, duration: float | None) -> None:
        """Enters at ``true``; returns ``duration`` later (None: never). Each record is stamped by
        the wall clock as it reads when the event happens."""
        record = call(self.rank, seq, call_id=next(self.ids))
        self.pending.append((true, record))
        if duration is not None:
            self.pending.append((true + duration, call_exit(self.rank, record.call_id, 0.0)))

    def send(self, true: float) -> None:
        due = [(t, e) for t, e in self.pending if t <= true]
        self.pending = [(t, e) for t, e in self.pending if t > true]
        events = []
        for t, event in due:  # stamped when it happened, by the clock as it read then
            if isinstance(event, r.CallRecord):
                event.enter_time = self.wall(t)
            else:
                event = dataclasses.replace(event, exit_time=self.wall(t))
            events.append(event)
        mono = true - 5_000.0 if self.mono else 0.0  # CLOCK_MONOTONIC: since boot, never stepped
        self.sim.deliver(self.rank, events, true + TRANSIT, sent_time=self.wall(true), mono_time=mono)


def _run(
    sim: SimJob, ranks: list[Rank], seconds: int, *, step_at: float, step: float, stop_rank_1_at: float = 1e9
) -> list[str]:
    engine = sim.engine(stuck_after=5.0)
    kinds: list[str] = []
    for tick in range(seconds * 5):
        true = T0 + tick * 0.2
        if abs(true - step_at) < 1e-9:
            ranks[1].skew += step
        if tick % 5 == 0:
            seq = tick // 5 + 1
            for rank in ranks:
                if rank.rank == 1 and true >= stop_rank_1_at:
                    continue
                # rank 0 arrives a batch later than rank 1, and the collective lasts past the
                # next batch: open calls, in slots one rank has not reached yet, cross batches
                hung = rank.rank == 0 and true >= stop_rank_1_at
                rank.all_reduce(seq, true + (0.25 if rank.rank == 0 else 0.0), duration=None if hung else 0.3)
        for rank in ranks:
            rank.send(true + 0.1)
        kinds += [i.kind for i in engine.tick(true + 0.15)]
    return kinds


def test_a_clock_stepped_back_20_s_raises_no_false_hang() -> None:
    sim = SimJob(2)
    ranks = [Rank(sim, 0), Rank(sim, 1)]
    assert _run(sim, ranks, 60, step_at=T0 + 10.0, step=-20.0) == []
    assert sim.states[1].clock_steps == 1


def test_a_clock_stepped_forward_raises_no_false_hang_and_blames_no_one_early() -> None:
    sim = SimJob(2)
    ranks = [Rank(sim, 0), Rank(sim, 1)]
    assert _run(sim, ranks, 60, step_at=T0 + 10.0, step=+20.0) == []


def test_a_real_hang_after_a_step_is_still_found_and_blames_the_right_rank() -> None:
    sim = SimJob(2)
    ranks = [Rank(sim, 0), Rank(sim, 1)]
    kinds = _run(sim, ranks, 40, step_at=T0 + 10.0, step=-20.0, stop_rank_1_at=T0 + 25.0)
    assert kinds == ["stuck_collective"]


def test_without_the_monotonic_clock_a_small_step_is_what_it_was() -> None:
    """An older hook (no ``mono_time``): a step under 30 s is not seen; one of an hour is."""
    sim = SimJob(2)
    ranks = [Rank(sim, 0, mono=False), Rank(sim, 1, mono=False)]
    _run(sim, ranks, 20, step_at=T0 + 10.0, step=-3600.0)
    assert sim.states[1].clock_steps == 1


def test_without_the_monotonic_clock_a_step_back_of_20_s_raises_no_false_hang() -> None:
    """A client that sends no ``mono_time`` (an older hook, or one that omits it): a step back
    under ``CLOCK_STEP_S`` made every later call of the rank look 20 s older, a burst of false
    hangs. A few batches in a row that late move its offset, later: a judgement can only wait."""
    sim = SimJob(2)
    ranks = [Rank(sim, 0, mono=False), Rank(sim, 1, mono=False)]
    assert _run(sim, ranks, 60, step_at=T0 + 10.0, step=-20.0) == []
    assert sim.states[1].clock_steps == 1


def test_without_the_monotonic_clock_a_real_hang_after_a_step_back_is_found() -> None:
    sim = SimJob(2)
    ranks = [Rank(sim, 0, mono=False), Rank(sim, 1, mono=False)]
    assert _run(sim, ranks, 40, step_at=T0 + 10.0, step=-20.0, stop_rank_1_at=T0 + 25.0) == ["stuck_collective"]
