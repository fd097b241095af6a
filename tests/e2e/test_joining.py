"""Hangs before the ranks joined: real processes, real gloo rendezvous, a real coordinator with
its embedded agent. A process its launcher started as a rank links to its node agent from its
first line (``client.joining``); ranks that wait in ``init_process_group`` for one that never
comes are told with where that one is, or that it was never seen; and the healthy programs
that look most like it raise nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: The coordinator's threshold in these tests (``--stuck-after``; it is init's too when given).
THRESHOLD_S = 3.0

BEFORE_INIT = """
import os, time
import torch
import torch.distributed as dist

def download_dataset(rank):
    if rank == int(os.environ.get("SLOW_RANK", "-1")):
        time.sleep(float(os.environ.get("SLOW_S", "600")))  # @D a download that hangs

rank = int(os.environ["RANK"])
download_dataset(rank)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., list[subprocess.Popen[bytes]]]]:
    """A launcher as torchrun's static rendezvous is: one process per rank, told its rank."""
    started: list[subprocess.Popen[bytes]] = []

    def run(
        body: str, addr: str, world: int, ranks: list[int] | None = None, env: dict[str, str] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        script = tmp_path / "train.py"
        script.write_text(textwrap.dedent(body))
        port = _free_port()
        for rank in range(world) if ranks is None else ranks:
            rank_env = testing.job_env(addr, env)
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                HANGWATCH_JOB_ID="joining",
            )
            log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
            started.append(
                subprocess.Popen([sys.executable, str(script)], env=rank_env, cwd=tmp_path, stdout=log, stderr=log)
            )
        return started

    yield run
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _incidents(c: Coordinator) -> list[dict[str, Any]]:
    return [i for i in c.incidents_json() if i["job"] == "joining"]


def _line(body: str, tag: str) -> int:
    return next(n for n, line in enumerate(textwrap.dedent(body).splitlines(), 1) if f"# @{tag}" in line)


def test_a_rank_that_hangs_before_init_is_named_where_it_is(
    coordinator_factory: Callable[..., Coordinator], launch: Callable[..., list[subprocess.Popen[bytes]]]
) -> None:
    """Rank 1 of 3 downloads its data before init_process_group and the download hangs: ranks 0
    and 2 wait inside it. Told within the threshold and a few seconds, with its frame."""
    c = coordinator_factory(stuck_after=THRESHOLD_S)
    start = time.monotonic()
    launch(BEFORE_INIT, f"127.0.0.1:{c.port}", 3, env={"SLOW_RANK": "1"})
    line = _line(BEFORE_INIT, "D")

    def told() -> dict[str, Any] | None:
        incs = _incidents(c)
        return next((i for i in incs if f"train.py:{line}" in i["summary"]), None)

    inc = wait_for(told, 30, 0.2, "rank 1 named where it is")
    assert time.monotonic() - start < THRESHOLD_S + 20
    assert (inc["kind"], inc["culprit_ranks"], inc["waiting_ranks"], inc["op"]) == (
        "stuck_collective",
        [1],
        [0, 2],
        "init_process_group",
    )
    assert f"rank 1 never entered init_process_group: it is in download_dataset at train.py:{line}" in inc["summary"]
    assert inc["summary"].startswith("ranks 0, 2 wait in init_process_group for ")
    assert len(_incidents(c)) == 1


def test_a_rank_whose_process_never_started_is_told_never_seen(
    coordinator_factory: Callable[..., Coordinator], launch: Callable[..., list[subprocess.Popen[bytes]]]
) -> None:
    """Ranks 0 and 1 of 3 start; rank 2's process never does."""
    c = coordinator_factory(stuck_after=THRESHOLD_S)
    launch(BEFORE_INIT, f"127.0.0.1:{c.port}", 3, ranks=[0, 1])
    inc = wait_for(lambda: next(iter(_incidents(c)), None), 30, 0.2, "the incident")
    assert (inc["kind"], inc["culprit_ranks"], inc["waiting_ranks"]) == ("stuck_collective", [2], [0, 1])
    assert "rank 2 never joined, and no process of it was seen" in inc["summary"]


def test_a_rank_that_starts_late_under_the_threshold_raises_nothing(
    coordinator_factory: Callable[..., Coordinator], launch: Callable[..., list[subprocess.Popen[bytes]]]
) -> None:
    """The look-alike: rank 1 is slow to start (a cold node), and arrives before the threshold
    runs out (here 10 s, room for a loaded machine's imports; 60 s by default). The job runs to
    its end; nothing is raised."""
    c = coordinator_factory(stuck_after=10.0)
    procs = launch(BEFORE_INIT, f"127.0.0.1:{c.port}", 2, env={"SLOW_RANK": "1", "SLOW_S": "2.5"})
    for p in procs:
        assert p.wait(timeout=60) == 0
    time.sleep(2 * 0.25 + 1)  # the coordinator's ticks after the last batch
    assert _incidents(c) == []


def test_a_script_that_never_calls_init_raises_nothing(
    coordinator_factory: Callable[..., Coordinator], launch: Callable[..., list[subprocess.Popen[bytes]]]
) -> None:
    """The look-alike: processes started with a rank's variables that import torch and work on
    their own, never joining any group (data preparation under torchrun). Linked, never a hang."""
    c = coordinator_factory(stuck_after=THRESHOLD_S)
    procs = launch("import torch, time\ntime.sleep(6)\n", f"127.0.0.1:{c.port}", 2)
    wait_for(lambda: c.jobs.find("joining") or None, 10, 0.1, "the starting processes told")
    for p in procs:
        assert p.wait(timeout=60) == 0
    assert _incidents(c) == []


def test_subprocesses_of_a_starting_rank_are_not_ranks(
    coordinator_factory: Callable[..., Coordinator], launch: Callable[..., list[subprocess.Popen[bytes]]]
) -> None:
    """A rank that runs a tool (the same interpreter, its environment inherited) before init:
    the tool never links as that rank."""
    c = coordinator_factory(stuck_after=THRESHOLD_S)
    body = """
    import subprocess, sys, time
    subprocess.run([sys.executable, "-c", "import time; time.sleep(3)"], check=True)
    time.sleep(1)
    """
    procs = launch(body, f"127.0.0.1:{c.port}", 1)
    (job,) = wait_for(lambda: c.jobs.find("joining") or None, 10, 0.1, "the starting process told")
    time.sleep(1.5)  # the tool runs now
    with c.lock:
        assert [j.identity.pid for j in job.joining.values()] == [procs[0].pid]
    assert procs[0].wait(timeout=30) == 0
    assert os.environ.get("HANGWATCH_RANK_OF") is None  # nothing leaks into the test's own process


def test_under_torchrun_the_rank_that_never_joined_is_named(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job]
) -> None:
    """The same hang under torchrun: its workers get their ranks from it, torchrun itself (no
    ``RANK``) never links."""
    c = coordinator_factory(stuck_after=THRESHOLD_S)
    torchrun(BEFORE_INIT, addr=f"127.0.0.1:{c.port}", nproc=2, env={"SLOW_RANK": "0", "HANGWATCH_JOB_ID": "joining"})
    inc = wait_for(
        lambda: next((i for i in _incidents(c) if "download_dataset" in i["summary"]), None), 40, 0.2, "the story"
    )
    assert (inc["culprit_ranks"], inc["waiting_ranks"]) == ([0], [1])
    (job,) = c.jobs.find("joining")
    with c.lock:
        assert sorted(job.joining) == [0, 1]  # the two workers, not the launcher
