"""A DDP rank that skips one backward (a NaN loss ``continue``) and carries on, told apart from
the rank that leaves the loop early, which looks the same in the collectives alone: both ranks
end one gradient all-reduce short. The forward passes tell (``integrations.patch_ddp``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.e2e.test_fault_classes import _brief, wait_incident

pytestmark = pytest.mark.slow

DDP_LOOP = """
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(24):
    x = torch.randn(16, 8)
    loss = model(x).pow(2).mean()
    {fault}
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
dist.destroy_process_group()
"""

NAN_SKIP = DDP_LOOP.replace(
    "{fault}",
    """if rank == 1 and step == 5:  # this rank's loss came out NaN: skip the batch
        opt.zero_grad()
        continue""",
)
EARLY_STOP = DDP_LOOP.replace(
    "{fault}",
    """if rank == 1 and step == 23:  # this rank alone decides it has converged
        break""",
)


def test_a_skipped_backward_under_ddp_is_named_with_its_step(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(NAN_SKIP, addr=f"127.0.0.1:{coordinator.port}", name="nan_skip")
    inc = wait_incident(coordinator, "stuck_collective", pred=lambda i: "skipped" in i["details"])
    assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["step"]) == ([1], [0], 5)
    assert inc["details"]["skipped"]["forward"] == 6 and inc["details"]["skipped"]["behind"] == 1
    assert "ran forward pass 6 (step 5) without its backward" in inc["summary"]
    job.wait(90)
    incs = coordinator.incidents_json()
    assert [i["id"] for i in incs] == [inc["id"]], _brief(incs)  # one root cause, one incident


def test_the_look_alike_that_left_the_loop_is_an_early_exit(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(EARLY_STOP, addr=f"127.0.0.1:{coordinator.port}", name="early_stop")
    inc = wait_incident(coordinator, "early_exit")
    assert (inc["culprit_ranks"], inc["waiting_ranks"]) == ([1], [0])
    assert "skipped" not in inc["details"]
    job.wait(90)
    incs = coordinator.incidents_json()
    assert [i["id"] for i in incs] == [inc["id"]], _brief(incs)
