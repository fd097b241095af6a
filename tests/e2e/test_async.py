"""Async collectives (``async_op=True``) on gloo: a rank is in the call until its work completes.

The call returns a ``Work`` at once; the rank blocks later in ``work.wait()``, often after
overlapping compute, which is also how every NCCL collective behaves (there the GPU completes it).
A rank that skips one async all_reduce leaves the others blocked in ``wait()``: the diagnosis
names it, and the waiting ranks' stacks show the ``wait``. The look-alike, an overlap whose waits
come late and at uneven paces, raises nothing. Real torchrun jobs, a real coordinator.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.conftest import PRELUDE
from tests.e2e.test_fault_classes import TRAIN, _brief, wait_incident, wait_stacks

SKIPS_AN_ASYNC_CALL = (
    TRAIN
    + """
for step in range(100):
    if rank == 1 and step == 4:
        time.sleep(600)  # rank 1 goes off to do something else; the others wait on their works
    work = dist.all_reduce(t, async_op=True)
    x = torch.randn(64, 64) @ torch.randn(64, 64)  # overlapped compute
    work.wait()
    opt.step()
    time.sleep(0.1)
"""
)


def _line_of(code: str) -> int:
    """The line of the job's script (prelude included) that holds ``code``."""
    lines = (PRELUDE + textwrap.dedent(SKIPS_AN_ASYNC_CALL)).splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == code)


def test_a_rank_that_skips_an_async_call_is_blamed_and_the_others_wait_in_wait(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(SKIPS_AN_ASYNC_CALL, addr=f"127.0.0.1:{coordinator.port}", nproc=3, name="async_skip")
    inc = wait_incident(coordinator, "stuck_collective")
    assert inc["culprit_ranks"] == [1], _brief(coordinator.incidents_json())
    assert inc["waiting_ranks"] == [0, 2]
    assert inc["op"] == "all_reduce" and inc["step"] == 4
    assert "async" in inc["details"]["calls"]["0"]  # the call is described as the async one it is
    assert "async_skip.py" in wait_stacks(coordinator, inc["id"], 1)
    main_thread = wait_stacks(coordinator, inc["id"], 0).split("\nThread ")[0]
    assert f"async_skip.py:{_line_of('work.wait()')})" in main_thread  # blocked in wait(), not in the call
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    job.kill()


OVERLAP_AT_UNEVEN_PACES = (
    TRAIN
    + """
for step in range(20):
    works = [dist.all_reduce(t.clone(), async_op=True) for _ in range(3)]
    time.sleep(0.05 * (rank + 1) + (0.4 if step % 10 == rank else 0.0))  # uneven compute, now and then long
    for w in works:
        w.wait()
    opt.step()
flag = torch.ones(1)
dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank agrees it is done
dist.destroy_process_group()
"""
)


def test_overlapped_async_calls_at_uneven_paces_raise_nothing(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(OVERLAP_AT_UNEVEN_PACES, addr=f"127.0.0.1:{coordinator.port}", nproc=3, name="async_overlap")
    assert job.proc.wait(120) == 0
    time.sleep(4)  # past stuck_after: anything the detectors would say, they have said
    incs = coordinator.incidents_json()
    assert incs == [], _brief(incs)
