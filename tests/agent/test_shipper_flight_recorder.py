"""The agent reads a rank's Flight Recorder from outside and ships what no Python call covered.

Real ring, real link, real shipper and the coordinator's real decoder (``test_shipper.Intake``);
the seam faked is the fetcher's ``read`` (what the rank's worker server answers), which returns
a dump saved from real gloo process groups (``tests/fixtures/flight_recorder``, never
hand-edited). The rank's Python calls are written into its ring as the hook writes them, with
the sequence numbers the real group reported (``calls.json``): seqs 1, 2 and 7 came from Python,
3 to 6 from DDP's constructor and its gradient bucket. ``test_capture``'s DDP job proves the
same end to end, through a real worker server.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent.flightrecorder import WHOLE_READ_EVERY_S, RingFetcher
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import Shipper
from hangwatch.client import workerserver
from hangwatch.client.ringsink import RingSink
from hangwatch.flight_entries import EntryTracker, PythonSeqs, entry_call_id
from hangwatch.testing import wait_for
from tests.agent.test_shipper import Intake

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "flight_recorder"
DUMP: dict[str, Any] = json.loads((FIXTURES / "one_rank.json").read_text())
PYTHON_CALLS: list[dict[str, Any]] = json.loads((FIXTURES / "calls.json").read_text())["one_rank.json"]
META = (r.TensorMeta((4,), "float32"),)


class Reads:
    """The worker server's answers, counted; ``dump`` may be changed between reads."""

    def __init__(self) -> None:
        self.dump: dict[str, Any] = DUMP
        self.asked: list[tuple[str, int]] = []

    def __call__(self, path: str, pid: int, **_: Any) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        self.asked.append((path, pid))
        return {"cpu": self.dump}, {}


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[RingServer, Shipper, Intake, Reads, RingSink]]:
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, reads = Intake(), Reads()
    fetcher = RingFetcher(interval_s=0.02, read=reads)
    sink = RingSink(256, rank=0)
    yield server, Shipper(server, intake, "node-1", PsutilInspector(), flight_recorder=fetcher), intake, reads, sink
    fetcher.stop()
    server.stop()
    sink.close()


def _hello(worker_socket: str) -> dict[str, Any]:
    return {"job_id": "j", "rank": 0, "world_size": 1, "session": "s0", "worker_socket": worker_socket}


def _python_calls(sink: RingSink, *, last_open: bool = False) -> None:
    for i, call in enumerate(PYTHON_CALLS, 1):
        done = not (last_open and i == len(PYTHON_CALLS))
        record = r.CallRecord(0, i, call["op"], "0", call["after"], META, META, "sum", enter_time=float(i))
        record.exit_time, record.seq_count = (float(i) + 0.5 if done else None), 1
        sink.put(record)


def _from_flight_recorder(intake: Intake) -> list[r.CallRecord]:
    return [e for e in intake.events.get(0, []) if isinstance(e, r.CallRecord) and e.source == "flight_recorder"]


def _ticks_until(shipper: Shipper, done: Any, what: str) -> None:
    def tick() -> bool:
        shipper.tick()
        return bool(done())

    wait_for(tick, 5, 0.02, what)


def test_entries_no_python_call_covered_are_shipped_once(rig: Any) -> None:
    server, shipper, intake, reads, sink = rig
    sock = link.connect(server.path, _hello("/run/rank0-worker.sock"), [sink.fd])
    assert sock is not None
    try:
        _python_calls(sink)
        _ticks_until(shipper, lambda: _from_flight_recorder(intake), "Flight Recorder records")
        assert reads.asked[0] == ("/run/rank0-worker.sock", os.getpid())  # the kernel's pid, asked of its socket
        records = _from_flight_recorder(intake)
        assert [(c.seq, c.op) for c in records] == [
            (3, "all_gather"),
            (4, "broadcast"),
            (5, "broadcast"),
            (6, "all_reduce"),
        ]
        assert [c.call_id for c in records] == [entry_call_id("0", s) for s in (3, 4, 5, 6)]
        assert records[-1].inputs == (r.TensorMeta((27,), "float32", "cpu"),)
        assert records[-1].call_site == "issued from C++ (gloo:all_reduce)"
        # retired in the ring: each travels complete (an exit beside it in one batch would be
        # applied before the call it closes, and the call would stay open at the coordinator)
        assert all(c.exit_time is not None and c.seq_count == 1 for c in records)
        python = [e for e in intake.events[0] if isinstance(e, r.CallRecord) and e.source != "flight_recorder"]
        assert [c.seq for c in python] == [1, 2, 7]
        before = len(reads.asked)
        _ticks_until(shipper, lambda: len(reads.asked) > before + 2, "more reads")
        assert len(_from_flight_recorder(intake)) == 4  # the same ring read again: nothing new
    finally:
        sock.close()


def test_batches_say_when_the_latest_read_whose_records_all_went_was_asked(rig: Any) -> None:
    """``flight_read_time``: the coordinator takes a rank for absent from a collective C++
    issued only once a read asked after it began has come with its records."""
    server, shipper, intake, _reads, sink = rig
    said: list[tuple[float, int]] = []
    accept = intake.accept_report

    def report(request: Any, relay: str = "") -> Any:
        said.append((request.flight_read_time, len(request.events)))
        return accept(request, relay)

    intake.accept_report = report
    sock = link.connect(server.path, _hello("/run/rank0-worker.sock"), [sink.fd])
    assert sock is not None
    try:
        before = time.time()
        _python_calls(sink)
        _ticks_until(shipper, lambda: _from_flight_recorder(intake), "Flight Recorder records")
        carried = [t for t, events in said if events]  # the batch that carried the read's records
        assert carried and carried[-1] >= before
        assert said[0][0] == 0.0  # the rank's first batch: no read yet
        _ticks_until(shipper, lambda: said[-1][0] > carried[-1], "a later read")  # the next heartbeat says it
        times = [t for t, _ in said]
        assert times == sorted(times)  # never back
    finally:
        sock.close()


def test_an_entry_is_not_reported_before_the_ring_that_covers_it_is_read(rig: Any) -> None:
    """The worker server is read on its own thread; the Python call behind an entry is in the
    rank's ring from before it was issued, so a read is reconciled only with a ring read past
    it. Here the ring was last read before the dump was taken (a batch the coordinator refused
    is sent again first): seq 7's Python call is not read yet and must not look C++-issued."""
    server, shipper, intake, _, sink = rig
    fetcher = shipper.fetcher
    fetcher.interval_s = 3600.0  # this test reads the worker server itself: fetcher.poll_once()
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    try:
        first, second, third = (
            r.CallRecord(0, i, c["op"], "0", c["after"], META, META, "sum", enter_time=float(i), exit_time=i + 0.5)
            for i, c in enumerate(PYTHON_CALLS, 1)
        )
        sink.put(first)
        sink.put(second)
        intake.refuse_next_report = True
        shipper.tick()  # reads seqs 1 and 2; the coordinator asks for a registration: kept
        sink.put(third)  # seq 7, from Python
        fetcher.poll_once()  # the dump: seqs 1 to 7
        shipper.tick()  # registers, sends the kept batch; the ring is not read past the dump yet
        assert _from_flight_recorder(intake) == []
        shipper.tick()
        assert [c.seq for c in _from_flight_recorder(intake)] == [3, 4, 5, 6]
    finally:
        sock.close()


def test_without_a_worker_socket_nothing_is_read(rig: Any) -> None:
    server, shipper, intake, reads, sink = rig
    sock = link.connect(server.path, _hello(""), [sink.fd])
    assert sock is not None
    try:
        _python_calls(sink)
        _ticks_until(
            shipper, lambda: len([e for e in intake.events.get(0, []) if isinstance(e, r.CallRecord)]) == 3, "calls"
        )
        assert reads.asked == [] and _from_flight_recorder(intake) == []
    finally:
        sock.close()


@pytest.mark.parametrize("handed", [None, b"not json", b"[1, 2]", b'{"cpu": 3}', b""])
def test_an_ending_rank_is_read_one_last_time_before_it_goes(rig: Any, handed: bytes | None) -> None:
    """DDP's last buckets before a rank exits: the periodic read may not have seen them. The rank
    says it is ending and waits; the agent reads the ring and Flight Recorder, ships, answers.
    With no dump handed over, or one that is not one (what a rank hands over is read as
    carefully as anything else it says: dropped), the agent asks the worker server while the
    rank still waits."""
    server, shipper, intake, reads, sink = rig
    reads.dump = {"entries": []}  # the periodic reads see nothing yet
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    stop = threading.Event()

    def ticking() -> None:
        while not stop.wait(0.05):
            shipper.tick()

    thread = threading.Thread(target=ticking)
    thread.start()
    fd = _dump_fd(handed) if handed is not None else None
    try:
        wait_for(lambda: intake.identities, 5, 0.02, "registered")
        shipper.fetcher.interval_s = 60.0  # from now on only the last read can see the entries
        reads.dump = DUMP
        _python_calls(sink)
        sink.put(r.RankEnd(0, r.EndKind.CLEAN_EXIT, 9.0, "interpreter exit", exit_code=0))
        assert link.farewell(sock, 2.0, fd)  # answered once everything below had arrived
        assert [c.seq for c in _from_flight_recorder(intake)] == [3, 4, 5, 6]
        assert any(isinstance(e, r.RankEnd) for e in intake.events[0])
    finally:
        if fd is not None:
            os.close(fd)
        stop.set()
        thread.join(5)
        sock.close()


def _dump_fd(body: bytes, *, seal: bool = True) -> int:
    """A memfd holding ``body``, sealed as ``workerserver.last_dump`` hands one over."""
    fd = os.memfd_create("last-read", os.MFD_ALLOW_SEALING)
    os.write(fd, body)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, workerserver.SEALS)
    return fd


def test_an_ending_rank_s_own_last_dump_is_read_after_it_is_gone(rig: Any) -> None:
    """An agent starved of CPU gets to an ending rank after the rank stopped waiting and exited;
    its worker server is gone with it. The dump the rank made of its rings as it ended, handed
    over with its farewell, still says what C++ issued last (DDP's last buckets): without it the
    coordinator could not tell a rank that left the loop early from one whose last reads were
    missed. The batch carrying them says the read came after the rank said it is ending."""
    server, shipper, intake, reads, sink = rig
    reads.dump = {"entries": []}  # the periodic reads see nothing
    said: list[float] = []
    accept = intake.accept_report

    def report(request: Any, relay: str = "") -> Any:
        if any(e.HasField("call") and e.call.source == "flight_recorder" for e in request.events):
            said.append(request.flight_read_time)
        return accept(request, relay)

    intake.accept_report = report
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    _ticks_until(shipper, lambda: intake.identities, "registered")
    shipper.fetcher.interval_s = 3600.0
    _python_calls(sink)
    sink.put(r.RankEnd(0, r.EndKind.CLEAN_EXIT, 9.0, "interpreter exit", exit_code=0))
    ending = time.time()
    fd = _dump_fd(json.dumps({"cpu": DUMP}).encode())
    try:
        assert link.farewell(sock, 0.05, fd) is False  # nobody ticks: the rank stops waiting
    finally:
        os.close(fd)
    sock.close()  # and exits
    wait_for(lambda: all(not lk.alive for lk in server.links()), 5, 0.02, "the link closed")
    asked = len(reads.asked)
    _ticks_until(shipper, lambda: _from_flight_recorder(intake), "the last read's records")
    assert [c.seq for c in _from_flight_recorder(intake)] == [3, 4, 5, 6]
    assert len(reads.asked) == asked  # the worker server, gone, was not asked
    assert said and said[0] >= ending
    assert any(isinstance(e, r.RankEnd) for e in intake.events[0])


def test_an_ending_rank_whose_last_read_finds_nothing_new_still_says_when_it_was_asked(rig: Any) -> None:
    """The periodic reads saw every entry (DDP's last bucket all-reduce retired, then read) and
    the rank ends: its last read finds nothing new and carries no records. The coordinator must
    still hear that a read asked after the end saw nothing more, or it cannot tell the rank's
    last C++ collectives known (a rank that skipped a backward and ran out of calls, found on
    CI: silent, its early end told by nothing)."""
    server, shipper, intake, _reads, sink = rig
    said: list[float] = []
    accept = intake.accept_report

    def report(request: Any, relay: str = "") -> Any:
        said.append(request.flight_read_time)
        return accept(request, relay)

    intake.accept_report = report
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    _python_calls(sink)
    _ticks_until(shipper, lambda: _from_flight_recorder(intake), "the periodic read's records")
    shipper.fetcher.interval_s = 3600.0  # no read but the last from now on
    time.sleep(0.05)
    sink.put(r.RankEnd(0, r.EndKind.CLEAN_EXIT, 9.0, "interpreter exit", exit_code=0))
    ending = time.time()
    fd = _dump_fd(json.dumps({"cpu": DUMP}).encode())  # the same entries: nothing new
    try:
        assert link.farewell(sock, 0.05, fd) is False  # nobody ticks: the rank stops waiting
    finally:
        os.close(fd)
    sock.close()
    wait_for(lambda: all(not lk.alive for lk in server.links()), 5, 0.02, "the link closed")
    _ticks_until(shipper, lambda: not server.links(), "the rank let go")
    assert len(_from_flight_recorder(intake)) == 4  # nothing shipped twice
    assert max(said) >= ending


def test_a_last_dump_over_its_bound_or_not_a_sealed_memfd_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hangwatch.agent import rings

    monkeypatch.setattr(rings, "LAST_READ_MAX", 8)
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    sink = RingSink(16, rank=0)
    try:
        for body, taken in ((b'{"cpu":{}}', None), (b"{}", b"{}")):
            sock = link.connect(server.path, _hello(""), [sink.fd])
            assert sock is not None
            fd = _dump_fd(body)
            link.farewell(sock, 0.05, fd)
            os.close(fd)
            wait_for(lambda: server.links()[-1].ending_at is not None, 5, 0.02, "ending")
            ours = server.links()[-1]
            assert ours.take_last_read() == taken
            assert ours.last_read_fd is None and ours.take_last_read() is None  # taken once, closed
            sock.close()
        # not a sealed memfd (a pipe; a memfd that may still change; a file, which could sit on
        # a mount that blocks a read): no dump, whatever it holds
        plain = tmp_path / "dump.json"
        plain.write_bytes(b"{}")
        read_end, write_end = os.pipe()
        os.write(write_end, b"{}")
        for handed in (read_end, _dump_fd(b"{}", seal=False), os.open(plain, os.O_RDONLY)):
            sock = link.connect(server.path, _hello(""), [sink.fd])
            assert sock is not None
            link.farewell(sock, 0.05, handed)
            os.close(handed)
            wait_for(lambda: server.links()[-1].ending_at is not None, 5, 0.02, "ending")
            assert server.links()[-1].take_last_read() is None
            sock.close()
        os.close(write_end)
    finally:
        server.stop()
        sink.close()


def test_a_farewell_without_an_agent_answer_returns_within_its_timeout(tmp_path: Path) -> None:
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    sink = RingSink(16, rank=0)
    try:
        sock = link.connect(server.path, _hello(""), [sink.fd])
        assert sock is not None
        assert link.farewell(sock, 0.2) is False  # nobody ships for this server
        sock.close()
        assert link.farewell(sock, 0.2) is False  # a closed socket: no exception either
    finally:
        server.stop()
        sink.close()


def test_an_agent_taking_over_a_ring_sends_nothing_twice(tmp_path: Path) -> None:
    """A node agent restarts (a DaemonSet rolling update) while its ranks run: each rank links
    to the new one, which reads the ring from its start. The coordinator (real, not started:
    its intake is called as the embedded agent calls it) says what it holds already; the new
    agent skips those calls, and the records it makes again from Flight Recorder are the same
    records, dropped. Every seq is held once, and the calls after the takeover arrive."""
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    coordinator = Coordinator(CoordinatorOptions(port=0, data_dir=str(tmp_path / "data"), embedded_agent=False))
    sink = RingSink(256, rank=0)
    hello = _hello("/run/w.sock")
    first, second, third = (
        r.CallRecord(0, i, c["op"], "0", c["after"], META, META, "sum", enter_time=float(i), exit_time=i + 0.5)
        for i, c in enumerate(PYTHON_CALLS, 1)
    )
    hello["world_size"] = 1

    def agent(name: str) -> tuple[RingServer, Shipper, RingFetcher]:
        server = RingServer(str(tmp_path / f"{name}.sock"))
        server.start()
        fetcher = RingFetcher(interval_s=3600.0, read=Reads())
        return server, Shipper(server, coordinator, "node-1", PsutilInspector(), flight_recorder=fetcher), fetcher

    try:
        old_server, old, old_fetcher = agent("old")
        sock = link.connect(old_server.path, hello, [sink.fd])
        assert sock is not None
        sink.put(first)
        sink.put(second)
        sink.put(third)
        wait_for(lambda: old_server.links(), 5, 0.02, "the link")
        old.tick()  # registers the rank and watches its worker server
        old_fetcher.poll_once()
        for _ in range(2):
            old.tick()
        old_server.stop()  # the old agent is gone; the rank links to the new one
        sock.close()
        new_server, new, new_fetcher = agent("new")
        sock = link.connect(new_server.path, hello, [sink.fd])
        assert sock is not None
        sink.put(r.CallRecord(0, 4, "all_reduce", "0", 8, META, META, "sum", enter_time=4.0, exit_time=4.5))
        wait_for(lambda: new_server.links(), 5, 0.02, "the new link")
        new.tick()
        new_fetcher.poll_once()
        for _ in range(2):
            new.tick()
        held = list(coordinator.job.ranks[0].history["0"])
        assert sorted(c.seq for c in held) == [1, 2, 3, 4, 5, 6, 7, 8]  # each once, seq 8 from after
        assert coordinator.job.duplicates == 4  # the four C++-issued ones, made again and dropped
        assert coordinator.job.ranks[0].via == "agent"
        sock.close()
        new_server.stop()
    finally:
        sink.close()


def test_entries_closed_in_the_read_that_made_them_arrive_complete(rig: Any) -> None:
    """NCCL keeps completed entries unretired: an entry is then closed by a later collective on
    its group, often one in the same read. A record made and closed in one read must travel
    complete, or the coordinator (which applies a batch's exits first) keeps it open, and the
    rank looks stuck in DDP's constructor (seen on an H100). The last one closes once a later
    Python call exists, or when its stream completes it (``state``)."""
    server, shipper, intake, reads, sink = rig
    entries = [dict(e, retired=False) for e in DUMP["entries"]]
    reads.dump = dict(DUMP, entries=entries)
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    try:
        _python_calls(sink)
        _ticks_until(shipper, lambda: len(_from_flight_recorder(intake)) == 4, "Flight Recorder records")
        records = _from_flight_recorder(intake)
        assert [c.seq for c in records] == [3, 4, 5, 6]
        assert all(c.exit_time is not None for c in records)  # each complete, none left open
        assert not [
            e for e in intake.events[0] if isinstance(e, r.CallExit) and e.call_id in {c.call_id for c in records}
        ]
    finally:
        sock.close()


class StatusReads:
    """A CUDA rank's worker server whose NCCL groups enqueued ``last`` collectives (its CPU ring
    empty); counts the NCCL ring's whole reads and its probes."""

    def __init__(self) -> None:
        self.last = {"0": 10}
        self.whole = 0
        self.probes = 0

    def __call__(
        self, path: str, pid: int, *, only_active: bool = False, names: Any = ("cpu", "nccl"), **_: Any
    ) -> Any:
        status = {g: {"last_enqueued_collective": str(s)} for g, s in self.last.items()}
        rings: dict[str, Any] = {"cpu": {"pg_status": {}, "entries": []}} if "cpu" in names else {}
        if "nccl" in names:
            if not only_active:
                self.whole += 1
                rings["nccl"] = {"pg_status": status, "entries": []}
            else:
                self.probes += 1
                rings["nccl"] = {"pg_status": status}
        return rings, {}


def test_a_probe_spares_the_whole_read_when_python_calls_account_for_every_new_seq() -> None:
    """Serialising a ring costs the rank ~22 us per entry whether new or not (bench/fr_read.py):
    the fetcher asks the NCCL ring for ``pg_status`` alone first, and reads its entries only when
    a group enqueued a seq since the last whole read that no Python call issued."""
    python = PythonSeqs()
    reads = StatusReads()
    fetcher = RingFetcher(interval_s=3600.0, read=reads)

    def needed(since: dict[str, tuple[int, int]]) -> bool:
        return not all(python.covers_all(g, lo, hi) for g, (lo, hi) in since.items())

    fetcher.watch(1, "/run/w.sock", 4242, needed)
    fetcher.poll_once()
    assert (reads.whole, reads.probes) == (1, 0)  # the first read is whole
    fetcher.poll_once()
    assert (reads.whole, fetcher.spared) == (1, 1)  # nothing enqueued since
    for seq in (11, 12, 13):  # Python calls, one seq each
        python.entered(seq, "0", seq)
        python.exited(seq, 1)
    reads.last = {"0": 13}
    fetcher.poll_once()
    assert (reads.whole, fetcher.spared) == (1, 2)  # all three were Python's
    python.entered(15, "0", 15)  # seq 14 went by without a Python call: issued from C++
    python.exited(15, 1)
    reads.last = {"0": 15}
    fetcher.poll_once()
    assert reads.whole == 2
    reads.last = {"0": 15, "1": 1}  # a new group, its first collective from C++
    fetcher.poll_once()
    assert reads.whole == 3
    assert fetcher.take(1) is not None
    fetcher.stop()


def test_coverage_of_a_seq_range() -> None:
    python = PythonSeqs()
    python.entered(1, "0", 1)
    python.exited(1, 3)  # a coalesced call: seqs 1-3
    python.entered(2, "0", 5)
    python.exited(2, 1)
    assert python.covers_all("0", 1, 3) and python.covers_all("0", 5, 5) and python.covers_all("0", 2, 1)
    assert not python.covers_all("0", 1, 5)  # 4 is nobody's
    assert not python.covers_all("1", 1, 1)
    python.entered(3, "0", 6)  # under way: surely its first seq; what else, not known yet
    assert python.covers_all("0", 5, 6) and not python.covers_all("0", 5, 9)
    assert python.covers("0", 9)  # for an entry the ring shows: a synchronous call covers what follows
    python.entered(4, "1", 3, async_op=True)  # an async call returns at once: its own seq only
    assert python.covers("1", 3) and not python.covers("1", 4)


# ---- found by an attacking review: async calls, the probe's counters, p2p entries ------------


def test_cxx_collectives_issued_while_an_async_python_call_is_pending_are_shipped(rig: Any) -> None:
    """An async call's exit comes when its work completes (the sender polls it): until then it
    covers its own seq, not every seq after it, so DDP's buckets issued meanwhile are shipped."""
    server, shipper, intake, reads, sink = rig
    reads.dump = dict(DUMP, entries=DUMP["entries"][:6])  # C++ issued 3-6 after the async call at 2
    shipper.fetcher.interval_s = 3600.0
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    try:
        sink.put(r.CallRecord(0, 1, "all_reduce", "0", 1, META, META, "sum", enter_time=1.0, exit_time=1.5))
        sink.put(r.CallRecord(0, 2, "all_reduce", "0", 2, META, META, "sum", enter_time=2.0, async_op=True))
        shipper.tick()
        shipper.fetcher.poll_once()  # read while the async work is not complete yet
        shipper.tick()
        assert [c.seq for c in _from_flight_recorder(intake)] == [3, 4, 5, 6]
    finally:
        sock.close()


def test_an_async_python_call_is_not_reported_again_from_flight_recorder(rig: Any) -> None:
    server, shipper, intake, _, sink = rig
    shipper.fetcher.interval_s = 3600.0
    sock = link.connect(server.path, _hello("/run/w.sock"), [sink.fd])
    assert sock is not None
    try:  # Python: 1, 2 (async, completes late), 7; C++: 3-6
        sink.put(r.CallRecord(0, 1, "all_reduce", "0", 1, META, META, "sum", enter_time=1.0, exit_time=1.5))
        sink.put(r.CallRecord(0, 2, "all_reduce", "0", 2, META, META, "sum", enter_time=2.0, async_op=True))
        sink.put(r.CallRecord(0, 3, "all_gather", "0", 7, META, META, None, enter_time=7.0, exit_time=7.5))
        shipper.tick()
        shipper.fetcher.poll_once()
        shipper.tick()
        sink.put(r.CallExit(0, 2, 8.0, None, 1))
        shipper.tick()
        held = sorted(c.seq for c in intake.events[0] if isinstance(c, r.CallRecord))
        assert held == [1, 2, 3, 4, 5, 6, 7]
    finally:
        sock.close()


class NcclRank:
    """A CUDA rank's worker server, its NCCL ring's entries and ``pg_status``. ProcessGroupNCCL
    enqueues p2p works with their p2p counter, so ``last_enqueued_collective`` can hold one."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.last: dict[str, int] = {}
        self.whole = 0

    def collective(self, group: str, seq: int) -> None:
        self.entries.append({"process_group": [group, ""], "collective_seq_id": seq, "is_p2p": False,
                             "profiling_name": "nccl:all_reduce", "state": "started", "retired": False})  # fmt: skip
        self.last[group] = seq

    def p2p(self, group: str, coll_seq: int, p2p_seq: int) -> None:
        self.entries.append({"process_group": [group, ""], "collective_seq_id": coll_seq, "p2p_seq_id": p2p_seq,
                             "is_p2p": True, "profiling_name": "nccl:send 0->1", "state": "completed",
                             "retired": True})  # fmt: skip
        self.last[group] = p2p_seq

    def __call__(
        self, path: str, pid: int, *, only_active: bool = False, names: Any = ("cpu", "nccl"), **_: Any
    ) -> Any:
        status = {g: {"last_enqueued_collective": str(s)} for g, s in self.last.items()}
        if "nccl" not in names:
            return {}, {}
        if not only_active:
            self.whole += 1
            return {"nccl": {"pg_status": status, "entries": list(self.entries)}}, {}
        active = [e for e in self.entries if e["state"] != "completed"]
        return {"nccl": {"pg_status": status, "entries": active}}, {}


def _probing(rank: NcclRank, python: PythonSeqs) -> RingFetcher:
    fetcher = RingFetcher(interval_s=3600.0, read=rank)
    fetcher.watch(
        1, "/run/w.sock", 4242, lambda since: not all(python.covers_all(g, a, b) for g, (a, b) in since.items())
    )
    return fetcher


def test_a_cxx_collective_after_p2p_traffic_is_read() -> None:
    rank, python = NcclRank(), PythonSeqs()
    fetcher = _probing(rank, python)
    python.entered(1, "pp", 1)
    python.exited(1, 1)
    rank.collective("pp", 1)
    for i in range(1, 41):  # pipeline sends: the counter shows p2p seqs up to 40
        rank.p2p("pp", 1, i)
    fetcher.poll_once()
    rank.collective("pp", 2)  # C++-issued, and the rank hangs in it: 2 < 40
    whole = rank.whole
    fetcher.poll_once()
    assert rank.whole == whole + 1


def test_a_probe_while_a_python_call_is_open_does_not_spare_the_seqs_after_it() -> None:
    rank, python = NcclRank(), PythonSeqs()
    fetcher = _probing(rank, python)
    rank.collective("0", 1)
    python.entered(1, "0", 1)
    python.exited(1, 1)
    fetcher.poll_once()
    python.entered(2, "0", 2)  # the shipper read its ENTER, not yet its EXIT
    for seq in (2, 3, 4):  # 3 and 4: DDP's buckets, from C++
        rank.collective("0", seq)
    whole = rank.whole
    fetcher.poll_once()
    assert rank.whole == whole + 1


def test_the_nccl_ring_is_read_whole_now_and_then_whatever_the_probe_says() -> None:
    rank = NcclRank()
    clock = [100.0]
    fetcher = RingFetcher(interval_s=3600.0, read=rank, clock=lambda: clock[0])
    fetcher.watch(1, "/run/w.sock", 4242, lambda since: False)  # the probe would spare every read
    rank.collective("0", 1)
    fetcher.poll_once()
    rank.collective("0", 2)
    fetcher.poll_once()
    assert rank.whole == 1
    clock[0] += WHOLE_READ_EVERY_S
    fetcher.poll_once()
    assert rank.whole == 2


def test_nccl_p2p_entries_are_not_collectives() -> None:
    """NCCL records a p2p op with the group's last collective seq and ``is_p2p``: a completed send
    must not close the collective still running before it, nor stand in for one evicted."""

    def coll(seq: int, done: bool) -> dict[str, Any]:
        return {"process_group": ["0", ""], "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
                "profiling_name": "nccl:all_reduce", "state": "completed" if done else "started",
                "retired": done, "input_sizes": [[4]], "input_dtypes": ["Float"]}  # fmt: skip

    def send(coll_seq: int, p2p_seq: int) -> dict[str, Any]:
        return {"process_group": ["0", ""], "collective_seq_id": coll_seq, "p2p_seq_id": p2p_seq, "is_p2p": True,
                "profiling_name": "nccl:send 0->1", "state": "completed", "retired": True,
                "input_sizes": [[8]], "input_dtypes": ["Float"]}  # fmt: skip

    tracker, python = EntryTracker(0), PythonSeqs()
    (running,) = tracker.update([coll(1, False)], python, 0, 1.0)
    assert isinstance(running, r.CallRecord) and running.exit_time is None
    assert tracker.update([coll(1, False), send(1, 1)], python, 0, 2.0) == []
    assert EntryTracker(0).update([send(5, p) for p in range(1, 4)], python, 0, 1.0) == []


def test_a_rank_whose_reads_cost_more_than_the_budget_is_read_less_often_and_status_says_so() -> None:
    """``READ_BUDGET``: a read of a full NCCL ring costs the rank 43-59 ms (BENCHMARKS.md); read
    every second, that is 5 % of a core. The fetcher spaces such a rank's reads so they stay
    under 1 %, and says so for ``status``; a cheap read is left as it was."""
    from hangwatch.agent.flightrecorder import READ_BUDGET

    clock = [1000.0]
    cost = {4242: 0.05, 4343: 0.002}
    reads = {4242: 0, 4343: 0}

    def read(path: str, pid: int, **_: Any) -> Any:
        clock[0] += cost[pid]
        reads[pid] += 1
        return {"cpu": {"pg_status": {}, "entries": []}}, {}

    fetcher = RingFetcher(interval_s=1.0, read=read, clock=lambda: clock[0], background=False)
    fetcher.watch(1, "/run/a.sock", 4242)
    fetcher.watch(2, "/run/b.sock", 4343)
    for _ in range(30):  # 30 ticks of the fetcher's thread, a second apart
        fetcher.poll_once(due_only=True)
        clock[0] += 1.0
    assert reads[4343] == 30  # cheap: every tick
    assert 4 <= reads[4242] <= 8  # 50 ms a read under 1 % of a core: one read every 5 s
    assert fetcher._watched[1].every >= 0.05 / READ_BUDGET - 1e-9
    assert "Flight Recorder read every 5.0 s, not every 1 s" in fetcher.note(1)
    assert "about 50 ms" in fetcher.note(1) and fetcher.note(2) == ""
    fetcher.ask_now(1)  # a rank that is ending is read at once, whatever it costs
    wait_for(lambda: fetcher.asked(1)[0], 5, 0.01, "the last read")
    assert fetcher.asked(1)[1] is not None
    fetcher.stop()


def test_a_rank_is_read_at_least_every_max_read_every_s_whatever_it_costs() -> None:
    """A read that costs 0.5 s (a huge NCCL ring, or one that times out) would be spaced 50 s
    apart under the budget: the coordinator would take the rank's reads for stopped
    (``FLIGHT_STALE_S``). It is read every ``MAX_READ_EVERY_S``, and ``status`` says what it costs."""
    from hangwatch.agent.flightrecorder import MAX_READ_EVERY_S
    from hangwatch.diagnosis.detectors.horizon import FLIGHT_STALE_S

    clock = [1000.0]
    reads = [0]

    def read(path: str, pid: int, **_: Any) -> Any:
        clock[0] += 0.5
        reads[0] += 1
        return {"cpu": {"pg_status": {}, "entries": []}}, {}

    fetcher = RingFetcher(interval_s=1.0, read=read, clock=lambda: clock[0], background=False)
    fetcher.watch(1, "/run/a.sock", 4242)
    for _ in range(100):
        fetcher.poll_once(due_only=True)
        clock[0] += 1.0
    assert fetcher._watched[1].every == MAX_READ_EVERY_S < FLIGHT_STALE_S / 2
    assert 4 <= reads[0] <= 7  # every 20 s over 100 s
    assert "2.5% of a core: read at least every 20 s whatever it costs" in fetcher.note(1)
    fetcher.stop()


def test_a_read_of_which_a_ring_failed_says_nothing_of_when_cxx_was_last_seen(rig: Any) -> None:
    """Found by a review: the CPU ring timed out while the NCCL ring answered, and every batch
    said "read at T" while the CPU ring's collectives, C++'s among them, never came."""
    server, shipper, intake, reads, sink = rig
    said: list[float] = []
    accept = intake.accept_report

    def report(request: Any, relay: str = "") -> Any:
        said.append(request.flight_read_time)
        return accept(request, relay)

    def failing(path: str, pid: int, **_: Any) -> Any:
        reads.asked.append((path, pid))
        return {"nccl": {"pg_status": {}, "entries": []}}, {"cpu": "fr_trace_json: timed out"}

    intake.accept_report = report
    shipper.fetcher._read = failing
    sock = link.connect(server.path, _hello("/run/rank0-worker.sock"), [sink.fd])
    assert sock is not None
    try:
        _python_calls(sink)
        _ticks_until(shipper, lambda: len(reads.asked) > 3 and len(said) > 1, "reads and batches")
        assert set(said) == {0.0} and not _from_flight_recorder(intake)
    finally:
        sock.close()


def test_a_ring_that_overwrote_the_entry_of_the_op_under_way_says_so_in_the_header(rig: Any) -> None:
    """The shipper passes the ring's counters to the tracker: a read whose ring lost entries
    (its first record id 40, none read before) while group 0 has an op under way that no entry
    and no Python call explains puts group 0 in ``flight_unseen``, and ``status``'s note says
    how many entries were overwritten unread; once the group completes it, neither is said of
    the group again."""
    server, shipper, intake, reads, sink = rig
    said: list[tuple[list[str], str]] = []
    accept = intake.accept_report

    def report(request: Any, relay: str = "") -> Any:
        said.append((list(request.flight_unseen), request.budget_note))
        return accept(request, relay)

    intake.accept_report = report
    entries = [dict(e, record_id=40 + i) for i, e in enumerate(DUMP["entries"])]
    under_way = {"last_enqueued_collective": "8", "last_completed_collective": "7", "last_started_collective": "-1"}
    reads.dump = dict(DUMP, entries=entries, pg_status={"0": under_way})
    sock = link.connect(server.path, _hello("/run/rank0-worker.sock"), [sink.fd])
    assert sock is not None
    try:
        _python_calls(sink)
        _ticks_until(shipper, lambda: any(unseen for unseen, _ in said), "a header saying group 0 unseen")
        unseen, note = next((u, n) for u, n in said if u)
        assert unseen == ["0"]
        assert "40 CPU Flight Recorder entries overwritten before a read" in note
        done = {"last_enqueued_collective": "8", "last_completed_collective": "8", "last_started_collective": "-1"}
        reads.dump = dict(reads.dump, pg_status={"0": done})
        count = len(said)
        _ticks_until(shipper, lambda: len(said) > count and not said[-1][0], "group 0 no longer unseen")
    finally:
        sock.close()
