"""Deaths told right (issue 20): real torchrun/gloo jobs whose ranks link to the coordinator's
embedded agent, so every record is outside the rank before its call is issued and the agent
knows the moment each process vanished.

- a rank killed alone (SIGKILL while it waits in a broadcast) is a ``rank_died`` naming it, the
  signal and the call it was in, within about a second, though torchrun then stops the others;
- a mismatch that makes gloo abort a rank is the mismatch, the death only its aftermath;
- a rank frozen after thousands of calls is reported at its true last call;
- a job stopped as a whole, or ranks that exit cleanly at different times, raise nothing.

Every wait is bounded; the fixtures kill the jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.diagnosis.detectors.ends import TOGETHER_S
from hangwatch.testing import Job, wait_for
from tests.e2e.test_fault_classes import INIT, _brief, wait_incident

Incident = dict[str, Any]


def _pids(c: Coordinator, world: int, timeout: float = 60) -> dict[int, int]:
    """Each rank's pid, once every rank is registered through its link to the agent."""

    def get() -> dict[int, int] | None:
        with c.lock:
            ranks = {rk: st.identity.pid for rk, st in c.job.ranks.items()}
        return ranks if len(ranks) == world else None

    return wait_for(get, timeout, 0.1, f"{world} ranks registered")  # type: ignore[no-any-return]


def _open_call(c: Coordinator, rank: int) -> str:
    with c.lock:
        st = c.job.ranks.get(rank)
        last = st.last_call if st is not None else None
        return last.op if last is not None and last.exit_time is None else ""


def _ended(job: Job, timeout: float) -> None:
    try:
        job.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()


def _ends(c: Coordinator, since: float) -> dict[int, str]:
    """How each rank ended, as the coordinator holds it (times from ``since``): what a failed
    wait for a death prints, so that a run on a loaded machine tells which story it saw."""
    with c.lock:
        out = {}
        for rk, st in sorted(c.job.ranks.items()):
            proc, end = st.proc, st.end
            said = f"end {end.kind.value} {end.detail!r}" if end is not None else "no end record"
            seen = "running"
            if proc is not None:
                seen = f"{proc.state.value} +{proc.time - since:.4f}s signal={proc.signal} code={proc.exit_code}"
            out[rk] = f"{said}; {seen}"
        return out


def _starved(c: Coordinator) -> bool:
    """Whether every rank's end was seen in one wake-up of the agent with no signal left to read."""
    with c.lock:
        procs = [st.proc for st in c.job.ranks.values()]
    if any(p is None or p.signal is not None or p.exit_code is not None for p in procs):
        return False
    times = [p.time for p in procs if p is not None]
    return max(times) - min(times) <= TOGETHER_S


def _quiet(c: Coordinator, seconds: float = 3.0) -> None:
    """Give the detectors time to open whatever they would (several ticks, past every window)."""
    time.sleep(seconds)


# --------------------------------------------------------------------------------------------
# (a) a rank-0-only metrics sync in a training loop: the mismatch, not the death it causes

METRICS_SYNC = (
    INIT
    + """
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
for step in range(50):
    seen = torch.tensor([64], dtype=torch.int64)
    dist.all_reduce(seen)                      # samples seen (every rank)
    loss = torch.tensor([1.0 / (step + 1)])
    dist.all_reduce(loss)                      # the loss (every rank)
    opt.step()
    if rank == 0 and step == 6:
        acc = torch.tensor([0.5])
        dist.all_reduce(acc)                   # the bug: a metric synced on rank 0 only
    time.sleep(0.05)
"""
)


def test_rank0_only_metrics_sync_is_the_mismatch(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(METRICS_SYNC, addr=f"127.0.0.1:{coordinator.port}", nproc=3, name="metrics_sync")
    inc = wait_incident(coordinator, "dtype_mismatch", timeout=90)
    print(f"\ndtype_mismatch detected {inc['detected_time'] - inc['onset_time']:.2f} s after its onset")
    assert inc["culprit_ranks"] == [0], _brief(coordinator.incidents_json())
    assert inc["waiting_ranks"] == [1, 2]
    assert "float32" in inc["summary"] and "int64" in inc["summary"]
    _ended(job, 30)
    _quiet(coordinator)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["dtype_mismatch"], _brief(incs)
    assert "then died" in incs[0]["summary"] or "aftermath" not in incs[0]["details"]
    print(_brief(incs))


# --------------------------------------------------------------------------------------------
# (b) rank 2 of 4 SIGKILLed (what the OOM killer does) while it waits inside a broadcast

KILLED_IN_BROADCAST = (
    INIT
    + """
t = torch.ones(8)
for step in range(5):
    dist.all_reduce(t)
    time.sleep(0.05)
if rank == 0:
    time.sleep(60)  # rank 0 prepares the weights: the others wait in the broadcast
w = torch.zeros(8)
dist.broadcast(w, src=0)
"""
)


def test_sigkill_in_broadcast_is_rank_died(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(KILLED_IN_BROADCAST, addr=f"127.0.0.1:{coordinator.port}", nproc=4, name="killed")
    pids = _pids(coordinator, 4)
    wait_for(lambda: _open_call(coordinator, 2) == "broadcast", 60, 0.1, "rank 2 inside the broadcast")
    time.sleep(0.5)
    os.kill(pids[2], signal.SIGKILL)
    killed_at = time.time()
    try:
        inc = wait_incident(coordinator, "rank_died", timeout=10)
    except AssertionError as e:
        if _starved(coordinator):
            # Every close seen in one wake-up, every process reaped before it could be read: the
            # agent's thread (in this test's process) was starved for longer than torchrun took
            # to react, and no one can tell the kill from a job killed whole. Silence is the
            # designed answer there (never a false death): check it held, and say why no more.
            assert coordinator.incidents_json() == []
            pytest.skip(f"the agent was starved past torchrun's reaction: {_ends(coordinator, killed_at)}")
        raise AssertionError(f"{e}; how each rank ended: {_ends(coordinator, killed_at)}") from None
    took = inc["detected_time"] - killed_at
    print(f"\nrank_died detected {took:.2f} s after the kill: {inc['summary']}")
    assert took < 1.5, took
    assert inc["culprit_ranks"] == [2]
    assert inc["op"] == "broadcast"
    assert "broadcast" in inc["summary"]
    assert "SIGKILL" in inc["summary"] and "signal 9" in inc["summary"], inc["summary"]
    assert inc["details"]["exit"]["signal"] == 9
    _ended(job, 30)  # torchrun stops the others at once
    _quiet(coordinator)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["rank_died"], _brief(incs)
    assert incs[0]["culprit_ranks"] == [2]
    with coordinator.lock:
        gone = {rk: st.proc.time for rk, st in coordinator.job.ranks.items() if st.proc is not None}
    print("links closed after rank 2's:", {rk: round(t - gone[2], 3) for rk, t in sorted(gone.items())})


# --------------------------------------------------------------------------------------------
# (c) a mismatch in the very first collective (the torch docs' DETAIL example)

FIRST_CALL_SHAPES = (
    INIT
    + """
tensor = torch.ones(10) if rank == 0 else torch.ones(20)
dist.all_reduce(tensor)
"""
)


def test_first_collective_shape_mismatch(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(FIRST_CALL_SHAPES, addr=f"127.0.0.1:{coordinator.port}", name="first_shapes")
    inc = wait_incident(coordinator, "shape_mismatch", timeout=60)
    print(f"\nshape_mismatch detected {inc['detected_time'] - inc['onset_time']:.2f} s after its onset")
    assert "10" in inc["summary"] and "20" in inc["summary"]
    _ended(job, 30)
    _quiet(coordinator)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["shape_mismatch"], _brief(incs)


# --------------------------------------------------------------------------------------------
# (d) frozen with the GIL held after 3,000 all_reduce calls: its true last call

FROZEN_LATE = (
    INIT
    + """
import ctypes
t = torch.ones(1)
for i in range(3000):
    dist.all_reduce(t)
if rank == 1:
    ctypes.PyDLL(None).sleep(600)  # native sleep holding the GIL: even the hook's thread stops
dist.all_reduce(t)
"""
)


def test_frozen_after_many_calls_names_its_last(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(FROZEN_LATE, addr=f"127.0.0.1:{coordinator.port}", name="frozen_late")
    # (on a loaded machine a rank starved for seconds may look frozen for a while before: that
    # incident resolves when it resumes; the freeze is the one still open)
    inc = wait_incident(coordinator, "rank_frozen", timeout=120, pred=lambda i: i["status"] == "open")
    assert inc["culprit_ranks"] == [1]
    with coordinator.lock:
        open_seq = coordinator.job.ranks[0].last_call.seq  # type: ignore[union-attr]
    assert inc["op"] == "all_reduce"
    assert inc["seq"] == open_seq - 1 >= 3000, (inc["seq"], open_seq)
    incs = [i for i in coordinator.incidents_json() if i["status"] == "open"]
    assert [i["kind"] for i in incs] == ["rank_frozen"], _brief(incs)
    job.kill()


# --------------------------------------------------------------------------------------------
# healthy look-alikes: (e) a job stopped as a whole, (f) clean exits at different times

RUNS = (
    INIT
    + """
t = torch.ones(8)
while True:
    if rank == 0:
        time.sleep(0.5)  # rank 0 writes the logs: the others wait inside the all_reduce meanwhile
    dist.all_reduce(t)
"""
)


@pytest.mark.parametrize("how", ["ranks", "torchrun"])
def test_job_stopped_as_a_whole_raises_nothing(
    coordinator: Coordinator, torchrun: Callable[..., Job], how: str
) -> None:
    job = torchrun(RUNS, addr=f"127.0.0.1:{coordinator.port}", nproc=4, name=f"stopped_{how}")
    pids = _pids(coordinator, 4)
    time.sleep(2)
    if how == "ranks":
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
    else:
        job.proc.send_signal(signal.SIGTERM)
    _ended(job, 30)
    _quiet(coordinator)
    with coordinator.lock:
        gone = {rk: st.proc.time for rk, st in coordinator.job.ranks.items() if st.proc is not None}
        told = {  # what each rank said of its end, and what its agent saw (for a failure's story)
            rk: (
                st.end and (st.end.kind.value, st.end.detail[:80]),
                st.proc and (st.proc.state.value, st.proc.signal, st.proc.exit_code),
            )
            for rk, st in sorted(coordinator.job.ranks.items())
        }
    print("\nlink closes after the stop:", {rk: round(t - min(gone.values()), 3) for rk, t in sorted(gone.items())})
    print("ends:", told)
    assert coordinator.incidents_json() == [], _brief(coordinator.incidents_json())


STUCK_THEN_STOPPED = (
    INIT
    + """
t = torch.ones(8)
for step in range(5):
    dist.all_reduce(t)
if rank == 1:
    time.sleep(600)  # rank 1 never comes: the job hangs
dist.all_reduce(t)
"""
)


def test_stopping_a_hung_job_adds_nothing(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(STUCK_THEN_STOPPED, addr=f"127.0.0.1:{coordinator.port}", name="hung_stopped")
    inc = wait_incident(coordinator, "stuck_collective", timeout=60)
    job.proc.send_signal(signal.SIGTERM)
    _ended(job, 30)
    _quiet(coordinator)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    assert incs[0]["summary"] == inc["summary"] and "aftermath" not in incs[0]["details"]


STAGGERED_EXITS = (
    INIT
    + """
t = torch.ones(8)
for step in range(10):
    dist.all_reduce(t)
    time.sleep(0.05)
if rank == 1:
    time.sleep(3)  # writes its report, then leaves: nothing is pending
"""
)


def test_clean_exits_at_different_times_raise_nothing(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(STAGGERED_EXITS, addr=f"127.0.0.1:{coordinator.port}", name="staggered")
    assert job.wait(60) == 0, job.output()[-2000:]
    _quiet(coordinator)
    assert coordinator.incidents_json() == [], _brief(coordinator.incidents_json())
