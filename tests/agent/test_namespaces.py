"""A rank in its own pid namespace (as in a container) is found, watched and dumped by its host pid."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hangwatch.agent.core import NodeAgentCore
from hangwatch.agent.namespaces import NotVisible, local_pid, own_namespace, path_of
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
        target = Target(0, int(inner_pid), host.create_time(), namespace, link="L")
        assert local_pid(target) == host.pid
        core = NodeAgentCore()
        core.proofs.add(host.pid, os.getuid(), host.create_time(), "L")  # as its link to the agent would
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


SOCKET_IN_CONTAINER = """
import os, socket, sys
path = os.path.join(sys.argv[1], "worker.sock")
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(1)
print(os.getpid(), path, flush=True)
conn, _ = server.accept()
conn.sendall(b"from inside")
conn.close()
"""


def test_a_socket_in_another_mount_namespace_is_reached_through_proc_root(tmp_path: Path) -> None:
    """A training container's worker-server socket lives in the container's own /tmp: the same
    path names nothing in the agent's mount namespace, and ``path_of`` finds it all the same."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    script = f"mount -t tmpfs none {shared} && exec {sys.executable} -c '{SOCKET_IN_CONTAINER}' {shared}"
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        pid, path = proc.stdout.readline().split()
        assert int(pid) == proc.pid and not os.path.exists(path)  # invisible from here as named
        reachable = path_of(int(pid), path)
        assert reachable == f"/proc/{pid}/root{path}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(reachable)
            assert s.recv(64) == b"from inside"
        assert path_of(os.getpid(), "/tmp/x.sock") == "/tmp/x.sock"  # one namespace: as named
        assert path_of(2**22 + 7, "/tmp/x.sock") == "/tmp/x.sock"  # no such process: as named
    finally:
        proc.kill()
        proc.wait(10)
