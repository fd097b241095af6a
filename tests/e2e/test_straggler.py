"""A straggler is a warning, not a hang: one rank persistently arrives last by a wide margin."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for

pytestmark = pytest.mark.slow

SLOW_RANK = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
for step in range(26):
    if rank == 2:
        time.sleep(0.7)  # e.g. a slower host or a data loader only this rank waits on
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
"""


def test_persistent_last_arriver_is_a_straggler_warning(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job]
) -> None:
    c = coordinator_factory(stuck_after=10.0)
    job = torchrun(SLOW_RANK, addr=f"127.0.0.1:{c.port}", nproc=3, name="straggler")
    incs = wait_for(lambda: [i for i in c.incidents_json() if i["kind"] == "straggler"], 60, 0.3, "a straggler")
    inc = incs[0]
    assert inc["severity"] == "warning"
    assert inc["culprit_ranks"] == [2]
    assert inc["waiting_ranks"] == [0, 1]
    assert "rank 2 arrived last" in inc["summary"]
    assert job.wait(60) == 0
    assert [i["kind"] for i in c.incidents_json()] == ["straggler"]  # nothing else: it is not a hang
