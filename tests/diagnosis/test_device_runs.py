"""Runs of calls on the device (NCCL): taken whole, open only where the device stops at one.

On NCCL a rank's host returns from a collective when it is enqueued, and the job state holds the
call open until the rank's device progress (read by its node agent from Flight Recorder)
completes it (``test_completion.py``). Calls that come as a run (``records.CallRun``) are taken
whole however far the device is behind: the calls it has not completed are noted
(``OnDevice``), and made the open calls in slots they would be call by call only where the
device stops moving at one. Each scenario below is played twice, its calls alone and as runs,
through the real ``JobState`` and engine (``tests.factories.SimJob``): what the detectors tell
must be the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.incidents import Incident
from hangwatch.diagnosis.state import PROGRESS_FRESH_S
from tests.diagnosis.test_budget import audit
from tests.factories import T0, SimJob, call, group_event

ITEM = "train.py:57 in train_step"  # where a host thread blocks after enqueueing: loss.item()
SITE = "train.py:50 in train_step"


def _watched(n: int, started: int = -1) -> SimJob:
    sim = SimJob(n)
    for rk in range(n):
        sim.progress(rk, T0, enqueued=0, completed=0, started=started, timeout_ms=600_000)
    return sim


def _enqueue(sim: SimJob, rank: int, first: int, last: int, t: float, runs: bool, gap: float = 0.01) -> float:
    """``rank``'s host enqueues the collectives ``first`` to ``last`` from ``t``, each returned a
    millisecond after it began; they arrive at the last one's return, as one run (``runs``) or
    call by call. The time they arrived."""
    n = last - first + 1
    ids = [next(sim.ids) for _ in range(n)]
    enters = [t + i * gap for i in range(n)]
    exits = [e + 0.001 for e in enters]
    arrived = exits[-1]
    if runs and n > 1:
        template = call(rank, 0, call_id=0, call_site=SITE)
        sim.apply(r.CallRun(rank, template, ids[0], first, 0, enters, exits), arrived)
    else:
        for i in range(n):
            sim.apply(
                call(rank, first + i, enter_time=enters[i], exit_time=exits[i], call_id=ids[i], call_site=SITE), arrived
            )
    return arrived


def _first_calls(sim: SimJob, runs: bool) -> None:
    """Every rank's first call on the group: alone (a signature's first call always is), and
    completed on the device at once."""
    for rk in sim.states:
        _enqueue(sim, rk, 1, 1, T0 + 0.5, runs)
        sim.progress(rk, T0 + 0.9, enqueued=1, completed=1, timeout_ms=600_000)


def _findings(incidents: list[Incident]) -> list[tuple[object, ...]]:
    return [
        (str(i.kind), i.summary, tuple(i.culprit_ranks), tuple(i.waiting_ranks), i.group, i.seq, i.onset_time)
        for i in incidents
    ]


def _play(
    runs: bool, scenario: Callable[[SimJob, bool], None], n: int = 3, started: int = -1
) -> tuple[SimJob, list[tuple[object, ...]]]:
    sim = _watched(n, started)
    _first_calls(sim, runs)
    scenario(sim, runs)
    audit(sim.job)  # what it is charged is what it holds, notes on the device included
    return sim, _findings(list(sim.tick_engine.incidents.values()))


def _steps(
    sim: SimJob, runs: bool, *, lag: float, seconds: int, absent: int | None = None, stop_at: int | None = None
) -> None:
    """A loop of 20 collectives a second on every rank, read as a node agent reads: each
    second's calls in a batch, then the device's progress. The device completes a call ``lag``
    seconds after it returned. With ``stop_at``, rank ``absent`` never enqueues that seq (busy
    elsewhere), the others' hosts enqueue it and block at the next ``.item()``, and no device
    completes it. The engine ticks after each second."""

    def entered(seq: int) -> float:
        return T0 + 1 + (seq - 2) // 20 + ((seq - 2) % 20) * 0.04

    def last_of(rank: int, hi: int) -> int:
        return hi if stop_at is None else min(hi, stop_at - 1 if rank == absent else stop_at)

    for s in range(1, seconds + 1):
        t = T0 + s
        lo, hi = 2 + 20 * (s - 1), 1 + 20 * s
        for rk in sim.states:
            if last_of(rk, hi) >= lo:
                _enqueue(sim, rk, lo, last_of(rk, hi), t, runs, gap=0.04)
        read = t + 0.95
        for rk in sim.states:
            enqueued = completed = max(1, last_of(rk, hi))
            while completed > 1 and entered(completed) + 0.001 + lag > read:
                completed -= 1
            if stop_at is not None:
                completed = min(completed, stop_at - 1)
            sim.progress(rk, read, enqueued=enqueued, completed=completed, timeout_ms=600_000)
        sim.beat(read, where_user=ITEM)
        sim.tick(read + 0.01)
        audit(sim.job)


def test_a_run_on_the_device_is_taken_whole_and_completed_by_progress_as_its_calls_would_be() -> None:
    """A run whose calls the device has not completed when it arrives: no call, slot or open
    call each; the next progress read completes them, and the job keeps the same waits (what
    the stuck threshold learns from) and, once complete, the same bytes as for calls alone."""
    waits = {}
    for runs in (False, True):
        sim = _watched(2)
        _first_calls(sim, runs)
        for rk in (0, 1):
            _enqueue(sim, rk, 2, 41, T0 + 1, runs)
        job = sim.job
        if runs:
            assert job.device_calls == 80 and job.run_calls == 80
            assert set(job.slots.get("0", {})) <= {1}
            assert all(not st.open_calls and len(st.on_device["0"]) == 1 for st in sim.states.values())
        else:
            assert all(len(st.open_calls) == 40 for st in sim.states.values())
        for rk in (0, 1):
            sim.progress(rk, T0 + 2, enqueued=41, completed=30, completed_time=T0 + 1.9, timeout_ms=600_000)
        for rk in (0, 1):
            sim.progress(rk, T0 + 3, enqueued=41, completed=41, completed_time=T0 + 2.5, timeout_ms=600_000)
        assert all(not st.open_calls and not st.on_device for st in sim.states.values())
        assert job.device_opened == 0
        waits[runs] = sorted(job.wait_durations)
    assert waits[True] == waits[False]


def test_what_runs_on_the_device_hold_is_let_go_as_progress_completes_them() -> None:
    """Bytes: a job that took runs on the device holds, once progress completed them, what the
    same runs hold where no device is watched (gloo), but for the progress tables themselves."""
    held = {}
    for watched in (False, True):
        sim = _watched(2) if watched else SimJob(2)
        if watched:
            _first_calls(sim, True)
        for rk in (0, 1):
            if not watched:
                _enqueue(sim, rk, 1, 1, T0 + 0.5, runs=True)
            _enqueue(sim, rk, 2, 41, T0 + 1, runs=True)
        if watched:
            assert all(st.on_device for st in sim.states.values())
            for rk in (0, 1):
                sim.progress(rk, T0 + 2, enqueued=41, completed=41, timeout_ms=600_000)
            assert all(not st.on_device for st in sim.states.values())
        held[watched] = sim.job.held - (2 * (b.PROGRESS_BYTES + b.text_bytes("0")) if watched else 0)
    assert held[True] == held[False]


def test_progress_that_stops_coming_lets_go_of_the_runs_on_the_device() -> None:
    sim = _watched(2)
    _first_calls(sim, True)
    before = {rk: st.held for rk, st in sim.states.items()}
    for rk in (0, 1):
        _enqueue(sim, rk, 2, 41, T0 + 1, runs=True)
    assert all(st.on_device for st in sim.states.values())
    sim.job.lapse_progress(T0 + 1.1 + PROGRESS_FRESH_S + 1)
    for rk, st in sim.states.items():
        assert not st.on_device and not st.open_calls
        assert st.held == before[rk] - b.PROGRESS_BYTES - b.text_bytes("0") + b.run_bytes(40)  # its run, kept


def test_a_healthy_device_behind_its_host_by_more_than_a_read_raises_nothing_and_opens_nothing() -> None:
    """The look-alike of a device that stopped: every rank's device is 1.5 s behind its host,
    more than a read apart, but moves at every read. With runs no call is ever made open."""
    for runs in (False, True):
        sim, found = _play(runs, lambda sim, runs: _steps(sim, runs, lag=1.5, seconds=40))
        assert found == []
        if runs:
            assert sim.job.device_opened == 0 and sim.job.device_calls > 2000
            assert set(sim.job.slots.get("0", {})) <= {1}


@pytest.mark.parametrize("absent", [0, 2])
def test_a_rank_that_never_enqueues_is_told_the_same_with_runs_on_the_device(absent: int) -> None:
    """Rank ``absent`` never enqueues seq 150 (busy elsewhere); the others' hosts enqueued it
    in a run and block at the next ``.item()``, their devices stopped at it: the same
    ``stuck_collective``, the same culprit, waiters, seq and onset, whether their calls came
    alone or as runs (then made open calls where the devices stopped)."""
    told = {}
    for runs in (False, True):
        sim, found = _play(runs, lambda sim, runs: _steps(sim, runs, lag=0.2, seconds=20, absent=absent, stop_at=150))
        told[runs] = found
        if runs:
            assert 0 < sim.job.device_opened <= 2 * len(sim.states)
    assert told[True] == told[False]
    assert len(told[True]) == 1 and told[True][0][0] == "stuck_collective"
    assert told[True][0][2] == (absent,) and told[True][0][5] == 150


def test_a_transport_stall_is_told_the_same_with_runs_on_the_device() -> None:
    """Every rank enqueued seq 150 and its device started it (start events on) and never
    completes it: a ``transport_stall`` on every rank, alone or as runs."""

    def stall(sim: SimJob, runs: bool) -> None:
        _steps(sim, runs, lag=0.2, seconds=8, stop_at=150)
        for s in range(9, 25):  # the devices started it: still there at every read
            t = T0 + s
            for rk in sim.states:
                sim.progress(rk, t + 0.95, enqueued=150, started=150, completed=149, timeout_ms=600_000)
            sim.beat(t + 0.95, where_user=ITEM)
            sim.tick(t + 0.96)

    told = {runs: _play(runs, stall, started=0)[1] for runs in (False, True)}
    assert told[True] == told[False]
    assert [f[0] for f in told[True]] == ["transport_stall"]


def test_a_slot_made_where_a_run_is_on_the_device_holds_that_call_open() -> None:
    """Rank 1's run through seq 20 is on its device; rank 0's call at seq 20 comes alone (a
    new call site) and makes a slot: rank 1's call there is open, as it is on its device, and
    its progress closes it."""
    sim = _watched(2)
    _first_calls(sim, True)
    _enqueue(sim, 1, 2, 30, T0 + 1, runs=True)
    _enqueue(sim, 0, 2, 19, T0 + 1, runs=True)
    rec = call(0, 20, enter_time=T0 + 1.2, exit_time=T0 + 1.201, call_id=next(sim.ids), call_site="train.py:51")
    sim.apply(rec, T0 + 1.21)
    slot = sim.job.slots["0"][20]
    held = slot.calls[1]
    assert held.exit_time is None and held.returned_time is not None
    assert sim.states[1].open_calls == {held.call_id: held} and slot.open == 2
    audit(sim.job)
    for rk in (0, 1):
        sim.progress(rk, T0 + 2, enqueued=30 if rk else 20, completed=30 if rk else 20, timeout_ms=600_000)
    assert slot.open == 0 and not sim.states[1].open_calls and not sim.states[1].on_device


def test_a_device_far_behind_that_pauses_raises_nothing_though_every_host_passed_the_seq_long_ago() -> None:
    """Hosts run 100 collectives/s ahead of GPUs that pause before seq 50 (a long kernel), more
    than the runs the job keeps past the slowest host. Rank 0's reads find the pause first and
    make seq 50 an open call: the others' calls there must be in its slot (their runs kept while
    a device holds that seq), not told absent."""

    def pause(sim: SimJob, runs: bool) -> None:
        sim.tick_engine.stuck_after_override = 5.0
        for rk in range(3):
            _enqueue(sim, rk, 2, 101, T0 + 1, runs)
            _enqueue(sim, rk, 102, 201, T0 + 2, runs)
        for rk in range(3):
            sim.progress(rk, T0 + 3.0, enqueued=201, completed=49, timeout_ms=600_000)
        sim.progress(0, T0 + 6.5, enqueued=201, completed=49, timeout_ms=600_000)
        sim.beat(T0 + 6.6, where_user=ITEM)
        sim.tick(T0 + 6.6)
        for rk in (1, 2):
            sim.progress(rk, T0 + 7.0, enqueued=201, completed=49, timeout_ms=600_000)
        for rk in range(3):
            sim.progress(rk, T0 + 8.0, enqueued=201, completed=201, timeout_ms=600_000)
        sim.beat(T0 + 8.1, where_user=ITEM)
        sim.tick(T0 + 8.1)

    for runs in (False, True):
        sim, found = _play(runs, pause)
        assert found == [], runs
    assert sim.job.device_opened >= 1


@pytest.mark.parametrize("hang", [False, True])
def test_a_stop_below_a_call_sent_alone_is_told_at_its_own_seq(hang: bool) -> None:
    """Every rank's device stops at seq 300 (a transport stall; or rank 2 never enqueues it, a
    hang), and each rank's call at 320 came alone (another shape), making its slot first: the
    slot made where the devices stopped goes below it, and the stop is told at 300."""

    def stop(sim: SimJob, runs: bool) -> None:
        ranks = (0, 1) if hang else (0, 1, 2)
        for rk in range(3):
            _enqueue(sim, rk, 2, 299, T0 + 1, runs, gap=0.005)
        for rk in ranks:
            _enqueue(sim, rk, 300, 319, T0 + 2.5, runs, gap=0.005)
            sim.apply(
                call(rk, 320, enter_time=T0 + 2.7, exit_time=T0 + 2.701, call_id=next(sim.ids), shape=(8,)), T0 + 2.71
            )
            _enqueue(sim, rk, 321, 340, T0 + 2.8, runs, gap=0.005)
        for s in range(3, 40):
            for rk in range(3):
                mine = rk in ranks
                sim.progress(rk, T0 + s, enqueued=340 if mine else 299, started=300 if mine else 299, completed=299)
            sim.beat(T0 + s + 0.1, where_user=ITEM)
            sim.tick(T0 + s + 0.1)

    told = {runs: _play(runs, stop, started=0)[1] for runs in (False, True)}
    assert told[True] == told[False]
    assert [(f[0], f[2], f[5]) for f in told[True]] == [
        ("stuck_collective", (2,), 300) if hang else ("transport_stall", (), 300)
    ]


def test_reads_of_a_group_made_anew_open_no_call_of_the_numbering_before() -> None:
    """An in-process restart: rank 0's GPU had not completed old seqs 91..101 at its last read of
    the old communicator; ranks 1 and 2 make the group anew first, and rank 0's agent reads the
    new communicator (enqueued 40, completed 1, twice) before rank 0's first new call comes.
    Those reads say nothing of the old calls: none is made open (a false hang at seq 91)."""

    def restart(sim: SimJob, runs: bool) -> None:
        for rk in range(3):
            _enqueue(sim, rk, 2, 101, T0 + 1, runs)
            sim.progress(rk, T0 + 2.0, enqueued=101, completed=90, timeout_ms=600_000)
        for rk in (1, 2):
            sim.apply(group_event(rk, "0", (0, 1, 2), T0 + 3.0, backend="nccl", index=2), T0 + 3.4)
            sim.apply(call(rk, 1, enter_time=T0 + 3.4, exit_time=T0 + 3.401, call_id=next(sim.ids)), T0 + 3.5)
            sim.progress(rk, T0 + 4.0, enqueued=1, completed=1, timeout_ms=600_000)
            _enqueue(sim, rk, 2, 40, T0 + 4.1, runs)
            sim.progress(rk, T0 + 5.5, enqueued=40, completed=1, timeout_ms=600_000)
        for t in (6.0, 7.0):
            sim.progress(0, T0 + t, enqueued=40, completed=1, timeout_ms=600_000)
        sim.beat(T0 + 7.1, where_user=ITEM)
        sim.tick(T0 + 7.1)

    def made(sim: SimJob, runs: bool) -> None:
        for rk in range(3):
            sim.apply(group_event(rk, "0", (0, 1, 2), T0, backend="nccl", index=1), T0)
        restart(sim, runs)

    for runs in (False, True):
        sim, found = _play(runs, made)
        assert found == [], runs
    assert sim.job.device_opened == 0


def test_a_call_a_slot_took_from_a_run_on_the_device_keeps_one_wait() -> None:
    """Rank 0's run through seq 20 is on its device and a slot waits at seq 20 (rank 1's call
    there came alone): the call is made whole and open there, and when progress completes it,
    its wait is kept once, as call by call."""
    waits = {}
    for runs in (False, True):
        sim = _watched(2)
        _first_calls(sim, runs)
        sim.apply(call(1, 20, enter_time=T0 + 1.1, exit_time=T0 + 1.101, call_id=next(sim.ids), shape=(8,)), T0 + 1.2)
        _enqueue(sim, 0, 2, 40, T0 + 1, runs)
        for rk in (0, 1):
            sim.progress(rk, T0 + 2, enqueued=40 if rk == 0 else 20, completed=40 if rk == 0 else 20)
        waits[runs] = sorted(sim.job.wait_durations)
    assert len(waits[True]) == len(waits[False]) == 2 + 39 + 1
    assert waits[True] == waits[False]


# ---- a loop of steps with a call sent alone each step, read at a given pace ------------------------

LOSS = (1,)  # the step's loss all_reduce: another shape, so it never joins the gradients' run


def _loop(
    runs: bool,
    *,
    read_every: float,
    stop: int | None = None,
    absent: int | None = None,
    started: bool = False,
    kernel: float = 0.0,
    late: float = 0.0,
    resend: int | None = None,
    read_at: float = 0.1,
    batch_at: float = 0.2,
) -> list[tuple[object, ...]]:
    """Three ranks, twelve steps a second apart: 20 gradient all_reduces (a run), then the loss
    all_reduce (sent alone: its own slot, open on the device). The GPUs complete each 0.2 s
    after it was enqueued; reads of their progress every ``read_every`` s, batches every
    second. In step ``stop`` the GPUs stop at its first all_reduce: rank ``absent`` never
    enqueues it (a hang; none: a transport stall, ``started`` on every GPU), or, ``kernel``
    > 0, a long kernel queued before it holds them that long while rank 2's host comes
    ``late`` to the loss all_reduce (healthy). ``resend``: that rank's batch of step ``stop``
    arrives twice (its reply was lost). Reads start ``read_at`` s into a second, batches ``batch_at``.
    The incidents told (``_findings``)."""
    sim = _watched(3, started=0 if started else -1)
    sim.tick_engine.stuck_after_override = 5.0
    _first_calls(sim, runs)
    host: dict[int, list[tuple[int, tuple[int, ...], float]]] = {rk: [] for rk in range(3)}
    done: dict[int, float] = {1: T0 + 0.6}
    first = 0
    for s in range(1, 13):
        base, t = 2 + 21 * (s - 1), T0 + s
        if s == stop:
            first = base
        for i in range(21):
            seq, enter = base + i, t + (0.65 if i == 20 else 0.03 * i)
            halted = stop is not None and s >= stop and not kernel
            for rk in range(3):
                if (halted and s > stop) or (halted and rk == absent):
                    continue
                host[rk].append(
                    (seq, LOSS if i == 20 else (4,), enter + (late if s == stop and rk == 2 and i == 20 else 0.0))
                )
            done[seq] = float("inf") if halted else enter + 0.2 + (kernel if stop is not None and s == stop else 0.0)
    events: list[tuple[float, int, int]] = []  # (time, what: 0 batch, 1 read, 2 tick, rank)
    for rk in range(3):
        events += [(T0 + 1 + batch_at + 0.1 * rk + k, 0, rk) for k in range(40)]
        events += [(T0 + 1 + read_at + 0.3 * rk + k * read_every, 1, rk) for k in range(int(40 / read_every))]
    events += [(T0 + 1 + 0.5 * k, 2, -1) for k in range(80)]
    sent = {rk: 0 for rk in range(3)}
    for when, what, rk in sorted(events):
        if what == 2:
            sim.beat(when, where_user=ITEM)
            sim.tick(when)
            continue
        mine = host[rk]
        if what == 1:
            enqueued = max([seq for seq, _, e in mine if e + 0.001 <= when], default=1)
            completed = 1
            while completed < enqueued and done[completed + 1] <= when:
                completed += 1
            st = completed + 1 if started and enqueued > completed else -1
            sim.deliver(
                rk, [r.GroupProgress(rk, "0", enqueued, st, completed, when, 0.0, 600_000)], when, sent_time=when
            )
            continue
        batch = [c for c in mine[sent[rk] :] if c[2] + 0.001 <= when]
        sent[rk] += len(batch)
        out: list[r.RankEvent] = []
        j = 0
        while j < len(batch):
            k = j + 1
            while runs and k < len(batch) and batch[k][1] == batch[j][1] and batch[k][0] == batch[k - 1][0] + 1:
                k += 1
            ids = [next(sim.ids) for _ in range(j, k)]
            seq, shape, _ = batch[j]
            if k - j > 1:
                template = call(rk, 0, call_id=0, shape=shape)
                enters = [c[2] for c in batch[j:k]]
                out.append(r.CallRun(rk, template, ids[0], seq, 0, enters, [e + 0.001 for e in enters]))
            else:
                out.append(
                    call(rk, seq, shape=shape, enter_time=batch[j][2], exit_time=batch[j][2] + 0.001, call_id=ids[0])
                )
            j = k
        again = copy.deepcopy(out)  # (the job state takes the records it is given as its own)
        sim.deliver(rk, out, when, sent_time=when)
        if rk == resend and any(c[0] == first for c in batch):
            sim.deliver(rk, again, when + 0.01, sent_time=when)  # its reply was lost: sent again, decoded anew
    audit(sim.job)
    return _findings(list(sim.tick_engine.incidents.values()))


@pytest.mark.parametrize("read_every", [1.0, 3.5])
def test_a_hang_below_a_call_sent_alone_is_told_at_its_seq_however_slow_the_reads(read_every: float) -> None:
    """Rank 2 never enqueues step 6's first all_reduce; ranks 0 and 1 enqueue the step, its loss
    all_reduce (sent alone) last. With reads 3.5 s apart, the GPUs' stop is seen two reads
    later, past the threshold: the loss all_reduce's slot, above, must not be judged first."""
    told = {runs: _loop(runs, read_every=read_every, stop=6, absent=2) for runs in (False, True)}
    assert told[True] == told[False]
    assert [(f[0], f[2], f[5]) for f in told[True]] == [("stuck_collective", (2,), 107)]


@pytest.mark.parametrize("read_every", [1.0, 3.5])
def test_a_long_kernel_and_a_host_late_to_the_call_sent_alone_raise_nothing(read_every: float) -> None:
    """The look-alike: every GPU spends 8 s in a kernel queued before step 6's all_reduces, and
    rank 2's host comes 6 s late to the step's loss all_reduce: every rank is in the first call
    its GPU holds, nobody is absent from it."""
    for runs in (False, True):
        assert _loop(runs, read_every=read_every, stop=6, kernel=8.0, late=6.0) == [], runs


@pytest.mark.parametrize("absent", [2, None])
def test_a_batch_sent_again_keeps_the_stop_at_its_seq(absent: int | None) -> None:
    """Rank 1's batch of step 6 arrives twice (its reply was lost): its run goes call by call the
    second time, and those calls' slots go below the loss all_reduce's. A hang (rank 2 absent)
    or a transport stall (every GPU started it) is told at step 6's first all_reduce."""
    # (a batch holds a whole step, the loss all_reduce last; no read has found the GPUs stopped
    # when it comes again)
    told = {
        runs: _loop(runs, read_every=1.0, stop=6, absent=absent, started=True, resend=1, read_at=0.55, batch_at=0.7)
        for runs in (False, True)
    }
    assert told[True] == told[False]
    kind = "stuck_collective" if absent is not None else "transport_stall"
    assert [(f[0], f[5]) for f in told[True]] == [(kind, 107)]
