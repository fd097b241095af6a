"""Detector ``stuck`` on NCCL: a rank waits in a collective from its enqueue to its completion.

The progress each rank's node agent reads from its NCCL Flight Recorder ring (enqueued /
started / completed seq, torch's ``timeout_ms``) is applied as ``GroupProgress`` events; the
host threads of waiting ranks returned and sit at the next CUDA synchronisation (``.item()``).
Each fault has its healthy look-alike beside it. Explicit clock (``tests.factories.SimJob``).
"""

from __future__ import annotations

from hangwatch import config
from hangwatch.diagnosis.detectors import stuck
from tests.factories import T0, SimJob, only

ITEM = "train.py:57 in train_step"  # where the host thread blocks: loss.item()


def _enqueue(sim: SimJob, rank: int, seq: int, t: float) -> None:
    """``rank``'s host enqueues the collective ``seq`` at ``t`` and returns a millisecond later."""
    sim.exit(sim.call(rank, t, seq=seq, site="train.py:50 in train_step"), t + 0.001)


def _watched(n: int, timeout_ms: int = 600_000, started: int = -1) -> SimJob:
    sim = SimJob(n)
    for rk in range(n):
        sim.progress(rk, T0, enqueued=0, completed=0, started=started, timeout_ms=timeout_ms)
    return sim


def _progress_all(sim: SimJob, t: float, ranks: list[int], **kw: int) -> None:
    for rk in ranks:
        sim.progress(rk, t, timeout_ms=600_000, **kw)


def test_a_rank_that_never_enqueues_is_blamed_while_the_others_wait_on_the_gpu() -> None:
    """Rank 1 skipped the all_reduce. Ranks 0 and 2 enqueued it and their host threads went
    on to ``loss.item()``: without the device's view they would look "running"."""
    sim = _watched(3)
    _enqueue(sim, 0, 1, T0 + 1)
    _enqueue(sim, 2, 1, T0 + 1)
    for t in range(2, 14):
        _progress_all(sim, T0 + t, [0, 2], enqueued=1, completed=0)
        _progress_all(sim, T0 + t, [1], enqueued=0, completed=0)
        sim.beat(T0 + t, [0, 2], where_user=ITEM)
        sim.beat(T0 + t, [1], where_user="train.py:90 in save_checkpoint")
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 13)), "stuck_collective")
    assert f.culprit_ranks == [1] and f.waiting_ranks == [0, 2]
    assert "ranks 0, 2 enqueued it on the GPU, where it has not completed" in f.summary
    assert f"rank 0 in {ITEM}" in f.summary and "rank 1 is busy in train.py:90 in save_checkpoint" in f.summary
    assert "torch's own timeout fires at" in f.summary
    assert f.details["host"] == {"0": ITEM, "2": ITEM}
    assert f.details["timeout_at"] == T0 + 1 + 600


def test_healthy_nccl_ranks_whose_gpu_completes_raise_nothing() -> None:
    """The look-alike: every rank enqueues and returns at once, step after step, and the GPU
    completes each collective within a second; hosts sit in ``.item()`` most of the time."""
    sim = _watched(3)
    engine = sim.engine(stuck_after=5.0)
    for step in range(1, 60):
        t = T0 + step
        for rk in range(3):
            _enqueue(sim, rk, step, t)
        _progress_all(sim, t + 0.5, [0, 1, 2], enqueued=step, completed=step - 1)
        sim.beat(t + 0.5, where_user=ITEM)
        assert engine.tick(t + 0.6) == []
        _progress_all(sim, t + 0.9, [0, 1, 2], enqueued=step, completed=step)
    assert all(not st.open_calls for st in sim.states.values())


def test_a_gpu_behind_its_host_by_more_than_the_threshold_is_not_a_hang_while_all_ranks_enqueued() -> None:
    """Every rank enqueued the collective and the GPU is busy with compute queued before it
    (a long backward): nobody is absent, and without start events it is not a stall yet."""
    sim = _watched(2)
    for rk in range(2):
        _enqueue(sim, rk, 1, T0 + 1)
    for t in range(2, 60):
        _progress_all(sim, T0 + t, [0, 1], enqueued=1, completed=0)
        sim.beat(T0 + t, where_user=ITEM)
    assert stuck.detect(sim.job, sim.ctx(T0 + 59)) == []


def test_transport_stall_when_every_rank_started_it_on_the_gpu_and_none_completes() -> None:
    sim = _watched(2, started=0)  # start events on (TORCH_NCCL_ENABLE_TIMING=1)
    for rk in range(2):
        _enqueue(sim, rk, 1, T0 + 1)
    for t in range(2, 14):
        _progress_all(sim, T0 + t, [0, 1], enqueued=1, started=1, completed=0)
        sim.beat(T0 + t, where_user=ITEM)
    f = only(stuck.detect(sim.job, sim.ctx(T0 + 13)), "transport_stall")
    assert "none has completed on the GPU (started on every rank)" in f.summary
    assert f.culprit_ranks == [] and f.waiting_ranks == [0, 1]


def test_no_stall_while_one_rank_has_not_started_it() -> None:
    """Start events on, rank 1's GPU has not started the kernel: it is still behind on its
    stream, which is not a stalled transport."""
    sim = _watched(2, started=0)
    for rk in range(2):
        _enqueue(sim, rk, 1, T0 + 1)
    for t in range(2, 14):
        _progress_all(sim, T0 + t, [0], enqueued=1, started=1, completed=0)
        _progress_all(sim, T0 + t, [1], enqueued=1, started=0, completed=0)
        sim.beat(T0 + t, where_user=ITEM)
    assert stuck.detect(sim.job, sim.ctx(T0 + 13)) == []


def test_without_start_events_a_stall_is_called_only_after_the_long_wait() -> None:
    sim = _watched(2)
    for rk in range(2):
        _enqueue(sim, rk, 1, T0 + 1)
    last = int(config.STALL_UNSTARTED_S) + 3
    for t in range(2, last + 1):
        _progress_all(sim, T0 + t, [0, 1], enqueued=1, completed=0)
        sim.beat(T0 + t, where_user=ITEM)
        if t < config.STALL_UNSTARTED_S:
            assert stuck.detect(sim.job, sim.ctx(T0 + t)) == [], t
    f = only(stuck.detect(sim.job, sim.ctx(T0 + last)), "transport_stall")
    assert "whether it started is unknown without TORCH_NCCL_ENABLE_TIMING=1" in f.summary


def test_a_rank_whose_progress_stops_coming_is_not_held_in_the_call() -> None:
    """Rank 0's agent died: its progress stops. Its call counts as complete at its return, so
    the other rank, still watched and waiting on its GPU, is not blamed on rank 0."""
    sim = _watched(2)
    engine = sim.engine(stuck_after=5.0)
    _enqueue(sim, 0, 1, T0 + 1)
    _enqueue(sim, 1, 1, T0 + 1)
    for t in range(2, 30):
        _progress_all(sim, T0 + t, [1], enqueued=1, completed=1)
        sim.beat(T0 + t, where_user=ITEM)
        assert engine.tick(T0 + t) == [], t
    assert not sim.states[0].open_calls and not sim.states[1].open_calls
