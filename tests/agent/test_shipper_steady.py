"""A rank in a steady state has its ring looked at every ``STEADY_S`` and read every ``READ_S``,
not every tick; a rank that goes quiet, or stays inside a call for a tick, is read at once, and
anything else a detector waits for by the next ``READ_S``, then every tick.

Real ring, real link, real shipper and the coordinator's real decoder (``test_shipper.Intake``,
with runs on); the shipper's monotonic clock is driven, so "a tick" is ``TICK_S`` of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent import shipped as shipped_module
from hangwatch.agent import shipper as shipper_module
from hangwatch.agent.flightrecorder import RingFetcher
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipped import MAX_PACE_S
from hangwatch.agent.shipper import READ_S, STEADY_S, TICK_S, Shipper
from hangwatch.client.ringsink import RingSink
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import HEADER_SIZE, SLOT_SIZE, Kind, RingReader, RingWriter
from hangwatch.ringwire import RingEncoder, call_blob
from hangwatch.testing import wait_for
from tests.agent.test_shipper_hold import RunsIntake, _ids

META = (r.TensorMeta((4,), "float32"),)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Counting(RunsIntake):
    def __init__(self) -> None:
        super().__init__()
        self.reports = 0

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        self.reports += 1
        return super().accept_report(request, relay)


@pytest.fixture(params=[True, False], ids=["read less", "HANGWATCH_READ_LESS=0"])
def read_less(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setenv("HANGWATCH_READ_LESS", "1" if request.param else "0")
    return bool(request.param)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Shipper, Counting, RingSink, Clock]]:
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, clock, sink = Counting(), Clock(), RingSink(4096, rank=0)
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), mono=clock, heartbeat_s=3600.0)
    sock = link.connect(server.path, {"job_id": "j", "rank": 0, "world_size": 2, "session": "s0"}, [sink.fd])
    wait_for(lambda: server.links(), 5, 0.02, "the link")
    yield shipper, intake, sink, clock
    sock.close()
    sink.close()
    server.stop()


def _call(
    call_id: int, op: str = "all_reduce", done: bool = True, error: str | None = None, t: float | None = None
) -> r.CallRecord:
    """A call written now (the agent reads a rank that wrote nothing for a tick at once)."""
    t = time.time() if t is None else t
    call = r.CallRecord(0, call_id, op, "0", call_id, META, META, "sum", enter_time=t, call_site=f"t.py:{op}")
    call.exit_time = t + 0.0005 if done else None
    call.error = error
    return call


def _ticks(shipper: Shipper, clock: Clock, n: int) -> None:
    for _ in range(n):
        clock.now += TICK_S
        shipper.tick()


def _steady(shipper: Shipper, sink: RingSink, clock: Clock, ids: Iterator[int]) -> None:
    """A first call of its kind, then runs of the same call, until the rank is steady."""
    for _ in range(3):
        for _ in range(5):
            sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
    assert shipper._ranks and all(s.encoder.steady for s in shipper._ranks.values())


def _steady_read_no_more(
    shipper: Shipper, sink: RingSink, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[int]:
    """A steady rank, read, whose next ``READ_S`` is an hour off: read again only where a look
    says so. The ids to go on."""
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    monkeypatch.setattr(shipped_module, "READ_S", 3600.0)  # (``shipped.read_every``)
    clock.now += STEADY_S
    shipper.tick()  # read in this READ_S
    return ids


def _steady_and_five_more(shipper: Shipper, sink: RingSink, clock: Clock) -> Iterator[int]:
    """A steady rank with five more of its calls written since its last read; the ids to go on."""
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    for _ in range(5):
        sink.put(_call(next(ids)))
    return ids


def test_a_steady_rank_that_keeps_writing_is_read_every_read_s(read_less: bool, rig: Any) -> None:
    shipper, intake, sink, clock = rig
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    clock.now = (clock.now // READ_S + 1) * READ_S + 0.01  # at the start of a READ_S period
    shipper.tick()  # read there
    before = intake.reports
    ticks = round(2 * READ_S / TICK_S)
    for _ in range(ticks):
        for _ in range(5):
            sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
    # one read a READ_S (looked at every STEADY_S between), not one a tick; every tick where turned off
    assert intake.reports - before == (2 if read_less else ticks)
    _ticks(shipper, clock, ticks)  # nothing written: every call sent, none twice
    sent = _ids(intake.events[0])
    assert sent == list(range(1, sent[-1] + 1)) and len(sent) >= 5 * (3 + ticks) - 1


def _five_more_then_quiet(shipper: Shipper, sink: RingSink, clock: Clock, ids: Iterator[int]) -> int:
    """Five more calls, then nothing: two looks (the second finds nothing since, some unread,
    and reads at once). The last call's id."""
    last = 0
    for _ in range(5):
        last = next(ids)
        sink.put(_call(last))
    _ticks(shipper, clock, round(STEADY_S / TICK_S))  # a look: it wrote since the last one
    _ticks(shipper, clock, round(STEADY_S / TICK_S))  # a look: nothing since, some unread: read at once
    return last


class LargeJob(Counting):
    """A coordinator of a job of 16,384 ranks: it asks for a batch every 2 s."""

    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> Any:
        reply = super().accept_registration(identity, via)
        reply.report_interval_s = 2.0
        return reply


def test_a_large_job_s_steady_rank_is_read_as_far_apart_as_its_coordinator_asks(rig: Any) -> None:
    """A batch every ``READ_S`` from each of 16,384 ranks is five times what their coordinator
    asked for (one every 2 s): a steady rank that keeps writing is read every 2 s, and its Flight
    Recorder polled every 4 s; what a detector waits for is still read at once (it goes quiet)."""
    shipper, intake, sink, clock = rig
    intake.__class__ = LargeJob
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    (state,) = shipper._ranks.values()
    assert state.pace == 2.0
    clock.now = (clock.now // 2.0 + 1) * 2.0 + 0.01  # at the start of a 2 s period
    shipper.tick()  # read there
    before = intake.reports
    ticks = round(4.0 / TICK_S)
    for _ in range(ticks):
        for _ in range(5):
            sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
    assert intake.reports - before == 2  # 4 s: two reads, not ten
    last = _five_more_then_quiet(shipper, sink, clock, ids)
    assert last in _ids(intake.events[0])
    sent = _ids(intake.events[0])
    assert sent == list(range(1, sent[-1] + 1))  # every call, none twice


@pytest.mark.parametrize(("asked", "pace"), [(3600.0, MAX_PACE_S), (float("nan"), 0.0), (-1.0, 0.0)])
def test_what_a_coordinator_asks_spaces_a_steady_rank_s_reads_within_bounds(
    rig: Any, asked: float, pace: float
) -> None:
    """An hour, NaN or less than nothing: a steady rank is read every ``MAX_PACE_S`` at most."""
    shipper, intake, sink, clock = rig

    class Asking(Counting):
        def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> Any:
            reply = super().accept_registration(identity, via)
            reply.report_interval_s = asked
            return reply

    intake.__class__ = Asking
    _steady(shipper, sink, clock, iter(range(1, 10_000)))
    assert [s.pace for s in shipper._ranks.values()] == [pace]


def test_a_large_job_s_flight_recorder_is_polled_as_far_apart_as_its_ring_is_read() -> None:
    """``RingFetcher.space``: a rank read every 2 s is polled every 4 s at most often (every poll
    follows a read of its ring); where its reads cost more than that spacing allows, less often,
    and ``status`` says so against 4 s, not 1 s."""
    clock = [1000.0]
    reads = [0]
    cost = [0.001]

    def read(path: str, pid: int, **_: Any) -> Any:
        clock[0] += cost[0]
        reads[0] += 1
        return {"cpu": {"pg_status": {}, "entries": []}}, {}

    fetcher = RingFetcher(interval_s=1.0, read=read, clock=lambda: clock[0], background=False)
    fetcher.watch(1, "/run/a.sock", 4242)
    fetcher.space(1, 4.0)
    for _ in range(40):  # 40 s of the fetcher's ticks
        fetcher.poll_once(due_only=True)
        clock[0] += 1.0
    assert 9 <= reads[0] <= 11 and fetcher.note(1) == ""  # every 4 s: the job's pace, not a cost
    cost[0] = 0.08  # 80 ms a read: 8 s apart to stay under 1 % of a core
    for _ in range(80):
        fetcher.poll_once(due_only=True)
        clock[0] += 1.0
    assert fetcher._watched[1].every > 6.0
    assert "not every 4 s: a read costs the rank about" in fetcher.note(1), fetcher.note(1)
    fetcher.stop()


@pytest.mark.parametrize(
    "what",
    ["a new signature", "a call that raised", "a call under way of a kind that never runs", "an event"],
)
def test_what_a_detector_waits_for_is_read_by_the_next_read_s_then_every_tick(rig: Any, what: str) -> None:
    """Written by a rank that goes on writing (it is not stuck: a detector has no hurry), it is
    read by the next ``READ_S``; the rank is then read every tick."""
    shipper, intake, sink, clock = rig
    ids = _steady_and_five_more(shipper, sink, clock)
    n = next(ids)
    if what == "a new signature":
        sink.put(_call(n, op="broadcast"))
    elif what == "a call that raised":
        sink.put(_call(n, error="RuntimeError: Connection closed by peer"))
    elif what == "a call under way of a kind that never runs":
        p2p = r.CallRecord(0, n, "send", "0", 1, META, (), None, peer=1, enter_time=time.time(), call_site="t.py:send")
        sink.put(p2p)
    else:
        sink.put(r.MarkerEvent(0, "checkpoint", time.time()))
    for _ in range(round(READ_S / TICK_S) + 1):
        for _ in range(5):
            sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
        if n in _ids(intake.events[0]) or (
            what == "an event" and any(isinstance(e, r.MarkerEvent) for e in intake.events[0])
        ):
            break
    else:
        raise AssertionError(f"{what} not read within READ_S")
    assert shipper._ranks and not any(s.encoder.steady for s in shipper._ranks.values())
    before = intake.reports
    for _ in range(5):
        sink.put(_call(next(ids)))
    _ticks(shipper, clock, 1)
    assert intake.reports == before + 1  # read on the tick after: not steady


def test_a_steady_rank_that_goes_quiet_is_read_at_the_next_look(rig: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady rank that stops writing (inside a call that never returns, at work outside any:
    a checkpoint) has what it wrote last read at the first look that finds nothing new since
    the one before, whenever the next ``READ_S`` (an hour long here, once the rank is steady)."""
    shipper, intake, sink, clock = rig
    ids = _steady_read_no_more(shipper, sink, clock, monkeypatch)
    last = 0
    for _ in range(5):
        last = next(ids)
        sink.put(_call(last))
    clock.now += STEADY_S
    shipper.tick()  # a look: it wrote since the last one
    assert last not in _ids(intake.events[0])
    clock.now += STEADY_S
    shipper.tick()  # a look: nothing since, some unread: read
    assert last in _ids(intake.events[0])


def test_a_steady_rank_whose_newest_record_is_a_tick_old_is_read_at_that_look(rig: Any) -> None:
    """A rank that wrote its last record a tick or more before a look (into a checkpoint, a data
    stall, a call that does not return) is read at that look, not at the next one."""
    shipper, intake, sink, clock = rig
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    clock.now = (clock.now // READ_S + 1) * READ_S + 0.01
    shipper.tick()  # read at the period's start
    period = clock.now // READ_S
    last = next(ids)
    sink.put(_call(last, t=time.time() - 2 * TICK_S))  # its last call, two ticks ago
    clock.now += STEADY_S
    shipper.tick()
    assert last in _ids(intake.events[0]) and clock.now // READ_S == period


def test_a_call_that_never_returns_is_read_a_tick_later_while_another_thread_writes(rig: Any) -> None:
    """The main thread enters a call that never returns while a side thread (metrics, an async
    checkpoint) goes on writing completed calls: the look a tick after the one that saw it
    begin finds no exit for it and reads it, though the rank did not go quiet."""
    shipper, intake, sink, clock = rig
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    for _ in range(round(2 * READ_S / TICK_S)):  # the side thread's calls, steady too
        for _ in range(5):
            sink.put(_call(next(ids), op="broadcast"))
        _ticks(shipper, clock, 1)
    clock.now = (clock.now // READ_S + 1) * READ_S + 0.01
    shipper.tick()  # read at the period's start: steady
    assert all(st.steady_period is not None for st in shipper._ranks.values())
    period = clock.now // READ_S
    stuck = next(ids)
    sink.put(_call(stuck, done=False))  # entered, never returns
    clock.now += STEADY_S
    shipper.tick()  # the look that sees it begin
    assert stuck not in _ids(intake.events[0])
    for _ in range(5):
        sink.put(_call(next(ids), op="broadcast"))
    clock.now += TICK_S
    shipper.tick()  # a tick later: no exit for it among what the side thread wrote
    assert stuck in _ids(intake.events[0]) and clock.now // READ_S == period


def test_a_steady_rank_with_a_quarter_of_its_ring_unread_is_read_at_the_look(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small ring (``HANGWATCH_QUEUE_SIZE``) filling fast is read before it turns over, however
    far off the next ``READ_S`` (an hour here): found in review, a 1,024-slot ring at 1,000 calls a
    second lost a third of its slots between reads."""
    shipper, intake, sink, clock = rig
    ids = _steady_read_no_more(shipper, sink, clock, monkeypatch)
    (state,) = shipper._ranks.values()
    capacity = state.link.reader.capacity
    last = 0
    for _ in range(capacity // 8 + 1):  # two slots a call: a quarter of the ring
        last = next(ids)
        sink.put(_call(last))
    clock.now += STEADY_S
    shipper.tick()
    assert last in _ids(intake.events[0]) and state.link.reader.lost == 0


def test_a_look_finds_where_the_published_slots_end() -> None:
    """``RingReader.peek``: the position after the newest published slot, from any position
    read or not yet, through the ring's turns; -1 once the writer lapped it; a slot being written
    ends the published ones."""
    w = RingWriter(capacity=64, blob_bytes=256, rank=0)
    reader = RingReader(w.fd)
    assert reader.peek() == 0
    for i in range(1, 41):
        w.write(Kind.ENTER, 0, 0, 1, i, i, 0, 0, float(i))
    assert reader.peek() == 40 and reader.peek(17) == 40 and reader.slot_at(39).call_id == 40
    reader.poll(30)
    assert reader.peek() == 40 and reader.peek(40) == 40
    for i in range(41, 100):
        w.write(Kind.ENTER, 0, 0, 1, i, i, 0, 0, float(i))
    assert reader.peek(40) == 99  # around the ring's end
    h = next(w.positions)  # a slot half written: its first stamp only
    w.pack_slot(w.mm, HEADER_SIZE + (h % 64) * SLOT_SIZE, h + 1, Kind.ENTER, 0, 0, 1, 0, 0, 0, 0, 0.0, 0)
    assert reader.peek(40) == 99
    for i in range(100, 200):
        w.write(Kind.ENTER, 0, 0, 1, i, i, 0, 0, float(i))
    assert reader.peek(99) == -1  # lapped: read it (the reader counts what was lost)
    reader.close()
    w.close()


def test_steady_is_said_of_runs_and_steps_only() -> None:
    w = RingWriter(capacity=1024, blob_bytes=1 << 16, rank=0)
    ref = w.blob(call_blob(_call(0)))
    reader, enc = RingReader(w.fd), RingEncoder()
    enc.send_runs = True
    i = 0

    def calls(n: int, done_last: bool = True) -> None:
        nonlocal i
        for k in range(n):
            i += 1
            w.write(Kind.ENTER, 0, 0, ref, i, i, 0, 0, float(i))
            if done_last or k < n - 1:
                w.write(Kind.EXIT, 0, 1, 0, i, 0, 0, 0, i + 0.5)

    def steady() -> bool:
        enc.decode(reader.poll(1000), 0)
        return enc.steady

    calls(1)
    assert not steady()  # its first call: a signature not shown before
    calls(4)
    assert steady()
    calls(4)
    w.write(Kind.STEP, 0, 0, 0, 0, 0, 2, 0, 9.0)
    assert steady()
    calls(3, done_last=False)  # the last call under way, and not held back (runs may hold it)
    assert not steady()
    assert not steady()  # an empty read
    w.close()


def test_a_steady_rank_inside_a_call_is_read_on_the_next_tick(rig: Any) -> None:
    """A call under way as the ring was read is held back for the next read (``RingEncoder._hold``):
    that read comes on the next tick, not a ``STEADY_S`` later (found in CI: a mismatch told
    with one of three ranks' calls 0.2 s late read 'which side is wrong is not known yet')."""
    shipper, intake, sink, clock = rig
    ids = _steady_and_five_more(shipper, sink, clock)
    last = next(ids)
    sink.put(_call(last, done=False))  # entered, under way: held back
    clock.now += STEADY_S
    _ticks(shipper, clock, 1)
    assert last not in _ids(intake.events[0])
    _ticks(shipper, clock, 1)  # the next tick sends it
    assert last in _ids(intake.events[0])


def test_the_loop_sleeps_until_a_read_is_due(rig: Any, tmp_path: Path) -> None:
    """Between ticks the loop sleeps as long as nothing is due: a tick while a rank is read
    every tick, to the next period's start while every rank is steady, ``IDLE_S`` with none."""
    shipper, _intake, sink, clock = rig
    ids = iter(range(1, 10_000))
    _ticks(shipper, clock, 1)  # registered, nothing read yet: not steady
    assert shipper.next_tick_in() == TICK_S
    _steady(shipper, sink, clock, ids)
    clock.now = 1000.05  # 0.15 s before the next STEADY_S period of the shipper's clock
    assert shipper.next_tick_in() == pytest.approx(1000.2 - 1000.05, abs=0.002)
    sink.put(_call(next(ids), done=False))  # a call under way: held back, read every tick
    clock.now += STEADY_S
    shipper.tick()
    assert shipper.next_tick_in() == TICK_S
    empty = RingServer(str(tmp_path / "empty.sock"))
    empty.start()
    try:
        assert Shipper(empty, Counting(), "node-1", PsutilInspector()).next_tick_in() == shipper_module.IDLE_S
    finally:
        empty.stop()


def test_a_new_link_and_an_ending_rank_wake_the_sleeping_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop asleep with no rank (or with steady ones only) is woken at once by a link made,
    and by a rank saying it is ending, which waits for its farewell: with both sleeps an hour
    long here, either would take an hour without the wake."""
    monkeypatch.setattr(shipper_module, "IDLE_S", 3600.0)
    monkeypatch.setattr(shipper_module, "STEADY_S", 3600.0)
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, sink, stop = Counting(), RingSink(4096, rank=0), threading.Event()
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), heartbeat_s=3600.0)
    loop = threading.Thread(target=shipper.run, args=(stop,), daemon=True)
    loop.start()
    sock = None
    try:
        wait_for(lambda: server.changed.is_set() is False, 5, 0.01, "the loop asleep")
        ids = iter(range(1, 100_000))
        for _ in range(5):
            sink.put(_call(next(ids)))
        sock = link.connect(server.path, {"job_id": "j", "rank": 0, "world_size": 2, "session": "s0"}, [sink.fd])
        assert sock is not None
        wait_for(lambda: intake.identities and intake.reports, 10, 0.02, "the new rank registered and read")

        def steady() -> bool:  # the rank goes on calling until a read finds it steady
            sink.put(_call(next(ids)))
            return shipper.next_tick_in() > 1.0

        wait_for(steady, 10, 0.02, "the rank steady, the loop asleep for a period")
        assert link.farewell(sock, timeout_s=10.0), "the ending rank waited for its farewell"
    finally:
        stop.set()
        server.stop()
        loop.join(5)
        if sock is not None:
            sock.close()
        sink.close()
    assert not loop.is_alive(), "the loop ends when stopped (the server's stop wakes it)"


def test_a_rank_ending_during_a_read_is_let_go_only_after_a_read_that_follows(tmp_path: Path) -> None:
    """A rank without Flight Recorder (no worker server) that says it is ending while the
    shipper reads its ring gets no farewell from that tick (its RankEnd may have come after the
    read), but from the next one, which its ENDING's wake makes, once the RankEnd is read."""
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, sink = Counting(), RingSink(4096, rank=0)
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), heartbeat_s=3600.0)
    sock = link.connect(server.path, {"job_id": "j", "rank": 0, "world_size": 2, "session": "s0"}, [sink.fd])
    assert sock is not None
    told: dict[str, Any] = {}
    try:
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        shipper.tick()
        read = shipper._read

        def read_then_end(state: Any) -> Any:
            batch = read(state)  # the ring read; meanwhile the rank ends (Session.end)
            if not told:
                sink.put(r.RankEnd(0, r.EndKind.CLEAN_EXIT, 1.0, "exit"))
                told["thread"] = threading.Thread(target=lambda: told.setdefault("farewell", link.farewell(sock, 10.0)))
                told["thread"].start()
                wait_for(lambda: state.link.ending_at is not None, 5, 0.001, "the rank's ENDING")
            return batch

        shipper._read = read_then_end  # type: ignore[method-assign]
        server.changed.clear()
        shipper.tick()
        state = next(iter(shipper._ranks.values()))
        assert not state.farewell, "let go though its RankEnd was written after the read"
        assert server.changed.is_set(), "its ENDING wakes the loop for another tick"
        shipper.tick()
        told["thread"].join(10)
        assert told.get("farewell") is True
        assert any(isinstance(e, r.RankEnd) for e in intake.events[0]), "its RankEnd read before its farewell"
    finally:
        sock.close()
        sink.close()
        server.stop()


def _counting_reads(shipper: Shipper) -> list[int]:
    reads = [0]
    read = shipper._read

    def counted(state: Any) -> Any:
        reads[0] += 1
        return read(state)

    shipper._read = counted  # type: ignore[method-assign]
    return reads


def test_a_steady_rank_that_writes_nothing_stays_steady(rig: Any) -> None:
    """A steady rank between bursts of calls (a step's compute, evaluation) is read once a
    period, not every tick; a call it then enters is read in the next period, and the rank is
    read every tick while that call is under way."""
    shipper, _intake, sink, clock = rig
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    reads = _counting_reads(shipper)
    ticks = round(3 * STEADY_S / TICK_S)
    _ticks(shipper, clock, ticks)
    assert reads[0] <= 4, f"{reads[0]} reads in {ticks} ticks of a rank that wrote nothing"
    sink.put(_call(next(ids), done=False))
    _ticks(shipper, clock, round(STEADY_S / TICK_S) + 1)
    assert shipper.next_tick_in() == TICK_S
    reads[0] = 0
    _ticks(shipper, clock, 3)
    assert reads[0] == 3


def test_a_rank_let_go_that_lives_on_is_read_once_a_period(rig: Any) -> None:
    """A rank given its farewell whose process lives on (``destroy_process_group`` and then
    more Python) is no longer read every tick."""
    shipper, _intake, sink, clock = rig
    (link_,) = shipper.server.links()
    _ticks(shipper, clock, 1)
    sink.put(r.RankEnd(0, r.EndKind.CLEAN_EXIT, 1.0, "exit"))
    link_.ending_at = clock.now  # as the server marks it when the rank says so
    _ticks(shipper, clock, 1)
    assert shipper._ranks[id(link_)].farewell
    reads = _counting_reads(shipper)
    ticks = round(3 * STEADY_S / TICK_S)
    _ticks(shipper, clock, ticks)
    assert reads[0] <= 5, f"{reads[0]} reads in {ticks} ticks of a rank let go"


def test_closes_that_come_together_are_stamped_before_any_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job stopped as a whole closes its links within moments: woken by the first close, the
    loop waits a tick before reporting it, so the selector thread stamps the others undisturbed
    (a rank reported gone at once took the GIL from it, spread the stamps, and a stop of the whole
    job was told as one rank's death on a loaded machine). The tick is made a second long here."""
    monkeypatch.setattr(shipper_module, "TICK_S", 1.0)

    class Timed(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.reported_at: list[float] = []

        def apply_process_statuses(self, host: str, statuses: list[r.ProcessStatus]) -> None:
            self.reported_at.append(time.monotonic())
            super().apply_process_statuses(host, statuses)

    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, stop = Timed(), threading.Event()
    sinks = [RingSink(4096, rank=rank) for rank in (0, 1)]
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), heartbeat_s=3600.0)
    socks = [
        link.connect(server.path, {"job_id": "j", "rank": rank, "world_size": 2, "session": f"s{rank}"}, [sink.fd])
        for rank, sink in enumerate(sinks)
    ]
    loop = threading.Thread(target=shipper.run, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_for(lambda: len(intake.identities) == 2, 10, 0.01, "both ranks registered")
        assert socks[0] is not None and socks[1] is not None
        socks[0].close()
        time.sleep(0.1)
        socks[1].close()
        second_closed = time.monotonic()
        wait_for(lambda: len(intake.statuses) == 2, 10, 0.01, "both ranks reported gone")
        assert intake.reported_at[0] >= second_closed, "a rank reported gone before the next close was stamped"
    finally:
        stop.set()
        server.stop()
        loop.join(5)
        for sink in sinks:
            sink.close()


class VeryLargeJob(Counting):
    """A coordinator of a job of 16,384 ranks: a batch every 2 s, a steady ring read every 4 s."""

    unread = 0

    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> Any:
        reply = super().accept_registration(identity, via)
        reply.report_interval_s, reply.steady_read_s = 2.0, 4.0
        return reply

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        if request.unread:
            self.unread += 1
            assert not request.events and not request.calls.signature and not request.flight_read_time
        return super().accept_report(request, relay)


def test_a_larger_job_s_steady_rank_is_read_further_apart_and_said_alive_between(rig: Any) -> None:
    """``RegisterReply.steady_read_s``: a steady rank that keeps writing is read every 4 s and,
    between, said alive every 2 s by a batch sent unread; one that goes quiet is read at once."""
    shipper, intake, sink, clock = rig
    intake.__class__ = VeryLargeJob
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    (state,) = shipper._ranks.values()
    assert (state.pace, state.steady_read) == (2.0, 4.0)
    clock.now = (clock.now // 4.0 + 1) * 4.0 + 0.01  # at the start of a 4 s period
    shipper.tick()  # read there
    before, unread = intake.reports, intake.unread
    for _ in range(round(8.0 / TICK_S)):
        sink.set_status("t.py:1 in step\nt.py:1 in step", clock.now)  # its sender thread: alive
        for _ in range(5):
            sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
    assert intake.unread - unread == 2  # 8 s: said alive at 2 s and 6 s
    assert intake.reports - before - (intake.unread - unread) == 2  # and read at 4 s and 8 s, not every 2 s
    last = _five_more_then_quiet(shipper, sink, clock, ids)
    sent = _ids(intake.events[0])
    assert last in sent and sent == list(range(1, sent[-1] + 1))  # every call, none twice


def test_a_larger_job_s_steady_rank_that_freezes_is_said_alive_no_more(rig: Any) -> None:
    """A rank whose sender thread stops writing its status (the GIL held, SIGSTOP) gets no
    batch sent unread: its silence is how the coordinator tells it frozen."""
    shipper, intake, sink, clock = rig
    intake.__class__ = VeryLargeJob
    ids = iter(range(1, 10_000))
    sink.set_status("t.py:1 in step\nt.py:1 in step", clock.now)
    _steady(shipper, sink, clock, ids)
    clock.now = (clock.now // 4.0 + 1) * 4.0 + 0.01
    shipper.tick()
    before = intake.reports
    _ticks(shipper, clock, round(8.0 / TICK_S))  # it writes nothing more, its status included
    assert intake.reports == before and intake.unread == 0


def test_a_steady_rank_s_call_of_a_new_kind_is_read_at_the_next_look(rig: Any) -> None:
    """Its signature's blob says so before its slot does: read then, not at the next read (a
    mismatch's calls are of a new kind: at 16,384 ranks they waited up to 2 s, now 4)."""
    shipper, intake, sink, clock = rig
    intake.__class__ = VeryLargeJob
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    clock.now = (clock.now // 4.0 + 1) * 4.0 + 0.01
    shipper.tick()  # read there
    for _ in range(round(STEADY_S / TICK_S)):
        for _ in range(5):
            sink.put(_call(next(ids)))  # it keeps writing: not read
        _ticks(shipper, clock, 1)
    before = intake.reports
    odd = next(ids)
    sink.put(_call(odd, op="broadcast"))
    for _ in range(round(STEADY_S / TICK_S)):
        sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
    assert intake.reports == before + 1 and odd in _ids(intake.events[0])


def test_a_larger_job_s_steady_rank_that_stops_writing_gets_heartbeats_read_not_unread(rig: Any) -> None:
    """A rank alive and busy outside any call (it left its loop) has nothing unread: its ring
    is read for its heartbeat, which says it did nothing since (said alive only, a rank that
    left its loop was never blamed: the story table's ``left_the_loop_busy_after_it`` hung)."""
    shipper, intake, sink, clock = rig
    intake.__class__ = VeryLargeJob
    shipper.heartbeat_s = 1.0
    ids = iter(range(1, 10_000))
    _steady(shipper, sink, clock, ids)
    clock.now = (clock.now // 4.0 + 1) * 4.0 + 0.01
    shipper.tick()  # read there: nothing unread after it
    before, unread = intake.reports, intake.unread
    for _ in range(round(4.0 / TICK_S)):
        sink.set_status("t.py:9 in export_model\nt.py:9 in export_model", clock.now)  # alive, busy
        _ticks(shipper, clock, 1)
    assert intake.unread == unread and intake.reports - before >= 3  # a heartbeat a second, each a read


def test_a_larger_job_s_steady_rank_whose_sender_thread_starves_is_said_alive_by_its_writes(rig: Any) -> None:
    """Its main thread keeps the GIL and writes calls; its sender thread gets no turn to write
    its status: the calls it writes say it is alive (read 4 s apart, a rank silent that long is
    too close to the 5 s after which it counts as frozen)."""
    shipper, intake, sink, clock = rig
    intake.__class__ = VeryLargeJob
    ids = iter(range(1, 10_000))
    sink.set_status("t.py:1 in step\nt.py:1 in step", clock.now)  # written once
    _steady(shipper, sink, clock, ids)
    clock.now = (clock.now // 4.0 + 1) * 4.0 + 0.01
    shipper.tick()
    unread = intake.unread
    for _ in range(round(8.0 / TICK_S)):
        for _ in range(5):
            sink.put(_call(next(ids)))
        _ticks(shipper, clock, 1)
    assert intake.unread - unread == 2
