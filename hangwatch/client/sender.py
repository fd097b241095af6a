"""The rank's daemon thread: what only the rank can see, and shipping where no agent reads.

The calling threads write their records into the rank's ring (``ringsink``). Two modes:

- **linked** (a node agent holds the ring): the agent reads and ships the records; this thread
  only polls async works for completion and Flight Recorder for C++-issued collectives, and
  publishes where the main thread is (the ring's status) every ``heartbeat_s``. No gRPC in the
  rank, no per-record work here.
- **direct** (no agent on this node): the thread reads its own ring every ``interval_s`` and
  sends one unary ``Report`` per batch (every batch is also a heartbeat, sent at least every
  ``heartbeat_s`` even when idle), registers and re-registers when the coordinator asks (it
  restarted), and backs off while the coordinator is unreachable; what it cannot send in time
  is overwritten in the ring and counted (``dropped``).

Nothing here ever raises into the training job.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from hangwatch import config
from hangwatch import records as r
from hangwatch.ring import Batch

if TYPE_CHECKING:
    from hangwatch.client.recorder import Recorder
    from hangwatch.client.session import Session
    from hangwatch.protos import hangwatch_pb2 as pb
    from hangwatch.ring import RingReader

log = logging.getLogger("hangwatch.client")

MAX_BATCH = 2000
#: How often queued events are shipped. Each unary call costs a few hundred microseconds of this
#: thread's CPU, so batching matters more than latency here: the coordinator's detection tick is
#: 0.25 s, and a call of a new kind is flushed at once anyway.
SEND_INTERVAL_S = 0.2
#: A linked sender polls every ``SEND_INTERVAL_S`` while async works were recorded this recently,
#: else sleeps to its next heartbeat, ``MAX_SLEEP_S`` at most (``Sender._loop_linked``): an
#: async call a little over an interval apart would otherwise wake it twice per call.
ASYNC_QUIET_S = 1.0
MAX_SLEEP_S = 1.0
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 5.0  # bounds on the interval a coordinator may ask for
MAX_BACKOFF_S = 2.0  # a restarted coordinator is found again within a few seconds
#: A linked rank whose agent went away ships its own records after this long without one (well
#: inside the coordinator's default 5 s of silence before a rank is called frozen).
FALLBACK_AFTER_S = 2.0
#: A rank shipping its own records because its agent went away tries to link again this often.
RELINK_EVERY_S = 5.0


#: The share of a core a rank's own shipping (reading its ring, encoding, sending; Flight
#: Recorder read in the rank) may take, judged over ``BUDGET_WINDOW_S``: above it, batches go
#: less often (larger batches, longer runs, fewer calls: the cost per record falls), down to
#: one every ``MAX_INTERVAL_S``, and ``status`` says so; well below it, back to the usual pace.
SHIP_BUDGET = 0.02
BUDGET_WINDOW_S = 5.0


class ShipBudget:
    """The sender's CPU budget where it ships its own records (no node agent): ``observe`` the
    thread's CPU clock and the monotonic clock after each round; returns the interval to ship at.
    ``note`` says what the budget slowed down (empty: nothing)."""

    def __init__(self, base_s: float, budget: float = SHIP_BUDGET, window_s: float = BUDGET_WINDOW_S) -> None:
        self.base_s = base_s  # the usual interval (the coordinator's word)
        self.interval_s = base_s
        self.budget = budget
        self.window_s = window_s
        self.share = 0.0  # of a core, over the last window
        self.note = ""
        self._start: tuple[float, float] | None = None

    def observe(self, cpu: float, now: float) -> float:
        if self._start is None:
            self._start = (cpu, now)
            return self.interval_s
        cpu0, t0 = self._start
        if now - t0 < self.window_s:
            return self.interval_s
        self._start = (cpu, now)
        self.share = max(0.0, cpu - cpu0) / (now - t0)
        if self.share > self.budget:
            self.interval_s = min(self.interval_s * 2, max(MAX_INTERVAL_S, self.base_s))
        elif self.share < self.budget / 4 and self.interval_s > self.base_s:
            self.interval_s = max(self.base_s, self.interval_s / 2)
        self.note = (
            ""
            if self.interval_s <= self.base_s
            else (
                f"records shipped every {self.interval_s:g} s, not every {self.base_s:g} s: shipping took "
                f"{self.share:.1%} of a core (kept under {self.budget:.0%})"
            )
        )
        return self.interval_s


def _closed(sock: socket.socket) -> bool:
    """Whether the agent's end of the link has closed (it never sends anything: readable = EOF)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


#: The program's own frames a status carries (the coordinator keeps as many).
STACK_FRAMES = 6


class ReportTransport(Protocol):
    """What the thread needs of the wire (``transport.Transport``; tests pass fakes)."""

    budget_note: str  # said in every batch (``ShipBudget.note``)

    def register(self, identity: r.RankIdentity) -> pb.RegisterReply: ...

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
    ) -> pb.ReportReply: ...

    def close(self) -> None: ...


class Poller(Protocol):
    """What the thread needs of the Flight Recorder reader (``flight_recorder.FlightRecorderPoller``)."""

    interval_s: float  # stretched with the shipping interval (``ShipBudget``)

    def due(self, now: float) -> bool: ...

    def poll(self) -> None: ...

    def skip_existing(self) -> None: ...


#: Builds the thread's transport from (addr, token); called on the thread, once.
TransportFactory = Callable[[str, "str | None"], ReportTransport]
#: Builds the thread's Flight Recorder poller for a recorder (None: no polling); called on the thread.
PollerFactory = Callable[["Recorder"], "Poller | None"]


def _default_transport(addr: str, token: str | None) -> ReportTransport:
    from hangwatch.client.transport import Transport  # grpc is imported on the thread, never before

    return Transport(addr, token)


def _default_poller(recorder: Recorder) -> Poller | None:
    from hangwatch.client.flight_recorder import FlightRecorderPoller

    return FlightRecorderPoller(recorder) if config.env_flag(config.ENV_FLIGHT_RECORDER, True) else None


class Sender:
    """The sender thread of one Session.

    ``transport``, ``poller`` and ``clock`` are seams for tests (all defaults are what a rank
    uses): both factories run on the thread when it starts; ``clock`` is read by the thread's
    loop (batching, heartbeat and back-off deadlines), never by the calling threads.
    """

    def __init__(
        self,
        session: Session,
        addr: str,
        token: str | None,
        *,
        transport: TransportFactory = _default_transport,
        poller: PollerFactory = _default_poller,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self.session = session
        self._cpu = cpu  # this thread's CPU clock (the shipping budget's)
        self.addr = addr
        self.token = token
        self._transport_factory = transport
        self._poller_factory = poller
        self._clock = clock
        self.interval_s = SEND_INTERVAL_S
        self.heartbeat_s = config.env_float(config.ENV_HEARTBEAT, config.DEFAULT_HEARTBEAT_S)
        self._stop = threading.Event()
        self._flush_requested = threading.Event()
        self._wake = threading.Event()
        self._flushed = threading.Event()
        self._thread: threading.Thread | None = None
        self._main_ident = threading.main_thread().ident
        self.reader: RingReader | None = None  # the ring's reader, where this thread ships it
        self.link_losses = 0  # times the node agent's end of the link closed
        self.fallbacks = 0  # times this rank went on without its agent (shipping its own records)
        self.batches_sent = 0
        self.wakes = 0  # times the linked loop went to sleep (each wake-up costs CPU, cold caches)
        self.send_failures = 0
        self.registered = False
        self.coordinator_id = ""

    def ring_counts(self) -> tuple[int, int]:
        """(queued, dropped): records in the ring not shipped yet, and records overwritten
        before they were shipped. Only meaningful where this thread ships the ring (direct)."""
        from hangwatch.ring import RingReader

        reader = self.reader or RingReader(self.session.sink.fd)
        return reader.counts()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hangwatch-sender", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def flush(self, timeout: float) -> bool:
        """Ask the thread to send what is queued now; wait at most ``timeout`` seconds."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return False
        self._flushed.clear()
        self._flush_requested.set()
        self._wake.set()
        return self._flushed.wait(timeout)

    # ---- the thread -----------------------------------------------------------------------

    def _group_announcements(self) -> list[r.RankEvent]:
        recorder = self.session.recorder
        with recorder.lock:
            groups = sorted(recorder.groups.by_id.values(), key=lambda g: g.index)
        now = time.time()
        return [r.GroupEvent(recorder.rank, r.GroupEventKind.CREATED, g, now) for g in groups]

    def _where(self) -> tuple[str, str, tuple[str, ...]]:
        """Innermost frame, innermost user frame, and the program's own frames (innermost first,
        a few) of the main thread, sampled now."""
        frame = sys._current_frames().get(self._main_ident or -1)
        if frame is None:
            return "", "", ()
        code = frame.f_code
        where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        recorder = self.session.recorder
        return where, recorder.call_site_of(frame), recorder.program_frames(frame, STACK_FRAMES)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # the thread dies quietly; the job goes on
            log.warning("hangwatch: sender stopped after an internal error: %s", exc)

    def _loop(self) -> None:
        """Linked while a node agent reads the ring; shipping directly while none does (none on
        this node, or the agent gone longer than ``FALLBACK_AFTER_S``: a restarting node agent
        must not leave its ranks silent, or they would look frozen); linked again once an agent
        answers. Each loop returns True when the thread is to stop."""
        while True:
            if self.session.link is not None:
                if self._loop_linked():
                    return
                log.warning(
                    "hangwatch: no node agent for %.0f s; this rank ships its own records until one answers",
                    FALLBACK_AFTER_S,
                )
                self.fallbacks += 1
            elif self._loop_direct():
                return

    def _poll(self, poller: Poller | None, now: float, final: bool) -> None:
        """Async completions, and Flight Recorder (also when the rank ends: C++-issued
        collectives since the last poll, DDP's last buckets, would otherwise never be seen)."""
        try:
            self.session.recorder.poll_pending()
            if poller is not None and (final or poller.due(now)):
                poller.poll()
        except Exception as exc:
            self.session.fail("polling async works", exc)

    def _loop_linked(self) -> bool:
        """The node agent reads the ring from outside: nothing to ship from here. The thread
        only records what it alone can see (async completions; Flight Recorder entries where
        the rank has no worker server for the agent to read them through),
        publishes where the main thread is every heartbeat, and links again when its agent goes
        away (a restarted coordinator's embedded agent, a restarted node agent): the new agent
        reads the ring from its start, as far as it still holds, and registers the rank anew.

        It wakes every ``interval_s`` only while it has something to poll (async works recorded
        in the last ``ASYNC_QUIET_S``, or Flight Recorder read from here); otherwise it sleeps to
        its next heartbeat (``MAX_SLEEP_S`` at most: a lost link is seen within it, and the
        fallback is timed from when the link was last seen open), and an async work recorded
        meanwhile wakes it at once (once: it polls every ``interval_s`` from then on). A wake-up
        costs the rank CPU whatever follows it (caches gone cold): it sleeps as long as it may."""
        session = self.session
        clock = self._clock
        # the agent reads Flight Recorder through the worker server; only without one, from here
        session.recorder.covers = session.worker_server is None
        session.recorder.flush_novel = False  # every record is outside the rank already
        poller = self._poller_factory(session.recorder) if session.worker_server is None else None
        recorder = session.recorder
        async_seen, async_at = -1, clock()  # async works recorded as of a wake-up, and when they moved
        seen_open = clock()  # when the link was last seen open
        last_status = 0.0
        relink_at = 0.0
        lost_at: float | None = None
        backoff = 0.25
        while True:
            stopping = self._stop.is_set()
            flushing = self._flush_requested.is_set()
            now = clock()
            self._poll(poller, now, flushing or stopping)
            if now - last_status >= self.heartbeat_s or flushing:
                where, where_user, stack = self._where()
                session.sink.set_status("\n".join((where, where_user, *stack)), time.time())
                last_status = now
            if session.link is not None and _closed(session.link):
                session.link.close()
                session.link = None
                self.link_losses += 1
                lost_at = seen_open  # not when a long sleep ended: the fallback is not put off
                log.warning("hangwatch: lost the link to the node agent; will link again")
            elif session.link is not None:
                seen_open = now
            if session.link is None and now >= relink_at and not stopping:
                if not session.relink():
                    relink_at = now + backoff
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                else:
                    backoff = 0.25
                    lost_at = None
            if session.link is None and lost_at is not None and now - lost_at >= FALLBACK_AFTER_S and not stopping:
                return False
            if flushing:
                self._flush_requested.clear()
                self._flushed.set()
            if stopping:
                return True
            timeout = self.interval_s
            calls = recorder.async_calls
            if calls != async_seen:
                async_seen, async_at = calls, now
            if poller is None and session.link is not None and now - async_at >= ASYNC_QUIET_S:
                # nothing to poll for (no async work recorded for a while): sleep to the next
                # heartbeat; an async work recorded meanwhile wakes the thread at once
                recorder.on_pending = self._wake.set  # before looking: one of the two sees it
                if not recorder.pending and recorder.async_calls == calls:
                    timeout = min(max(self.interval_s, last_status + self.heartbeat_s - clock()), MAX_SLEEP_S)
                else:
                    recorder.on_pending = None
            self.wakes += 1
            self._wake.wait(timeout)
            recorder.on_pending = None
            self._wake.clear()

    def _loop_direct(self) -> bool:
        """No agent reads the ring: read it here and ship it to the coordinator. Where this rank
        was linked before (its agent went away), the ring is read from its start, the calls the
        coordinator already holds are skipped (its registration reply says up to which), Flight
        Recorder is read from here from now on, and the loop hands back to the linked one as
        soon as an agent answers, also one that started after this rank (returns False); True
        when the thread is to stop."""
        from hangwatch.ring import RingReader

        session = self.session
        recorder = session.recorder
        clock = self._clock
        resumed = bool(session.agent_socket) and self.link_losses > 0
        if resumed:
            recorder.covers = True  # the in-rank Flight Recorder reader needs coverage from now on
            recorder.flush_novel = True  # records leave the rank in batches again
        transport = self._transport_factory(self.addr, self.token)
        poller = self._poller_factory(recorder)
        if resumed and poller is not None:
            poller.skip_existing()  # what is there already was read by the agent, or is Python's
        reader = self.reader = RingReader(session.sink.fd)
        relink_at = clock() + RELINK_EVERY_S
        backoff = 0.25
        retry_at = 0.0
        last_sent = 0.0
        batch_seq = 0
        announce: list[r.RankEvent] = []
        pending: Batch | None = None
        warned = False
        budget = ShipBudget(self.interval_s)
        while True:
            stopping = self._stop.is_set()
            flushing = self._flush_requested.is_set()
            now = clock()
            interval = budget.observe(self._cpu(), now)
            transport.budget_note = budget.note
            if poller is not None:
                poller.interval_s = max(config.FR_POLL_INTERVAL_S, interval / budget.base_s * config.FR_POLL_INTERVAL_S)
            self._poll(poller, now, flushing or stopping)
            if now >= retry_at or flushing:
                try:
                    if not self.registered:
                        reply = transport.register(session.identity)
                        self.registered = True
                        if self.coordinator_id and reply.coordinator_id != self.coordinator_id:
                            # a restarted coordinator knows nothing of our groups: announce them again
                            announce = self._group_announcements()
                        self.coordinator_id = reply.coordinator_id
                        if reply.report_interval_s > 0:  # large jobs: the coordinator asks for fewer RPCs
                            self.interval_s = min(max(reply.report_interval_s, MIN_INTERVAL_S), MAX_INTERVAL_S)
                            budget.base_s = budget.interval_s = self.interval_s
                    if pending is None:
                        pending = reader.poll(MAX_BATCH)
                    if not (
                        pending.slots or pending.blobs or announce or now - last_sent >= self.heartbeat_s or flushing
                    ):
                        pending = None  # nothing read, nothing due: read the ring again next time
                    else:
                        where, where_user, stack = self._where()
                        batch_seq += 1
                        backlog = reader.backlog() if len(pending.slots) >= MAX_BATCH else 0
                        ack = transport.report(
                            session.identity,
                            batch_seq,
                            announce,
                            backlog,
                            reader.lost,
                            where,
                            where_user,
                            urgent=flushing,
                            ring=pending,
                            stack=stack,
                        )
                        if ack.reregister:
                            self.registered = False
                            retry_at = 0.0
                            continue  # register, then resend the same records
                        pending = None
                        announce = []
                        last_sent = now
                        self.batches_sent += 1
                        backoff = 0.25
                        warned = False
                        if backlog >= MAX_BATCH:
                            continue  # another full batch waiting: send it right away
                except Exception as exc:
                    self.send_failures += 1
                    self.registered = False
                    transport.close()
                    if not warned:
                        log.warning(
                            "hangwatch: coordinator %s unreachable (%s); will retry",
                            self.addr,
                            type(exc).__name__,
                        )
                        warned = True
                    retry_at = clock() + backoff
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    if pending is not None and not pending.slots:
                        pending = None
            if flushing:
                self._flush_requested.clear()
                self._flushed.set()
            if stopping:
                transport.close()
                reader.close()
                return True
            if session.agent_socket and now >= relink_at and pending is None:
                # an agent again, or for the first time (the rank started before its node's
                # agent): it reads the ring from its start and skips what we sent
                relink_at = now + RELINK_EVERY_S
                if session.relink():
                    log.info("hangwatch: linked to a node agent%s", " again" if resumed else "")
                    transport.close()
                    reader.close()
                    self.registered = False
                    return False
            self._wake.wait(budget.interval_s)  # a flush or stop wakes the thread at once
            self._wake.clear()
