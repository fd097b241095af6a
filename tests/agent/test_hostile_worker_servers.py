"""What a linked process can do to its agent through its worker server, bounded: an answer
dripped a byte at a time, an answer of 512 MiB, 32 MiB of ``{},``. Each worker server here is the
attacker's program (a Unix socket served by a thread of this process, the pid the agent
expects); the agent's side is the real one."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import link
from hangwatch.agent.flightrecorder import RingFetcher
from hangwatch.agent.frquery import WorkerServerError, query, read_rings
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import Shipper
from hangwatch.client.ringsink import RingSink
from hangwatch.testing import wait_for
from tests.agent.test_shipper import Intake

Answer = Callable[[socket.socket], None]


def _http(body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + body


def drip(conn: socket.socket) -> None:
    """A valid answer, a byte every 0.2 s (no read of a socket ever times out)."""
    for byte in _http(b'{"entries": []}'):
        conn.sendall(bytes([byte]))
        time.sleep(0.2)


def huge(conn: socket.socket) -> None:
    """An answer that says it is 512 MiB, and sends it."""
    conn.sendall(_http(b"", 512 << 20))
    chunk = b" " * (1 << 20)
    for _ in range(512):
        conn.sendall(chunk)


def flood(conn: socket.socket) -> None:
    """15 MiB of ``{},``: JSON, under the size cap, a dict every three bytes."""
    body = b'{"entries": [' + b"{}," * (5 << 20) + b"{}]}"
    conn.sendall(_http(body))


def chunked(conn: socket.socket) -> None:
    body = b'{"entries": [], "pg_status": {}}'
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for part in (body[:7], body[7:]):
        conn.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
    conn.sendall(b"0\r\n\r\n")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Answer], str]]:
    servers: list[socketserver.UnixStreamServer] = []

    def start(answer: Answer) -> str:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.recv(65536)
                try:
                    answer(self.request)
                except OSError:
                    pass  # the agent hung up: as it should

        path = str(tmp_path / f"worker{len(servers)}.sock")
        server = socketserver.ThreadingUnixStreamServer(path, Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return path

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_dripped_answer_is_cut_at_the_read_s_deadline(serve: Callable[[Answer], str]) -> None:
    path = serve(drip)
    started = time.monotonic()
    with pytest.raises(WorkerServerError, match=r"no whole answer within 0\.5 s"):
        query(path, "fr_trace_json", expect_pid=os.getpid(), timeout_s=0.5)
    assert time.monotonic() - started < 1.5  # each byte came within any per-read timeout


def test_an_answer_past_the_cap_is_refused_unread(serve: Callable[[Answer], str]) -> None:
    path = serve(huge)
    tracemalloc.start()
    try:
        with pytest.raises(WorkerServerError, match="over 16777216"):
            query(path, "fr_trace_json", expect_pid=os.getpid(), timeout_s=5.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the attacker's own 1 MiB chunk is in this process too


def test_json_of_more_objects_than_its_size_allows_is_refused_unparsed(serve: Callable[[Answer], str]) -> None:
    path = serve(flood)
    tracemalloc.start()
    try:
        rings, errors = read_rings(path, os.getpid(), names=("cpu",), timeout_s=10.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rings == {} and "objects in" in errors["cpu"], errors
    assert peak < 64 << 20, peak  # the body itself, twice at most: never the 1.6 GB of its dicts


def test_a_chunked_answer_is_read(serve: Callable[[Answer], str]) -> None:
    rings, errors = read_rings(serve(chunked), os.getpid(), names=("cpu",))
    assert errors == {} and rings == {"cpu": {"entries": [], "pg_status": {}}}


def test_a_dripping_worker_server_holds_up_no_other_rank_s_reads(serve: Callable[[Answer], str]) -> None:
    """The fetcher's thread reads its ranks side by side: one rank whose reads take their whole
    deadline does not space out the others'."""
    slow, fast = serve(drip), "/run/fast.sock"
    fetcher = RingFetcher(interval_s=0.05, timeout_s=1.0)
    counted: dict[str, int] = {slow: 0, fast: 0}
    real = fetcher._read

    def read(path: str, pid: int, **kw: Any) -> Any:
        counted[path] += 1  # the fast rank answers at once; the slow one drips, for real
        return real(path, pid, **kw) if path == slow else ({"cpu": {"entries": []}}, {})

    fetcher._read = read
    fetcher.watch(1, slow, os.getpid())
    fetcher.watch(2, fast, os.getpid())
    try:
        wait_for(lambda: counted[slow] >= 1, 5, 0.01, "the slow rank's read")
        time.sleep(1.5)
        assert counted[fast] >= 10, counted  # about every 0.05 s, while the other's read hangs
    finally:
        fetcher.stop()


def test_a_rank_ending_with_a_dripping_worker_server_holds_up_no_other_rank(
    serve: Callable[[Answer], str], tmp_path: Path
) -> None:
    """A rank that says it is ending without handing its dump over is read once more through its
    worker server, which drips: that read ran on the shipper's thread, the one that ships every
    rank of the node, and held it for the answer's whole length (a real job's 15 s hang went
    undiagnosed). Now it runs on a reader thread and the shipper's ticks stay short."""
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake = Intake()
    fetcher = RingFetcher(interval_s=3600.0)
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), flight_recorder=fetcher)
    ending, other = RingSink(256, rank=0), RingSink(256, rank=1)
    hello = {"job_id": "j", "world_size": 2, "worker_socket": serve(drip)}
    a = link.connect(server.path, {**hello, "rank": 0, "session": "a"}, [ending.fd])
    b = link.connect(server.path, {**hello, "rank": 1, "session": "b", "worker_socket": ""}, [other.fd])
    assert a is not None and b is not None
    farewell = threading.Thread(target=link.farewell, args=(a, 5.0), daemon=True)
    try:
        wait_for(lambda: len(server.links()) == 2, 5, 0.01, "both links")
        shipper.tick()
        farewell.start()
        wait_for(lambda: any(lk.ending_at for lk in server.links()), 5, 0.01, "rank 0 ending")
        longest = 0.0
        for _ in range(20):
            started = time.monotonic()
            shipper.tick()
            longest = max(longest, time.monotonic() - started)
            time.sleep(0.05)
        assert longest < 0.3, longest  # the drip takes 4 s
        farewell.join(5)
        assert shipper._ranks and all(st.farewell for st in shipper._ranks.values() if st.identity.rank == 0)
    finally:
        a.close()
        b.close()
        fetcher.stop()
        server.stop()
        ending.close()
        other.close()
