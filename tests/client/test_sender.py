"""The sender thread (``Sender``): batching, heartbeats, back-off, re-registration and flushes.

Seams faked, all through ``Sender(session, addr, token, transport=, poller=, clock=)``: the wire
(:class:`FakeTransport`, which records what it is asked to send and answers with real protobuf
replies, or fails, or blocks on a gate), the Flight Recorder poller (:class:`FakePoller`) and the
loop's clock (:class:`ManualClock`, which moves only when a test moves it, so heartbeat and
back-off deadlines are checked exactly and without sleeping). The Session, queue, recorder and
the thread itself are real; the capture wrapper is real where the novel-signature flush is tested.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hangwatch import records as r
from hangwatch.agent.rings import RingServer
from hangwatch.client import capture
from hangwatch.client import sender as sender_mod
from hangwatch.client import session as session_mod
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.sender import ASYNC_QUIET_S, MAX_BACKOFF_S, MAX_BATCH, SEND_INTERVAL_S, Sender
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch, Kind, RingReader
from hangwatch.testing import wait_for
from tests.client import fakes
from tests.client.fakes import FakeC10d, FakeWork, SlotDecoder, make_session

START = 1_000_000_000.0  # a clock in seconds since the epoch, as time.time() is


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


@dataclass
class Report:
    batch_seq: int
    events: list[r.RankEvent]
    queued: int
    dropped: int
    where: str
    where_user: str
    urgent: bool
    at: float  # the sender's clock when it was sent


class ManualClock:
    def __init__(self, now: float = START) -> None:
        self.now = now
        self.reads = 0  # only the sender thread reads it

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class FakeTransport:
    """Records calls; ``register_plan``/``report_plan`` say what the next calls do (a reply, or an
    exception to raise); an empty plan answers normally. ``gate``, when cleared, blocks reports."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.log: list[tuple[str, Any]] = []
        self.register_plan: deque[pb.RegisterReply | BaseException] = deque()
        self.report_plan: deque[pb.ReportReply | BaseException] = deque()
        self.gate = threading.Event()
        self.gate.set()
        self.closed = 0
        self.made_with: tuple[str, str | None] | None = None
        self.slots = SlotDecoder()
        self._seen_first_group = False

    def _first_group(self, e: r.RankEvent) -> bool:
        if isinstance(e, r.GroupEvent) and not self._seen_first_group:
            self._seen_first_group = True
            return True
        return False

    def register(self, identity: r.RankIdentity) -> pb.RegisterReply:
        with self.lock:
            self.log.append(("register", (identity, self.clock())))
            plan = self.register_plan.popleft() if self.register_plan else pb.RegisterReply(coordinator_id="c1")
        if isinstance(plan, BaseException):
            raise plan
        return plan

    def report(
        self,
        identity: r.RankIdentity,
        batch_seq: int,
        events: Sequence[r.RankEvent],
        queued: int,
        dropped: int,
        where: str = "",
        where_user: str = "",
        urgent: bool = False,
        ring: Batch | None = None,
        stack: Sequence[str] = (),
    ) -> pb.ReportReply:
        self.gate.wait(5)
        with self.lock:
            # what the batch carries, as typed events; the default group's announcement (made by
            # the first call) is left out, as these tests are not about it
            sent = list(events) + [
                e for e in (self.slots.decode(ring) if ring is not None else []) if not self._first_group(e)
            ]
            self.log.append(
                ("report", Report(batch_seq, sent, queued, dropped, where, where_user, urgent, self.clock()))
            )
            plan = self.report_plan.popleft() if self.report_plan else pb.ReportReply()
        if isinstance(plan, BaseException):
            raise plan
        return plan

    def close(self) -> None:
        with self.lock:
            self.closed += 1

    def reports(self) -> list[Report]:
        with self.lock:
            return [item for kind, item in self.log if kind == "report"]

    def registers(self) -> list[float]:
        with self.lock:
            return [item[1] for kind, item in self.log if kind == "register"]

    def kinds(self) -> list[str]:
        with self.lock:
            return [kind for kind, _ in self.log]


#: How long these tests wait for the sender thread: generous, since two test workers share two
#: cores (1 s once timed out in CI); a wait ends as soon as its condition holds.
WAIT_S = 10.0


class FakePoller:
    def __init__(self, due: bool = False, error: Exception | None = None) -> None:
        self.is_due = due
        self.error = error
        self.polls = 0

    def due(self, now: float) -> bool:
        return self.is_due

    def poll(self) -> None:
        self.polls += 1
        if self.error is not None:
            raise self.error

    def skip_existing(self) -> None:
        self.skipped_existing = True


@dataclass
class Rig:
    session: session_mod.Session
    sender: Sender
    transport: FakeTransport
    poller: FakePoller
    clock: ManualClock

    def start(self) -> Rig:
        self.sender.start()
        return self

    def settle(self) -> None:
        """Wait until the loop reads the clock twice more: whatever the last RPC led to (a back-off
        deadline, ``retry_at = clock() + backoff``) is decided, so moving the clock is safe."""
        n = self.clock.reads
        wait_for(lambda: self.clock.reads >= n + 2, WAIT_S, 0.001, "the sender loop to come round")

    def put_steps(self, n: int) -> list[r.StepEvent]:
        events = [r.StepEvent(0, i, float(i)) for i in range(n)]
        for e in events:
            self.session.sink.put(e)
        return events


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(
        interval_s: float = 0.002, heartbeat_s: float = 1e6, poller: FakePoller | None = None, ring: int | None = None
    ) -> Rig:
        session = make_session(announce=False, ring=ring)  # the group is announced by the first call
        clock = ManualClock()
        transport = FakeTransport(clock)
        fake_poller = poller or FakePoller()

        def make_transport(addr: str, token: str | None) -> FakeTransport:
            transport.made_with = (addr, token)
            return transport

        sender = Sender(
            session, "coord:1", "tok", transport=make_transport, poller=lambda rec: fake_poller, clock=clock
        )
        session.sender = sender
        sender.interval_s = interval_s
        sender.heartbeat_s = heartbeat_s
        made.append(Rig(session, sender, transport, fake_poller, clock))
        return made[-1]

    yield make
    for rig_ in made:
        rig_.transport.gate.set()
        rig_.sender.stop(1.0)
    capture.set_session(None)


def test_registers_then_ships_queued_events_in_order(rig: Callable[..., Rig]) -> None:
    t = rig()
    steps = t.put_steps(3)
    raw, pg, before = t.session.recorder.enter(OPS_BY_NAME["barrier"], {})
    t.session.recorder.exit(raw, pg, before, None)
    t.start()
    (report,) = wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    assert t.transport.made_with == ("coord:1", "tok")
    assert t.transport.kinds()[:2] == ["register", "report"]
    assert t.sender.registered and t.sender.coordinator_id == "c1"
    assert report.batch_seq == 1 and not report.urgent
    assert report.events[:3] == steps
    call, done = report.events[3:]
    assert isinstance(call, r.CallRecord) and (call.op, call.seq, call.call_id) == ("barrier", 1, raw[0])
    assert isinstance(done, r.CallExit) and done.call_id == raw[0]
    assert (report.queued, report.dropped) == (0, 0)
    assert t.sender.batches_sent == 1 and t.sender.send_failures == 0


def test_each_batch_says_where_the_main_thread_is(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.transport.register_plan.append(Unavailable())  # so that the first report waits for the clock
    t.start()
    wait_for(t.transport.registers, WAIT_S, 0.002, "the first attempt")
    t.settle()

    def spin_until_reported() -> None:  # pure Python frames only, so the sample lands in this file
        t.clock.now += 1
        while not t.transport.reports():
            pass

    spin_until_reported()
    (report,) = t.transport.reports()
    frame = r"test_sender\.py:\d+ in (spin_until_reported|reports|<listcomp>)"
    assert re.fullmatch(frame, report.where), report.where
    assert re.fullmatch(frame, report.where_user), report.where_user


@pytest.mark.parametrize(("asked", "used"), [(0.0, SEND_INTERVAL_S), (0.001, 0.05), (0.5, 0.5), (60.0, 5.0)])
def test_the_coordinator_sets_the_report_interval_within_bounds(
    rig: Callable[..., Rig], asked: float, used: float
) -> None:
    t = rig()
    t.sender.interval_s = SEND_INTERVAL_S
    t.transport.register_plan.append(pb.RegisterReply(coordinator_id="c1", report_interval_s=asked))
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    assert t.sender.interval_s == used


def test_events_queued_during_a_send_go_out_together_in_the_next_batch(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.transport.gate.clear()  # the first report (a heartbeat) blocks on the wire
    t.start()
    wait_for(lambda: t.sender.registered, WAIT_S, 0.002, "registration")
    steps = t.put_steps(5)
    t.transport.gate.set()
    reports = wait_for(lambda: t.transport.reports()[1:], WAIT_S, 0.002, "the second report")
    assert t.transport.reports()[0].events == []
    assert reports[0].events == steps and reports[0].batch_seq == 2


def test_a_backlog_is_sent_back_to_back_in_batches_of_max_batch(rig: Callable[..., Rig]) -> None:
    t = rig(interval_s=30.0)  # only the backlog rule can send twice in a row
    t.put_steps(2 * MAX_BATCH + 500)
    t.start()
    reports = wait_for(lambda: t.transport.reports()[1:] and t.transport.reports(), WAIT_S, 0.002, "two reports")
    assert [(len(x.events), x.queued) for x in reports] == [(MAX_BATCH, MAX_BATCH + 500), (MAX_BATCH, 500)]
    time.sleep(0.05)
    assert len(t.transport.reports()) == 2  # the last 500 wait for the next interval (or a flush)
    assert t.sender.flush(1.0)
    assert [(len(x.events), x.urgent) for x in t.transport.reports()[2:]] == [(500, True)]


def test_an_idle_rank_heartbeats_every_heartbeat_s_with_its_ring_counts(rig: Callable[..., Rig]) -> None:
    t = rig(heartbeat_s=10.0, ring=2)
    steps = t.put_steps(5)  # a ring of 2 slots keeps the newest 2; 3 overwritten before anyone read them
    t.start()
    (first,) = wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    assert first.events == steps[3:] and (first.queued, first.dropped) == (0, 3)
    t.clock.now = START + 9.99
    time.sleep(0.03)  # ~15 turns of the loop
    assert len(t.transport.reports()) == 1
    t.clock.now = START + 10.0
    _, beat = wait_for(lambda: t.transport.reports()[1:] and t.transport.reports(), WAIT_S, 0.002, "a heartbeat")
    assert (beat.events, beat.queued, beat.dropped, beat.batch_seq, beat.urgent) == ([], 0, 3, 2, False)
    assert beat.at == START + 10.0


def test_backoff_doubles_while_the_coordinator_is_unreachable_then_resets(
    rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    t = rig()
    t.transport.register_plan.extend([Unavailable() for _ in range(6)])
    caplog.set_level(logging.WARNING, logger="hangwatch.client")
    t.start()
    expected = [0.25, 0.5, 1.0, 2.0, MAX_BACKOFF_S, MAX_BACKOFF_S]
    for attempt, backoff in enumerate(expected, start=1):
        wait_for(lambda n=attempt: len(t.transport.registers()) >= n, WAIT_S, 0.002, f"attempt {attempt}")  # type: ignore[misc]
        failed_at = t.transport.registers()[-1]
        t.settle()
        t.clock.now = failed_at + backoff - 0.001
        time.sleep(0.01)
        assert len(t.transport.registers()) == attempt, f"retried before {backoff} s"
        t.clock.now = failed_at + backoff
    wait_for(t.transport.reports, WAIT_S, 0.002, "a report once the coordinator answers")
    gaps = [b - a for a, b in zip(t.transport.registers(), t.transport.registers()[1:], strict=False)]
    assert gaps == expected
    assert t.sender.send_failures == 6 and t.transport.closed == 6
    warnings = [rec.getMessage() for rec in caplog.records if "unreachable" in rec.getMessage()]
    assert warnings == ["hangwatch: coordinator coord:1 unreachable (Unavailable); will retry"]  # once
    # after a success the back-off starts again from 0.25 s
    t.transport.report_plan.append(Unavailable())
    t.put_steps(1)
    t.clock.now += 100  # past the heartbeat of nothing, so only the new event is sent
    wait_for(lambda: t.sender.send_failures == 7, WAIT_S, 0.002, "the failed report")
    t.settle()
    failed_at = t.clock.now
    t.clock.now = failed_at + 0.249
    time.sleep(0.01)
    assert len(t.transport.registers()) == 7
    t.clock.now = failed_at + 0.25
    wait_for(lambda: len(t.transport.registers()) == 8, WAIT_S, 0.002, "the re-registration")


def test_reregister_when_the_coordinator_asks_and_resend_the_same_batch(rig: Callable[..., Rig]) -> None:
    t = rig()
    t.transport.report_plan.extend([pb.ReportReply(), pb.ReportReply(reregister=True)])
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    steps = t.put_steps(2)
    # (a busy machine may let the sender read the ring between the two puts: a later batch then
    # carries the second step)
    wait_for(lambda: len(t.transport.reports()) >= 3, WAIT_S, 0.002, "the batch resent")
    assert t.transport.kinds()[:5] == ["register", "report", "report", "register", "report"]
    first, again = t.transport.reports()[1:3]
    assert first.events == again.events == steps[: len(first.events)] and first.events
    assert (first.batch_seq, again.batch_seq) == (2, 3)

    def delivered() -> list[r.RankEvent]:
        return [e for rep in t.transport.reports()[2:] for e in rep.events]

    wait_for(lambda: delivered() == steps, WAIT_S, 0.002, "every step delivered once")
    assert t.sender.send_failures == 0  # asked, not failed: no back-off either
    assert len(t.transport.registers()) == 2 and t.transport.registers()[1] == START


def test_a_restarted_coordinator_is_told_the_groups_again(rig: Callable[..., Rig]) -> None:
    t = rig()
    c10d = t.session.recorder.c10d
    t.session.recorder.group_info(c10d.default)
    t.session.recorder.group_info(c10d.new_group("1", [0, 1], desc="pair"))
    t.transport.register_plan.extend(
        [
            pb.RegisterReply(coordinator_id="c1"),
            pb.RegisterReply(coordinator_id="c1"),
            pb.RegisterReply(coordinator_id="c2"),
        ]
    )
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    for expected_groups in ([], ["0", "1"]):
        t.transport.report_plan.append(Unavailable())
        n = len(t.transport.reports())  # before the clock moves: the sender may send at once
        step = t.put_steps(1)
        t.clock.now += 100
        wait_for(lambda n=n: len(t.transport.reports()) == n + 1, WAIT_S, 0.002, "the failing report")  # type: ignore[misc]
        t.settle()
        t.clock.now += 100  # past the back-off
        resent = wait_for(lambda n=n: t.transport.reports()[n + 1 :], WAIT_S, 0.002, "the re-sent report")[0]  # type: ignore[misc]
        groups = [e for e in resent.events if isinstance(e, r.GroupEvent)]
        assert [g.group.name for g in groups] == expected_groups
        assert all(g.kind == r.GroupEventKind.CREATED for g in groups)
        assert resent.events[len(groups) :] == step
    assert t.sender.coordinator_id == "c2"


def test_flush_sends_at_once_marked_urgent_and_reads_flight_recorder_first(rig: Callable[..., Rig]) -> None:
    t = rig(interval_s=30.0, poller=FakePoller(due=False))
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    assert t.poller.polls == 0
    steps = t.put_steps(1)
    began = time.monotonic()
    assert t.sender.flush(1.0)
    assert time.monotonic() - began < 0.5  # not the 30 s interval
    last = t.transport.reports()[-1]
    assert last.urgent and last.events == steps
    assert t.poller.polls == 1  # C++-issued collectives since the last read go out with it


def test_a_due_poller_is_read_on_the_thread(rig: Callable[..., Rig]) -> None:
    t = rig(poller=FakePoller(due=True))
    t.start()
    wait_for(lambda: t.poller.polls >= 3, WAIT_S, 0.002, "polls")


def test_flush_waits_at_most_its_timeout(rig: Callable[..., Rig]) -> None:
    t = rig(interval_s=30.0)
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    t.transport.gate.clear()  # the coordinator stops answering
    began = time.monotonic()
    assert t.sender.flush(0.05) is False
    assert 0.05 <= time.monotonic() - began < 0.5


def test_flush_without_a_running_thread_returns_at_once(rig: Callable[..., Rig]) -> None:
    t = rig()
    assert t.sender.flush(5.0) is False  # never started
    t.start()
    t.sender.stop(1.0)
    assert t.sender._thread is not None and not t.sender._thread.is_alive()
    assert t.sender.flush(5.0) is False
    assert t.transport.closed >= 1  # stop closes the channel


def _wrapped_all_reduce(seen: list[int]) -> Callable[..., Any]:
    def original(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        seen.append(len(seen))

    return capture._wrap_op(OPS_BY_NAME["all_reduce"], original)


def test_a_call_of_a_new_kind_reaches_the_coordinator_before_the_backend_sees_it(rig: Callable[..., Rig]) -> None:
    t = rig(interval_s=30.0)
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    shipped_before_issue: list[bool] = []

    def original(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        sent = [e for rep in t.transport.reports() for e in rep.events if isinstance(e, r.CallRecord)]
        shipped_before_issue.append(any(c.inputs[0].shape == tuple(tensor.shape) for c in sent))

    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], original)
    capture.set_session(t.session)
    for _ in range(2):  # the second time, the same signature (call site included): not flushed
        wrapped(torch.ones(3))
    assert shipped_before_issue == [True, True]
    assert [x.urgent for x in t.transport.reports()] == [False, True]
    wrapped(torch.ones(4))  # a new shape: flushed again
    assert shipped_before_issue[-1] and len(t.transport.reports()) == 3


def test_a_flush_that_times_out_turns_novel_flushing_off(
    rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture, "NOVEL_FLUSH_TIMEOUT_S", 0.05)
    t = rig(interval_s=30.0)
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    t.transport.gate.clear()  # a coordinator that stopped answering (SIGSTOPped)
    seen: list[int] = []
    wrapped = _wrapped_all_reduce(seen)
    capture.set_session(t.session)
    began = time.monotonic()
    wrapped(torch.ones(3))
    first = time.monotonic() - began
    assert 0.05 <= first < 0.5 and seen == [0]  # waited once, then issued anyway
    assert t.session.recorder.flush_novel is False
    began = time.monotonic()
    wrapped(torch.ones(4))  # new, but no longer flushed
    assert time.monotonic() - began < 0.04 and seen == [0, 1]
    assert capture.active_session() is t.session  # a timeout is not an internal error


def test_async_works_completed_are_reported_by_the_thread(rig: Callable[..., Rig]) -> None:
    t = rig()
    work = FakeWork(done=False)
    rec = t.session.recorder
    raw, pg, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": torch.ones(1), "async_op": True})
    rec.exit(raw, pg, before, None, work)
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    time.sleep(0.01)
    exits = [e for rep in t.transport.reports() for e in rep.events if isinstance(e, r.CallExit)]
    assert exits == []
    work.done = True
    t.clock.now += 1e7  # a heartbeat is due, so whatever is queued goes out
    wait_for(
        lambda: [e for rep in t.transport.reports() for e in rep.events if isinstance(e, r.CallExit)],
        1.0,
        0.002,
        "the async call's exit",
    )


def test_a_failing_poller_disables_capture_but_the_thread_keeps_sending(rig: Callable[..., Rig]) -> None:
    t = rig(poller=FakePoller(due=True, error=ValueError("bad entry")))
    capture.set_session(t.session)
    t.start()
    wait_for(lambda: capture.active_session() is None, WAIT_S, 0.002, "capture disabled")
    n = len(t.transport.reports())
    t.clock.now += 1e7
    wait_for(lambda: len(t.transport.reports()) > n, WAIT_S, 0.002, "a heartbeat after the failure")


def test_an_internal_error_ends_only_the_thread(rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    session = make_session()

    def broken(addr: str, token: str | None) -> Any:
        raise RuntimeError("no transport")

    sender = Sender(session, "coord:1", None, transport=broken)
    caplog.set_level(logging.WARNING, logger="hangwatch.client")
    sender.start()
    assert sender._thread is not None
    sender._thread.join(1.0)
    assert not sender._thread.is_alive()
    assert "sender stopped after an internal error: no transport" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_drops_the_inherited_session(rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    t = rig()
    monkeypatch.setattr(session_mod, "_session", t.session)
    capture.set_session(t.session)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never return into pytest
        ok = session_mod.current() is None and capture.active_session() is None
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert session_mod.current() is t.session and capture.active_session() is t.session  # the parent keeps it


def test_records_written_after_an_idle_read_are_shipped_at_the_next_interval(rig: Callable[..., Rig]) -> None:
    """The sender read an empty ring and had nothing due: it must read again next interval, not
    hold the empty read until a heartbeat (found by an independent pass: a step put after an idle
    moment waited for the next heartbeat, here never)."""
    t = rig()  # heartbeats never due
    t.put_steps(1)
    t.start()
    wait_for(t.transport.reports, WAIT_S, 0.002, "the first report")
    time.sleep(0.2)  # the loop reads the empty ring many times
    steps = t.put_steps(1)
    wait_for(lambda: len(t.transport.reports()) == 2, WAIT_S, 0.002, "the step written after an idle read")
    assert t.transport.reports()[1].events == steps


def test_a_linked_sender_sleeps_to_its_heartbeat_and_an_async_work_wakes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linked to a node agent (which reads the ring), with no async work to poll for, the
    thread sleeps until its next heartbeat (``MAX_SLEEP_S`` at most), not every ``interval_s``; an
    async work recorded meanwhile wakes it at once, and its completion is polled for from then
    on."""
    monkeypatch.setenv("HANGWATCH_FLIGHT_RECORDER", "0")  # no worker server: nothing else to read
    monkeypatch.setattr(sender_mod, "MAX_SLEEP_S", 3600.0)  # asleep, it would not look again for an hour
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    session = session_mod.Session(fakes.identity(0), "127.0.0.1:1", None, FakeC10d(0), str(tmp_path / "agent.sock"))
    sender = session.sender
    try:
        assert session.link is not None
        session.recorder.default_pg = session.recorder.c10d._get_default_group()
        sender.interval_s, sender.heartbeat_s = 0.02, 3600.0
        sender.start()
        time.sleep(ASYNC_QUIET_S + 0.2)  # no async work for ASYNC_QUIET_S: the thread sleeps long
        woke = sender.wakes
        time.sleep(0.5)
        assert sender.wakes - woke <= 1, (
            f"woke {sender.wakes - woke} times in 0.5 s with nothing to poll (25 at 0.02 s)"
        )
        work = FakeWork(done=False)
        rec = session.recorder
        raw, pg, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": torch.ones(1), "async_op": True})
        rec.exit(raw, pg, before, None, work)
        work.done = True
        reader = RingReader(session.sink.fd)
        exits: list[Any] = []

        def exited() -> bool:
            exits.extend(s for s in reader.poll().slots if s.kind == Kind.EXIT)
            return bool(exits)

        wait_for(exited, WAIT_S, 0.005, "the async work's completion, polled for at once (not in an hour)")
    finally:
        sender.stop(1.0)
        if session.link is not None:
            session.link.close()
        server.stop()
        session.sink.close()
        capture.set_session(None)
