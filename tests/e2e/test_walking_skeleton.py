"""Issue 2's path, end to end with real processes: the `hangwatch coordinator` command, a torchrun
gloo job attached by HANGWATCH_ADDR alone, `hangwatch status`, and a stuck all_reduce diagnosed
with the culprit's py-spy stack, long before gloo's timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hangwatch.testing import BIN, Job, start_coordinator_cli, wait_for

pytestmark = pytest.mark.slow

STUCK = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
t = torch.ones(4)
for step in range(100):
    if rank == 1 and step == 3:
        time.sleep(600)  # never arrives at this step's all_reduce
    dist.all_reduce(t)
    time.sleep(0.1)
"""


@pytest.fixture
def coordinator_cli(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    addr, proc = start_coordinator_cli(tmp_path / "data", stuck_after=4, cwd=tmp_path)
    yield addr, proc
    proc.terminate()
    proc.wait(10)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "hangwatch"), *args], capture_output=True, text=True, timeout=60)


def test_stuck_all_reduce_diagnosed_end_to_end(
    coordinator_cli: tuple[str, subprocess.Popen[str]], torchrun: Callable[..., Job]
) -> None:
    addr, _ = coordinator_cli
    job = torchrun(STUCK, addr=addr, name="stuck")
    started = time.time()

    def status() -> dict:  # type: ignore[type-arg]
        out = cli("status", "--json", "--addr", addr)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    data = wait_for(lambda: (s := status()) and len(s["ranks"]) == 2 and s, 60, 0.5, "both ranks to register")
    assert set(data) >= {"job", "ranks", "incidents"}
    for rank in data["ranks"]:
        assert set(rank) >= {"rank", "host", "pid", "state", "step", "last_op", "group", "seq", "since"}
        assert rank["via"] == "agent"  # the coordinator's embedded agent reads the rank's ring
    assert sorted(r["rank"] for r in data["ranks"]) == [0, 1]
    assert data["job"]["world_size"] == 2

    def stuck_incident() -> dict | None:  # type: ignore[type-arg]
        out = cli("incidents", "--json", "--addr", addr)
        assert out.returncode == 0, out.stderr
        found = [i for i in json.loads(out.stdout) if i["kind"] == "stuck_collective" and i["stacks"].get("1")]
        return found[0] if found else None

    incident = wait_for(stuck_incident, 60, 0.5, "a stuck_collective incident with stacks")
    assert incident["culprit_ranks"] == [1]
    assert incident["waiting_ranks"] == [0]
    assert incident["op"] == "all_reduce"
    assert incident["group"] == "0"
    assert "stuck.py" in incident["stacks"]["1"]  # the culprit's own frame, from py-spy
    for key in ("id", "seq", "step", "summary", "hint", "onset_time", "detected_time"):
        assert key in incident
    assert incident["detected_time"] - incident["onset_time"] < 20  # gloo would wait 300 s here
    assert time.time() - started < 120

    human = cli("status", "--addr", addr)
    assert human.returncode == 0
    assert "waiting in all_reduce" in human.stdout
    assert "stuck_collective" in human.stdout
    assert "records: ranks 0, 1 read by their node agent" in human.stdout  # the coordinator's embedded one

    report = cli("report", incident["id"], "--addr", addr)
    assert report.returncode == 0
    assert "culprit ranks  1" in report.stdout
    assert "--- rank 1 ---" in report.stdout
    graph = cli("report", incident["id"], "--graph", "--addr", addr)
    assert graph.returncode == 0, graph.stderr
    host = data["ranks"][0]["host"]
    assert f"rank 0 ({host}) waits in all_reduce (group 0, seq " in graph.stdout
    assert f"for rank 1 ({host})" in graph.stdout and "-> rank 1 is busy" in graph.stdout
    drawn = cli("report", incident["id"], "--graph", "--format", "dot", "--addr", addr)
    assert drawn.returncode == 0 and drawn.stdout.startswith(f'digraph "{incident["id"]}" {{')
    assert "shape=doubleoctagon" in drawn.stdout and " -> " in drawn.stdout
    job.kill()


def test_cli_without_coordinator_fails_with_one_line() -> None:
    for command in ("status", "incidents", "report", "stacks"):
        out = cli(command, "--addr", "127.0.0.1:1")
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert "cannot reach the hangwatch coordinator at 127.0.0.1:1" in lines[0]


def test_python_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hangwatch.cli.main", "--version"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "hangwatch" in out.stdout
