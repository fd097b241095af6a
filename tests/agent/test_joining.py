"""Processes linked before they are ranks (``client.joining``, ``agent.joining``): a real
process, a real agent socket; the client's hello as the agent parses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatch import records as r
from hangwatch.agent.rings import RingServer
from hangwatch.client import joining

_STARTING = textwrap.dedent(
    """
    import os, sys
    os.environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", HANGWATCH_AGENT_SOCKET=sys.argv[1],
                      HANGWATCH_JOB_ID='job "quoted"\\n', MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    from hangwatch.client import joining
    print("linked" if joining.start("127.0.0.1:1") else "not linked", flush=True)
    for line in sys.stdin:
        if line.strip() == "init":
            joining.entering_init()
        elif line.strip() == "joined":
            joining.joined()
        print("done", flush=True)
    """
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RingServer]:
    s = RingServer(str(tmp_path / "agent.sock"))
    s.start()
    yield s
    s.stop()


def _wait(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["joined", "died"])
def test_a_starting_process_is_proven_and_followed_to_init_and_its_end(server: RingServer, end: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _STARTING, server.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "linked"
        _wait(lambda: server.joining())
        (lk,) = server.joining()
        assert lk.peer.pid == child.pid and lk.phase == r.STARTING
        assert (lk.hello["rank"], lk.hello["world_size"], lk.hello["local_rank"]) == (1, 2, 1)
        assert lk.hello["job_id"] == 'job "quoted"\n' and lk.hello["launch"] == "10.0.0.1:29500"
        assert server.links() == []  # not a rank: no ring, nothing to read
        child.stdin.write("init\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        _wait(lambda: lk.phase == r.IN_INIT)
        if end == "joined":
            child.stdin.write("joined\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
            _wait(lambda: lk.closed_at is not None)
            assert lk.phase == ""  # joined: its rank's registration says the rest
        else:
            child.kill()
            _wait(lambda: lk.closed_at is not None)
            assert lk.phase == r.GONE
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


def test_the_hello_is_json_whatever_the_environment_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HANGWATCH_JOB_ID", 'a"b\\c\x01é')
    monkeypatch.setenv("LOCAL_RANK", "not a number")
    data = joining.hello(3, 4)
    assert int.from_bytes(data[:4], "little") == len(data) - 4
    hello = json.loads(data[4:])
    assert hello["job_id"] == 'a"b\\c\x01é' and hello["local_rank"] == -1
    assert (hello["phase"], hello["rank"], hello["world_size"], hello["pid"]) == ("starting", 3, 4, os.getpid())


def test_no_rank_from_the_launcher_or_no_agent_links_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HANGWATCH_AGENT_SOCKET", str(tmp_path / "nobody.sock"))
    monkeypatch.delenv("RANK", raising=False)
    assert joining.start("127.0.0.1:1") is False  # a launcher, a tool: no RANK
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    t0 = time.monotonic()
    assert joining.start("127.0.0.1:1") is False  # no agent on this node
    assert time.monotonic() - t0 < 0.5
