"""Runs of a repeating cycle of signatures with real torchrun gloo jobs and the coordinator's
embedded node agent: a hand-written tensor-parallel layer's two collectives, from two lines,
step after step, travel as cycles and raise nothing; the same loop with one rank's second
collective of another shape from some step on is told as the shape mismatch it is, on that
rank, at that step, once.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import BIN, Job, wait_for
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


def test_cycles_travel_the_wire_from_a_node_agent_and_the_mismatch_is_told_the_same(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job], tmp_path: Path
) -> None:
    """A remote node agent (a `hangwatch agent` process) reads the ranks' rings and sends the
    cycles over gRPC (``CallColumns.run_cycle``, as the coordinator's reply allows)."""
    c = coordinator_factory(embedded_agent=False, stuck_after=3.0)
    sock = tmp_path / "node-c.sock"
    agent = subprocess.Popen(
        [str(BIN / "hangwatch"), "agent", "--coordinator", f"127.0.0.1:{c.port}", "--node-name", "node-c",
         "--rank-socket", str(sock)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: "node-c" in set(c.hub.hosts()), 30, 0.2, "the agent to register")
        env = {"HANGWATCH_NODE_NAME": "node-c", "HANGWATCH_AGENT_SOCKET": str(sock), "BAD_STEP": "30"}
        job = torchrun(LAYERS, addr=f"127.0.0.1:{c.port}", name="tp_wire", env=env)
        inc = wait_incident(c, "shape_mismatch")
        assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["step"]) == ([1], [0], 30)
        settle(c, job)
        assert [i["kind"] for i in c.incidents_json()] == ["shape_mismatch"], _brief(c.incidents_json())
        status = c.status()
        assert all(rk["via"] == "agent" for rk in status["ranks"]), status["ranks"]
        assert status["job"]["records_in_cycles"] > 0, status["job"]
    finally:
        agent.kill()
        agent.wait(10)
