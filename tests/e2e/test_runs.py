"""Runs on one coordinator, with real torchrun jobs: the same hang in a rerun is reported again,
and a mismatch repeated every step is one incident.
"""

from __future__ import annotations

from collections.abc import Callable

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.e2e.test_fault_classes import STUCK_SLEEP, TRAIN, _brief, wait_incident


def test_the_same_hang_in_a_rerun_is_reported_again(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    first_job = torchrun(STUCK_SLEEP, addr=f"127.0.0.1:{coordinator.port}", name="rerun_a")
    first = wait_incident(coordinator, "stuck_collective")
    first_job.kill()  # the user kills the hung job and runs it again, unchanged
    second_job = torchrun(STUCK_SLEEP, addr=f"127.0.0.1:{coordinator.port}", name="rerun_b")
    second = wait_incident(coordinator, "stuck_collective", pred=lambda i: i["id"] != first["id"])
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective", "stuck_collective"], _brief(incs)
    assert (second["culprit_ranks"], second["seq"], second["step"]) == (first["culprit_ranks"], first["seq"], 3)
    old = next(i for i in incs if i["id"] == first["id"])
    assert old["status"] == "resolved" and "ended" in old["resolution"], old["resolution"]
    assert coordinator.status()["job"]["run"] == second["run"] != first["run"]
    second_job.kill()


REDUCE_OP_EVERY_STEP = (
    TRAIN
    + """
for step in range(12):
    loss = torch.tensor([float(step)])
    dist.all_reduce(loss, op=dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM)  # rank 1's bug
    opt.step()
    time.sleep(0.05)
dist.destroy_process_group()
"""
)


def test_a_reduce_op_mismatch_every_step_is_one_incident(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(REDUCE_OP_EVERY_STEP, addr=f"127.0.0.1:{coordinator.port}", name="reduce_loop")
    assert job.proc.wait(120) == 0  # gloo carries on: the results are silently wrong
    inc = wait_incident(coordinator, "arg_mismatch", pred=lambda i: (i["details"].get("repeats") or {}).get("count"))
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["arg_mismatch"], _brief(incs)
    assert inc["culprit_ranks"] == [1] and inc["details"]["repeats"]["count"] >= 10
