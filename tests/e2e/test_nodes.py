"""Nodes as evidence (issue 38): two ``torchrun --nnodes 2`` launchers on this machine, each with
an agent of its own standing in for its node. One launcher stopped from outside is one incident
naming its node; both stopped at once (the job cancelled) raise nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import free_port, wait_for
from tests.conftest import PRELUDE

pytestmark = pytest.mark.slow

TRAIN = (
    PRELUDE
    + """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(4)
for step in range(2000):
    dist.all_reduce(t)
    time.sleep(0.05)
"""
)


def _own_address() -> str | None:
    """A non-loopback address of this machine: a job whose endpoint is loopback is one per host
    (each host's loopback is its own), so two simulated nodes must meet on another one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # no packet is sent: the route picks the interface
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


@pytest.fixture
def two_nodes(
    coordinator_factory: Callable[..., Coordinator],
    agents: Callable[[str, int], subprocess.Popen[str]],
    tmp_path: Path,
) -> Iterator[tuple[Coordinator, list[subprocess.Popen[str]]]]:
    host = _own_address()
    if host is None:
        pytest.skip("no address but loopback on this machine: two simulated nodes need one to meet on")
    c = coordinator_factory(embedded_agent=False, stuck_after=3.0)
    for node in ("node-a", "node-b"):
        agents(node, c.port)
    wait_for(lambda: {"node-a", "node-b"} <= set(c.hub.hosts()), 30, 0.2, "both agents to register")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    master = free_port()
    launchers = []
    for node_rank, node in enumerate(("node-a", "node-b")):
        env = testing.job_env(
            f"127.0.0.1:{c.port}",
            {"HANGWATCH_NODE_NAME": node, "HANGWATCH_AGENT_SOCKET": str(tmp_path / f"{node}.sock")},
        )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
               "--nproc-per-node=2", f"--master-addr={host}", f"--master-port={master}", str(script)]  # fmt: skip
        with open(tmp_path / f"{node}.log", "w") as log:
            launchers.append(
                subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True)
            )
    try:
        wait_for(lambda: len((c.status() or {}).get("ranks", [])) == 4, 60, 0.3, "four ranks on two nodes")
        time.sleep(2)  # a few steps in
        yield c, launchers
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def _quiet(c: Coordinator, launchers: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    for p in launchers:
        p.wait(60)
    time.sleep(4)
    return c.incidents_json()


def test_a_node_stopped_from_outside_is_one_incident_naming_it(
    two_nodes: tuple[Coordinator, list[subprocess.Popen[str]]],
) -> None:
    c, launchers = two_nodes
    launchers[1].send_signal(signal.SIGTERM)  # node-b's launcher: a spot reclaim, a drain
    incs = _quiet(c, launchers)
    brief = [(i["kind"], i["culprit_ranks"], i["summary"], i["details"].get("affected")) for i in incs]
    assert len(incs) == 1, brief
    (inc,) = incs
    assert (inc["kind"], inc["culprit_ranks"]) == ("rank_died", [2, 3]), brief
    assert inc["summary"].startswith("node node-b was stopped from outside: its ranks 2, 3 got SIGTERM"), brief


def test_both_nodes_stopped_at_once_raise_nothing(two_nodes: tuple[Coordinator, list[subprocess.Popen[str]]]) -> None:
    c, launchers = two_nodes
    for p in launchers:  # the whole job cancelled
        p.send_signal(signal.SIGTERM)
    assert _quiet(c, launchers) == []
