"""Sequence alignment on real gloo jobs where torch numbers ranks' collectives unevenly.

gloo's ``monitored_barrier`` is sends and receives to and from rank 0 that torch counts as
collectives (2x(world-1) on rank 0, 2 elsewhere): every call after it is numbered differently on
rank 0. A hang after monitored barriers must blame the right rank, with no mismatch on the way.
"""

from __future__ import annotations

from collections.abc import Callable

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.e2e.test_fault_classes import TRAIN, _brief, wait_incident

HANG_AFTER_MONITORED_BARRIERS = (
    TRAIN
    + """
for step in range(100):
    if step % 3 == 0:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))  # a phase boundary, checked
    if rank == 2 and step == 7:
        time.sleep(600)  # rank 2 stalls in its data loading; the others wait in the all_reduce
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.05)
"""
)


def test_a_hang_after_monitored_barriers_blames_the_stalled_rank(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(HANG_AFTER_MONITORED_BARRIERS, addr=f"127.0.0.1:{coordinator.port}", nproc=3, name="mbarrier")
    inc = wait_incident(coordinator, "stuck_collective")
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["op"], inc["step"]) == ([2], [0, 1], "all_reduce", 7)
    job.kill()
