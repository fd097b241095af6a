"""Node agents end to end: two real `hangwatch agent` processes on this machine standing in for two
nodes, a real gloo job on "node-b", stacks routed to the right agent, a killed agent noticed, and
--abort-on-hang terminating the job once the diagnosis is stored."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import BIN, Job, free_port, wait_for

pytestmark = pytest.mark.slow

STUCK = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
t = torch.ones(4)

def load_next_batch():
    time.sleep(600)  # a data loader that never returns

for step in range(1000):
    if rank == 1 and step == 2:
        load_next_batch()
    dist.all_reduce(t)
    time.sleep(0.05)
"""


def _stuck_with_stacks(c: Coordinator) -> dict[str, Any] | None:
    """The stuck incident naming rank 1, once its stack is attached."""
    for inc in c.incidents_json():
        if inc["kind"] == "stuck_collective" and inc["stacks"].get("1"):
            return inc
    return None


def test_stacks_come_from_the_agent_of_the_ranks_node(
    coordinator_factory: Callable[..., Coordinator],
    agents: Callable[[str, int], subprocess.Popen[str]],
    torchrun: Callable[..., Job],
    tmp_path: Path,
) -> None:
    c = coordinator_factory(embedded_agent=False, stuck_after=3.0)
    agents("node-a", c.port)
    agent_b = agents("node-b", c.port)
    wait_for(lambda: {"node-a", "node-b"} <= set(c.hub.hosts()), 30, 0.2, "both agents to register")
    node_b = {"HANGWATCH_NODE_NAME": "node-b", "HANGWATCH_AGENT_SOCKET": str(tmp_path / "node-b.sock")}
    job = torchrun(STUCK, addr=f"127.0.0.1:{c.port}", env=node_b, name="node_b_job")

    inc = wait_for(lambda: _stuck_with_stacks(c), 60, 0.3, "a stuck incident with the culprit's stack")
    assert inc["culprit_ranks"] == [1]
    assert "load_next_batch" in inc["stacks"]["1"]
    assert inc["stacks_time"] - inc["detected_time"] < 5
    status = c.status()
    assert all(r["host"] == "node-b" for r in status["ranks"])
    assert status["job"]["agents"]["node-b"]["connected"]

    # on-demand stacks go through the same agent
    dumps = c.dump_stacks(None, native=False)
    assert dumps is not None and set(dumps) == {"0", "1"}
    assert "all_reduce" in dumps["0"]["text"]

    # a killed agent is reported, and stacks say why they are missing
    agent_b.send_signal(signal.SIGKILL)
    agent_b.wait(10)
    wait_for(lambda: not c.status()["job"]["agents"]["node-b"]["connected"], 20, 0.5, "the agent to be seen gone")
    dumps = c.dump_stacks([1], native=False)
    assert dumps is not None
    assert "stopped polling" in (dumps["1"]["error"] or "")

    # restarting the agent restores stacks
    agents("node-b", c.port)
    wait_for(lambda: c.status()["job"]["agents"]["node-b"]["connected"], 20, 0.3, "the agent to come back")
    dumps = wait_for(
        lambda: (d := c.dump_stacks([1], native=False)) and not d["1"]["error"] and d,
        30,
        0.5,
        "stacks from the restarted agent",
    )
    assert "load_next_batch" in dumps["1"]["text"]
    job.kill()


def test_abort_on_hang_terminates_the_job_after_the_diagnosis(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job]
) -> None:
    c = coordinator_factory(stuck_after=3.0, abort_on_hang=True)
    job = torchrun(STUCK, addr=f"127.0.0.1:{c.port}", name="abort_job")
    started = time.monotonic()
    code = job.wait(90)
    assert code != 0
    assert time.monotonic() - started < 60  # not gloo's 120 s timeout
    incidents = c.incidents_json()
    kinds = [i["kind"] for i in incidents]
    assert kinds == ["stuck_collective"], kinds  # our own SIGTERM is not blamed as a death
    assert incidents[0]["stacks"].get("1")


def test_relaying_agent_carries_a_real_jobs_ranks(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job], tmp_path: Path
) -> None:
    """Ranks point HANGWATCH_ADDR at their node's agent: the hang is diagnosed with the culprit's
    stack as usual, and no rank holds a connection to the coordinator (only the agent does)."""
    import psutil

    c = coordinator_factory(embedded_agent=False, stuck_after=3.0)
    relay = ("--relay-port", str(free_port()))
    agent = subprocess.Popen(
        [str(BIN / "hangwatch"), "agent", "--coordinator", f"127.0.0.1:{c.port}", "--node-name", "node-r", *relay],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert agent.stdout is not None
        relay_addr = ""
        for _ in range(5):
            line = agent.stdout.readline()
            if "HANGWATCH_ADDR=" in line:
                relay_addr = line.strip().split("HANGWATCH_ADDR=")[1]
                break
        assert relay_addr.startswith("127.0.0.1:"), relay_addr
        job = torchrun(STUCK, addr=relay_addr, env={"HANGWATCH_NODE_NAME": "node-r"}, name="relayed_job")

        inc = wait_for(lambda: _stuck_with_stacks(c), 60, 0.3, "a stuck incident with the culprit's stack")
        assert inc["culprit_ranks"] == [1]
        assert "load_next_batch" in inc["stacks"]["1"]
        assert all(st.relay == "node-r" for st in c.job.ranks.values()) and len(c.job.ranks) == 2
        rank_pids = [st.identity.pid for st in c.job.ranks.values()]
        for pid in rank_pids:
            remote_ports = {conn.raddr.port for conn in psutil.Process(pid).net_connections("tcp") if conn.raddr}
            assert c.port not in remote_ports, f"rank pid {pid} talks to the coordinator directly"
        agent_ports = {conn.raddr.port for conn in psutil.Process(agent.pid).net_connections("tcp") if conn.raddr}
        assert c.port in agent_ports
        job.kill()
    finally:
        agent.kill()
        agent.wait(10)
