"""A rank in its own pid namespace (as in a container) is found, watched and dumped by its host pid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil
import pytest

from hangwatch.agent.core import NodeAgentCore
from hangwatch.agent.namespaces import NotVisible, local_pid, own_namespace
from hangwatch.records import ProcState, Target

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root to make a pid namespace"
)

RANK = """
import os, sys, time
print(os.getpid(), os.readlink("/proc/self/ns/pid"), flush=True)
def train_step_in_container():
    time.sleep(120)
train_step_in_container()
"""


def test_rank_in_another_pid_namespace() -> None:
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        inner_pid, namespace = proc.stdout.readline().split()
        assert namespace != own_namespace()
        # the python process is the child of unshare (which forked)
        host = next(c for c in psutil.Process(proc.pid).children(recursive=True) if "python" in c.name())
        target = Target(0, int(inner_pid), host.create_time(), namespace)
        assert local_pid(target) == host.pid
        core = NodeAgentCore()
        core.set_targets([target])
        statuses = core.poll(full=True)
        assert [s.pid for s in statuses] == [int(inner_pid)]  # reported as the rank knows itself
        assert statuses[0].state in (ProcState.SLEEPING, ProcState.RUNNING)
        dumps = core.dump([target], timeout_s=10)
        assert dumps[0].error is None, dumps[0].error
        assert "train_step_in_container" in dumps[0].text
        with pytest.raises(NotVisible):
            local_pid(Target(1, 5, 0.0, "pid:[1]"))
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait(10)
