"""Runs of a repeating cycle of signatures with real torchrun gloo jobs and the coordinator's
embedded node agent: a hand-written tensor-parallel layer's two collectives, from two lines,
step after step, travel as cycles and raise nothing; the same loop with one rank's second
collective of another shape from some step on is told as the shape mismatch it is, on that
rank, at that step, once.
"""

from __future__ import annotations

from collections.abc import Callable

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for
from tests.e2e.test_fault_classes import TRAIN, _brief, settle, wait_incident

#: two all_reduces a layer, four layers a step: attention's output, then the MLP's (another width)
LAYERS = (
    TRAIN
    + """
attn, mlp = torch.ones(16), torch.ones(32)
bad = int(os.environ.get("BAD_STEP", "-1"))
for step in range(60):
    for layer in range(4):
        dist.all_reduce(attn)
        if rank == 1 and step == bad and layer == 2:
            mlp = torch.ones(33)  # rank 1's bug: a width off by one from here on
        dist.all_reduce(mlp)
    opt.step()
    time.sleep(0.01)
dist.destroy_process_group()
"""
)


def test_a_tensor_parallel_loop_travels_as_cycles_and_raises_nothing(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(LAYERS, addr=f"127.0.0.1:{coordinator.port}", name="tp_layers")
    assert job.wait(120) == 0, job.output()[-2000:]
    status = wait_for(
        lambda: (s := coordinator.status())["job"]["states"] == {"exited": 2} and s, 30, 0.2, "both ranks' ends"
    )
    received = status["job"]["records_received"]
    assert received >= 2 * 60 * 8  # every call came, as a call or in a run
    assert status["job"]["records_in_cycles"] > received // 2, status["job"]  # most of them in cycles
    assert coordinator.incidents_json() == [], _brief(coordinator.incidents_json())


def test_a_shape_mismatch_inside_the_cycles_is_told_once_on_its_rank(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(LAYERS, addr=f"127.0.0.1:{coordinator.port}", name="tp_bad", env={"BAD_STEP": "30"})
    inc = wait_incident(coordinator, "shape_mismatch")
    assert inc["op"] == "all_reduce" and inc["culprit_ranks"] == [1] and inc["waiting_ranks"] == [0]
    assert "[32]" in inc["summary"] and "[33]" in inc["summary"], inc["summary"]
    assert inc["step"] == 30
    settle(coordinator, job)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["shape_mismatch"], _brief(incs)
    assert coordinator.status()["job"]["records_in_cycles"] > 0  # the steps before it went as cycles
