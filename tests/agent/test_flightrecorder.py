"""Reading a real rank's Flight Recorder from outside, through the worker server the hook starts.

A one-rank gloo process makes three ``all_reduce`` calls, starts its worker server with
``hangwatch.client.workerserver.start`` and then holds its GIL in a native call (a regular
expression that backtracks for seconds): the agent's read still answers, with the three
collectives, in well under a second; the dump it makes of itself as it ends
(``workerserver.last_dump``) is the same ring. A socket served by another pid is refused before
a byte is sent, and a rank with no server gives a clear error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hangwatch.agent.frquery import WorkerServerError, query, read_rings, rings_of_dump

pytestmark = pytest.mark.slow  # starts torch in a subprocess (a few seconds)

_RANK = textwrap.dedent(
    """
    import os, re, sys, time
    os.environ.update(TORCH_FR_BUFFER_SIZE="64", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1],
                      RANK="0", WORLD_SIZE="1")
    import torch, torch.distributed as dist
    from hangwatch.client import workerserver
    dist.init_process_group("gloo")
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    ws = workerserver.start(workerserver.planned_path())
    print(ws.path if ws else "none", flush=True)
    time.sleep(0.3)
    print("holding the GIL", flush=True)
    re.match(r"(a+)+$", "a" * 26 + "b")  # native, GIL held, about 3 s
    print("released", flush=True)
    ws.stop()
    fd = workerserver.last_dump()  # what the rank hands its agent as it ends
    import fcntl
    from hangwatch.agent.rings import LAST_READ_SEALS
    print(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & LAST_READ_SEALS == LAST_READ_SEALS, flush=True)
    print(os.pread(fd, os.fstat(fd).st_size, 0).decode(), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_the_ring_is_read_while_the_rank_holds_its_gil(tmp_path: Path) -> None:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(_free_port())], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert rank.stdout is not None
        path = rank.stdout.readline().strip()
        assert path.startswith(str(tmp_path)) and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        assert rank.stdout.readline().strip() == "holding the GIL"
        time.sleep(0.2)
        t0 = time.monotonic()
        rings, errors = read_rings(path, rank.pid)
        took = time.monotonic() - t0
        assert rank.poll() is None and took < 1.0, took
        assert errors == {} and set(rings) == {"cpu"}  # a CPU build has no NCCL ring
        entries = [e for e in rings["cpu"]["entries"] if e["profiling_name"].endswith("all_reduce")]
        assert [e["collective_seq_id"] for e in entries] == [1, 2, 3]
        with pytest.raises(WorkerServerError, match="not by the rank's pid"):
            query(path, "ping", expect_pid=os.getpid())
        assert query(path, "ping", expect_pid=rank.pid) == b"pong"
        assert rank.stdout.readline().strip() == "released"  # it was frozen, and we read it anyway
        # the dump the rank makes of itself as it ends is the ring its worker server answered,
        # in a memfd sealed as its agent requires
        assert rank.stdout.readline().strip() == "True"
        handed, errors = rings_of_dump(rank.stdout.readline().encode())
        assert errors == {} and set(handed) == {"cpu"}
        assert [e["record_id"] for e in handed["cpu"]["entries"]] == [e["record_id"] for e in rings["cpu"]["entries"]]
        assert handed["cpu"]["pg_status"] == rings["cpu"]["pg_status"]
    finally:
        rank.kill()
        rank.wait(timeout=10)


def test_no_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WorkerServerError, match="No such file"):
        query(str(tmp_path / "absent.sock"), "ping", expect_pid=None, timeout_s=0.5)
