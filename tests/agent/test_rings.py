"""The agent's rank links, with real processes: identity from the kernel, death seen at once,
the ring read after the rank is gone; bad hellos refused without hurting the server."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hangwatch import link
from hangwatch.agent.rings import RingServer
from hangwatch.cli.parser import build_parser
from hangwatch.ring import Kind, RingWriter

_RANK = textwrap.dedent(
    """
    import sys, time
    from hangwatch import link
    from hangwatch.ring import Kind, RingWriter
    w = RingWriter(capacity=4096, blob_bytes=4096, rank=1)
    sock = link.connect(sys.argv[1], {"rank": 1, "pid": 1}, [w.fd])  # the claimed pid is a lie
    print("linked" if sock is not None else "no agent", flush=True)
    for i in range(1, 1001):
        w.write(Kind.ENTER, 0, 0, 0, i, i, 0, 0, time.time())
        w.write(Kind.EXIT, 0, 1, 0, i, 0, 0, 0, time.time())
    w.write(Kind.ENTER, 0, 0, 0, 1001, 1001, 0, 0, time.time())
    print("wrote", flush=True)
    time.sleep(60)
    """
)


class Agent:
    """A real RingServer on a socket in ``tmp_path``, and the links it saw close."""

    def __init__(self, path: str) -> None:
        self.closed = threading.Event()
        self.server = RingServer(path, on_close=lambda _lk: self.closed.set())


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(str(tmp_path / "agent.sock"))
    a.server.start()
    yield a
    a.server.stop()


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_sigkilled_rank_is_named_by_the_kernel_and_its_ring_outlives_it(agent: Agent) -> None:
    server = agent.server
    child = subprocess.Popen([sys.executable, "-c", _RANK, server.path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "linked"
        assert child.stdout.readline().strip() == "wrote"
        (lk,) = server.links()
        assert lk.peer.pid == child.pid and lk.peer.uid == os.getuid()  # not the claimed pid 1
        assert lk.hello == {"rank": 1, "pid": 1} and lk.alive
        killed = time.time()
        os.kill(child.pid, signal.SIGKILL)
        assert agent.closed.wait(5)
        assert lk.closed_at is not None and lk.closed_at - killed < 1.0
        batch = lk.reader.poll()
        assert batch.lost == 0 and len(batch.slots) == 2001
        assert (batch.slots[-1].kind, batch.slots[-1].call_id) == (Kind.ENTER, 1001)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


def test_without_an_agent_the_rank_goes_on(tmp_path: Path) -> None:
    w = RingWriter(capacity=4, blob_bytes=64)
    t0 = time.monotonic()
    assert link.connect(str(tmp_path / "nobody.sock"), {"rank": 0}, [w.fd]) is None
    assert time.monotonic() - t0 < 1.0
    w.close()


def test_bad_hellos_are_refused_and_the_server_keeps_serving(agent: Agent) -> None:
    server = agent.server

    def raw(payload: bytes, fds: list[int]) -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(server.path)
        if fds:
            socket.send_fds(s, [payload], fds)
        else:
            s.sendall(payload)
        reply = s.recv(1)
        s.close()
        return reply

    not_a_ring = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
    os.ftruncate(not_a_ring, 4096)
    fcntl.fcntl(not_a_ring, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    assert raw(link.encode_hello({"rank": 0}), []) == b""  # no descriptor
    assert raw(b"\x05\x00\x00\x00nope!", [not_a_ring]) == b""  # not JSON
    assert raw(link.encode_hello({"rank": 0}), [not_a_ring]) == b""  # not a ring
    assert raw(b"\xff\xff\xff\x7f", [not_a_ring]) == b""  # absurd length
    os.close(not_a_ring)
    _wait(lambda: server.refused == 4)
    w = RingWriter(capacity=4, blob_bytes=64)
    sock = link.connect(server.path, {"rank": 2}, [w.fd])
    assert sock is not None
    _wait(lambda: len(server.links()) == 1)
    assert server.links()[0].peer.pid == os.getpid()
    sock.close()
    w.close()


def test_the_socket_is_private_to_the_agents_user(agent: Agent) -> None:
    assert os.stat(agent.server.path).st_mode & 0o777 == 0o600


def test_a_root_agent_may_open_its_socket_to_every_users_ranks(tmp_path: Path) -> None:
    server = RingServer(str(tmp_path / "shared.sock"), mode=0o666)
    server.start()
    try:
        assert os.stat(server.path).st_mode & 0o777 == 0o666
    finally:
        server.stop()
    with pytest.raises(ValueError, match="at most 0666"):
        RingServer(str(tmp_path / "x.sock"), mode=0o4777)
    parser = build_parser()
    assert parser.parse_args(["agent", "--rank-socket-mode", "0666"]).rank_socket_mode == 0o666
    assert parser.parse_args(["agent"]).rank_socket_mode == 0o600
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--rank-socket-mode", "rw-rw-rw-"])


def test_a_live_agents_socket_is_not_taken_over_and_a_stale_one_is(agent: Agent, tmp_path: Path) -> None:
    with pytest.raises(OSError, match="served by another agent"):
        RingServer(agent.server.path).start()
    assert os.path.exists(agent.server.path)
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))  # bound, never listening: what a killed agent leaves
    s.close()
    second = RingServer(str(stale))
    second.start()
    second.stop()


def _wakeups(tid: int) -> int:
    """Times thread ``tid`` of this process went to sleep of its own accord so far."""
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def test_the_selector_sleeps_until_a_link_or_stop_wakes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no rank, the selector thread does not wake to look for a stop (it woke 5 times a
    second); ``stop`` wakes it at once however long its wait, and a rank linking still does."""
    from hangwatch.agent import rings

    monkeypatch.setattr(rings, "SELECT_S", 3600.0)
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    assert server._thread is not None and server._thread.native_id is not None
    tid = server._thread.native_id
    time.sleep(0.2)
    before = _wakeups(tid)
    time.sleep(1.0)
    assert _wakeups(tid) - before <= 1
    w = RingWriter(capacity=64, blob_bytes=256, rank=0)
    sock = link.connect(server.path, {"rank": 0}, [w.fd])
    assert sock is not None  # accepted, and acknowledged, by the sleeping selector
    assert server.changed.wait(5.0) and len(server.links()) == 1
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 1.5 and not server._thread.is_alive()
    sock.close()
    w.close()


def test_a_hello_nested_past_the_recursion_limit_is_a_refused_link_not_a_dead_loop(agent: Agent) -> None:
    """16,000 nested ``[`` raised RecursionError out of the hello's parse and stopped the link
    loop for good: no rank could link until the agent restarted."""
    server = agent.server
    w = RingWriter(capacity=4, blob_bytes=64)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(server.path)
    deep = b"[" * 16000
    socket.send_fds(s, [struct.pack("<I", len(deep)) + deep], [w.fd])
    assert s.recv(1) == b""  # refused
    s.close()
    _wait(lambda: server.refused == 1)
    sock = link.connect(server.path, {"rank": 0, "session": "after"}, [w.fd])
    assert sock is not None, "the loop stopped serving"
    sock.close()
    w.close()


def test_a_dripped_hello_holds_up_no_other_rank(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hello sent one byte every 0.5 s held the selector thread for its whole length: ranks
    linking meanwhile timed out and shipped their own records, unproven. Now each hello is taken
    as it comes, on a deadline of its own."""
    from hangwatch.agent import rings

    monkeypatch.setattr(rings, "HELLO_TIMEOUT_S", 2.0)
    server = agent.server
    w = RingWriter(capacity=4, blob_bytes=64)
    payload = link.encode_hello({"rank": 9, "session": "slow", "pad": "x" * 64})
    drip = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    drip.connect(server.path)
    socket.send_fds(drip, [payload[:5]], [w.fd])
    stop = threading.Event()

    def dripping() -> None:
        for byte in payload[5:]:
            if stop.wait(0.5):
                return
            try:
                drip.send(bytes([byte]))
            except OSError:
                return

    dripper = threading.Thread(target=dripping, daemon=True)
    dripper.start()
    try:
        time.sleep(0.3)
        started = time.monotonic()
        sock = link.connect(server.path, {"rank": 1, "session": "prompt"}, [w.fd], timeout_s=1.0)
        assert sock is not None and time.monotonic() - started < 1.0
        _wait(lambda: server.refused == 1, timeout=5)  # the dripper, at its deadline
        assert [lk.hello["rank"] for lk in server.links()] == [1]
        sock.close()
    finally:
        stop.set()
        dripper.join(5)
        drip.close()
        w.close()


def test_hellos_under_way_are_bounded(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    from hangwatch.agent import rings

    monkeypatch.setattr(rings, "MAX_PENDING", 3)
    monkeypatch.setattr(rings, "HELLO_TIMEOUT_S", 2.0)
    silent = []
    for _ in range(5):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(agent.server.path)
        silent.append(s)
    _wait(lambda: agent.server.refused >= 2, timeout=1.5)  # beyond 3 at once, at once
    _wait(lambda: agent.server.refused == 5, timeout=5)  # the rest at their deadline
    for s in silent:
        s.close()


def test_a_link_forgotten_while_open_leaves_its_socket_to_no_later_link(agent: Agent) -> None:
    """The shipper forgets a rank link the coordinator refused while its socket is open; the
    next link, given the same descriptor number, is served (in CI a look-alike's rank 3 never
    linked: its socket's number was still registered to the forgotten one, and it was blamed)."""
    server = agent.server
    w = RingWriter(capacity=4, blob_bytes=64)
    try:
        for attempt in range(3):
            sock = link.connect(server.path, {"rank": attempt}, [w.fd])
            assert sock is not None
            _wait(lambda: len(server.links()) == 1)
            (lk,) = server.links()
            server.forget(lk)  # from another thread than the selector's, the link still open
            assert server.links() == []
            sock.settimeout(5)
            assert sock.recv(1) == b""  # the rank sees its link closed
            sock.close()
        assert server.refused == 0
    finally:
        w.close()
