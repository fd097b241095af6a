"""A launcher that is itself a rank (Lightning's subprocess launcher, ``mp.spawn``-style): rank 0
starts the other ranks by running the script again, then joins the job with them. Real processes,
real gloo, a real coordinator and its embedded agent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Rank 0 is the script as the user ran it; it starts ranks 1 and 2 as Lightning does, with their
# ranks in their environment, and then every rank joins. Rank 0 is then aborted (as gloo aborts a
# rank on a mismatch) while rank 2 waits in a subgroup's all_reduce for rank 1, busy in its own
# work: rank 0 stays a zombie (its parent, this test, does not reap it yet), ranks 1 and 2 are
# orphans under another parent.
LIGHTNING_STYLE = """
import os, subprocess, sys, time, datetime
import torch
import torch.distributed as dist

if "RANK" not in os.environ:  # the launcher: it is rank 0
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    with open("ranks.pids", "w") as pids:
        for r in (1, 2):
            env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}
            pids.write(f"{subprocess.Popen([sys.executable, *sys.argv], env=env).pid} ")
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
pair = dist.new_group([1, 2])
dist.barrier()
if rank == 0:
    os.abort()
elif rank == 1:
    time.sleep(600)  # @B its own work, while rank 2 waits
else:
    dist.all_reduce(torch.ones(4), group=pair)
"""


def test_when_the_launcher_rank_is_aborted_the_other_ranks_stacks_are_taken(
    coordinator_factory: Callable[..., Coordinator], tmp_path: Path
) -> None:
    c = coordinator_factory(stuck_after=3.0)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LIGHTNING_STYLE))
    port = testing.free_port()
    env = testing.job_env(f"127.0.0.1:{c.port}", {"HANGWATCH_JOB_ID": "lightning-style"})
    with open(tmp_path / "job.log", "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, str(script), str(port)], env=env, cwd=tmp_path, stdout=log, stderr=log
        )
    try:

        def stuck() -> dict[str, Any] | None:
            return next((i for i in c.incidents_json() if i["kind"] == "stuck_collective"), None)

        inc = wait_for(stuck, 60, 0.2, "the hang in the pair's all_reduce")
        assert (inc["culprit_ranks"], inc["waiting_ranks"]) == ([1], [2])

        def stacks() -> dict[str, Any] | None:
            full = c.incident_json(inc["id"])
            return full if full is not None and {"1", "2"} <= set(full["stacks"]) else None

        full = wait_for(stacks, 20, 0.2, "both ranks' stacks")
        assert "train.py" in full["stacks"]["1"] and "all_reduce" in full["stacks"]["2"]
        assert not any("refused" in note for note in full["stack_notes"].values()), full["stack_notes"]
        assert launcher.poll() is not None  # rank 0 is gone (a zombie until now)
    finally:
        pids = tmp_path / "ranks.pids"
        for pid in pids.read_text().split() if pids.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
