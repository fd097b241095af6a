"""The node agent ships its linked ranks' records: read from their rings, off the ranks' GILs.

For every rank linked to this node's agent (:mod:`hangwatch.agent.rings`), each tick:

- registers it with the coordinator on its behalf, once, with the identity the kernel proved
  (the pid at the other end of the link, its start time read from ``/proc``; this node's name as
  the host) and the rest as the rank said it in its hello;
- reads what the rank wrote into its ring since the last tick, turns it into a wire batch
  (:class:`~hangwatch.ringwire.RingEncoder`) with the rank's status (where its main thread is)
  and hands it to the coordinator; a batch the coordinator refuses for want of a registration is
  kept and sent again after registering;
- reads the rank's Flight Recorder rings from outside the process, through its worker server
  (:class:`~hangwatch.agent.flightrecorder.RingFetcher`, on a thread of its own), and ships the
  collectives no Python call covered (DDP's buckets, anything issued from C++) as records
  (:mod:`hangwatch.flight_entries`); a rank that says it is ending gets one last read before it
  is let go, so its last C++-issued collectives are not lost with it; a CPU ring whose reads
  keep finding only Python's calls is left unread while the rank's Python calls account for
  all it gained (:class:`~hangwatch.flight_entries.PythonAccounts`), at most 10 s;
- ships, with every read of a NCCL ring, where each group's collectives stand on the device
  (enqueued, started, completed): on NCCL a call returns when it is enqueued, and the
  coordinator keeps it open until the device completes it. A group with work pending on its
  device (or that stood and moved) goes at once; one caught up rides with the rank's next batch;
- once the link has closed (the process is gone, however it went) and the ring is read to the
  end, reports the process gone, at the moment its link closed, with how it ended where
  ``/proc`` still says so (a zombie's exit status), and forgets the link.

``intake`` takes the records (:mod:`hangwatch.agent.intake`). Nothing here blocks the ranks: they
never wait for the agent.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from hangwatch import config, wire
from hangwatch import records as r
from hangwatch.agent.flightrecorder import RingFetcher
from hangwatch.agent.header import header as make_header
from hangwatch.agent.header import unread_header
from hangwatch.agent.intake import DirectIntake, Intake, ManyIntake, identity_of, tell_phases
from hangwatch.agent.namespaces import path_of
from hangwatch.agent.outbox import Outbox, Queued
from hangwatch.agent.procinfo import ProcessInspector
from hangwatch.agent.rings import RankLink, RingServer
from hangwatch.agent.shipped import (
    IDLE_S,
    LAST_READ_S,
    MAX_PACE_S,
    MAX_SLOTS,
    READ_S,
    STEADY_S,
    TICK_S,
    ShippedRank,
    due,
    has_records,
    nothing_unread,
    read_every,
    ride,
    riding_due,
    take_progress,
    unread_due,
)
from hangwatch.flight_entries import EntryTracker, PythonAccounts
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch
from hangwatch.sendfold import SenderFold

log = logging.getLogger("hangwatch.agent")

__all__ = ["READ_S", "STEADY_S", "TICK_S", "Shipper"]


class Shipper:
    """Ships the records of the ranks linked to ``server`` to ``intake``. Not thread-safe: one
    thread calls :meth:`tick` (see ``run``)."""

    def __init__(
        self,
        server: RingServer,
        intake: Intake,
        host: str,
        inspector: ProcessInspector,
        clock: Callable[[], float] = time.time,
        heartbeat_s: float = 1.0,
        flight_recorder: RingFetcher | None = None,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server = server
        self.intake = intake
        self.host = host
        self.inspector = inspector
        self.clock = clock
        self.mono = mono
        self.heartbeat_s = heartbeat_s
        self.fetcher = flight_recorder if flight_recorder is not None else RingFetcher(clock=clock)
        self._ranks: dict[int, ShippedRank] = {}  # by id(link)
        #: the coordinator is in this process: records go to it typed, not through protobuf
        #: (``bench/ring_to_state.py`` measures both)
        self.direct: DirectIntake | None = intake if hasattr(intake, "accept_events") else None  # type: ignore[assignment]
        #: a coordinator over the network: an open rank's batches of a tick go with all the
        #: others' in one call (``outbox``)
        many: ManyIntake | None = intake if hasattr(intake, "accept_reports") else None  # type: ignore[assignment]
        self.outbox = Outbox(many.accept_reports) if many is not None and self.direct is None else None
        #: a steady rank's ring read every STEADY_S, a CPU Flight Recorder ring Python calls
        #: account for left unread (``HANGWATCH_READ_LESS=0``: every tick, every poll)
        self.read_less = config.env_flag(config.ENV_READ_LESS, True)
        self.refused = 0  # links whose registration the coordinator refused
        self.failures = 0  # ticks on which the coordinator could not be reached
        self._failing = False

    def tick(self) -> None:
        now = self.mono()
        period = int(now // STEADY_S)  # one clock for all ranks: steady ones are looked at together
        shipped = False
        for link in self.server.links():
            state = self._ranks.get(id(link))
            if state is None:
                state = self._ranks[id(link)] = self._new_rank(link)
            reading = int(now // read_every(state))  # and read together
            waiting = link.ending_at is not None and not state.farewell  # an ending rank: its farewell
            if state.steady_period is not None and link.closed_at is None and not waiting:
                if state.steady_period == period and state.recheck is None:
                    if not self._alive(state):
                        continue  # steady: looked at in the next period
                # looked at on a read's tick too: what a read then finds under way a tick goes (``quiet``)
                elif (
                    not due(state, self.fetcher, self.mono(), self.clock(), MAX_SLOTS) and state.read_period == reading
                ):
                    state.steady_period = period
                    if not self._alive(state):
                        continue  # read in this READ_S already, and nothing a detector waits for
            try:
                # steady as of its last read, or let go after its end (a process that lives on)
                was_steady = state.steady_period is not None or state.farewell
                position = link.reader.position
                state.encoder.steady = False
                self._ship(state)
                # a read that found nothing leaves the rank as it was: one between bursts of
                # calls (a step's compute, evaluation) is not read every tick for nothing
                still = was_steady and link.reader.position == position
                # a call held back (under way as the ring was read) goes on the next tick: it may
                # be one that never returns, or one of a mismatch the other ranks' records tell
                steady = (
                    self.read_less
                    and (state.encoder.steady or still)
                    and not state.encoder.holding
                    and not has_records(state.pending)  # an empty read is kept back, not sent
                    and not state.unsent
                    and not state.resend
                )
                state.steady_period = period if steady else None
                state.read_period = int(now // read_every(state)) if steady else None
                state.peek_head = link.reader.position
                state.recheck, state.quiet = None, False
                shipped = True
            except Exception as e:  # the coordinator is unreachable (remote agents): retry next tick
                state.registered = False  # a restarted coordinator must hear of the rank again
                state.steady_period = None  # its batch waits: tried again every tick, as it was
                self._unreachable(f"rank {state.identity.rank}'s records", e)
        if self.outbox is not None:
            try:
                self.outbox.flush()  # undoes what the coordinator refused or did not get
            except Exception as e:
                shipped = False
                self._unreachable("the ranks' records", e)
        if shipped and self._failing:
            log.info("coordinator reachable again: shipping resumed")
            self._failing = False
        tell_phases(self.server, self.intake, self.host, self.inspector)

    def _unreachable(self, what: str, e: Exception) -> None:
        self.failures += 1
        if not self._failing:
            log.warning("cannot ship %s (%s); will retry", what, e)
            self._failing = True

    def close(self) -> None:
        self.fetcher.stop()

    def next_tick_in(self) -> float:
        """Seconds until a tick has work: ``TICK_S`` while a rank is read every tick (not steady,
        or the coordinator unreachable), the next ``STEADY_S`` period when every rank is steady,
        ``IDLE_S`` with none. A link made, ending or closed wakes the loop sooner (``run``).

        A wake-up costs CPU whatever is done after it (caches go cold over the sleep), so the
        loop does not tick for nothing."""
        if not self._ranks:
            return IDLE_S
        if any(state.steady_period is None or state.recheck is not None for state in self._ranks.values()):
            return TICK_S
        now = self.mono()
        return max(0.001, (int(now // STEADY_S) + 1) * STEADY_S - now + 0.001)

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set (and the server's ``changed``, or a tick's wait passed),
        sleeping between ticks as long as nothing is due; then ``close``."""
        changed = self.server.changed
        while True:
            changed.clear()  # before the tick: a change during it makes the wait return at once
            if stop.is_set():  # after the clear: a stop's wake is never swallowed
                break
            try:
                self.tick()
            except Exception:  # every rank's shipping would stop with this thread
                log.exception("shipping tick failed")
            if changed.wait(self.next_tick_in()):
                # woken by a link made, ending or closed: what comes with it goes in the same tick.
                # A job stopped as a whole closes every link within moments, and the selector
                # thread stamps each close as it sees it; a tick at the first close would take the
                # GIL from it (reporting that rank gone) and spread the later stamps past
                # ``ends.TOGETHER_S``: on a loaded machine, a false rank_died (the ticks every
                # ``TICK_S`` before this loop slept left the selector that long, as this does)
                stop.wait(TICK_S)
        self.close()

    def _new_rank(self, link: RankLink) -> ShippedRank:
        state = ShippedRank(link, identity_of(link, self.host, self.inspector))
        path = link.hello.get("worker_socket")
        if isinstance(path, str) and path and link.alive:
            state.flight = EntryTracker(state.identity.rank)
            python = state.encoder.python

            def needed(since: dict[str, tuple[int, int]]) -> bool:  # on the fetcher's thread
                return not all(python.covers_all(group, lo, hi) for group, (lo, hi) in since.items())

            # the CPU ring has no cheap probe: Python calls account for what it gained, or not
            accounted = PythonAccounts(state.flight, python) if self.read_less else None
            self.fetcher.watch(id(link), path_of(link.peer.pid, path), link.peer.pid, needed, accounted)
        return state

    def _ship(self, state: ShippedRank) -> None:
        link = state.link
        closed = link.closed_at is not None
        # said before this tick's reads: its RankEnd, written before it said so, is read by them
        ending = link.ending_at is not None
        if state.flight is not None:
            taken = self.fetcher.take(id(link))
            if taken is not None and (state.fetched is None or taken.time >= state.fetched.time):
                state.fetched = taken  # never an older read over a newer one (the last read)
                # where the rank's NCCL groups stand on the device needs no Python call to be
                # seen first (the coordinator orders it by seq and time)
                rank = state.identity.rank
                for progress in taken.progress:
                    take_progress(state, dataclasses.replace(progress, rank=rank), self.mono(), self.read_less)
        if (closed or ending) and state.riding:
            state.unsent += ride(state)  # its last word goes now
        if not state.registered:
            try:
                registration = self.intake.accept_registration(state.identity, via="agent")
            except ValueError as e:
                self.refused += 1
                # a rank that said it is ending, whose job the coordinator no longer follows: expected
                (log.info if link.ending_at is not None else log.warning)(
                    "rank link from pid %d refused by the coordinator: %s", link.peer.pid, e
                )
                self.server.forget(link)
                del self._ranks[id(link)]
                return
            state.registered = True
            state.encoder.reset()
            # a coordinator that did not hear of the reads so far (restarted) is told of reads
            # from now on only: the records of those before went to its predecessor
            state.flight_told = state.flight_pending = 0.0
            state.flight_floor = self.clock()
            # what the coordinator holds already (this ring shipped by an agent before this one)
            state.encoder.skip_through = max(state.encoder.skip_through, registration.last_call_id)
            state.encoder.send_runs = registration.takes_runs  # runs of alike calls in one column entry
            state.encoder.send_cycles = registration.takes_cycles  # and of cycles of signatures
            # the calls that repeat a cycle folded here, not by the coordinator (``sendfold``)
            state.encoder.fold = SenderFold() if registration.takes_steps else None
            # a large job asks for its batches further apart (``READ_S``): a steady rank is read so,
            # and its Flight Recorder polled twice as far apart, each poll after a read of its ring
            # (a look still reads at once what a detector waits for)
            pace = registration.report_interval_s
            state.pace = min(pace, MAX_PACE_S) if pace > 0 else 0.0  # (NaN: not said)
            # a larger job still asks its steady ranks' rings to be read further apart: between
            # reads each is said alive unread (``_alive``)
            steady = registration.steady_read_s
            state.steady_read = min(steady, MAX_PACE_S) if steady > state.pace else 0.0
            if state.flight is not None and state.pace > READ_S:
                self.fetcher.space(id(link), 2 * state.pace)
        # an open rank's batches go with the other ranks' at the end of the tick; an ending or
        # closed one's at once, in the order its end needs (its last reads, then it is let go)
        fan = self.outbox is not None and not closed and not ending
        while True:
            # an empty batch kept back (nothing to send before the next heartbeat) is no reason
            # not to look again: the rank may have written since, or just died; reads a call
            # failed to deliver go first
            if state.pending is not None and has_records(state.pending):
                pending: Batch = state.pending
            else:
                pending = state.resend.pop(0) if state.resend else self._read(state)
            state.pending = pending
            now = self.clock()
            # a trailing call under way waits for the next read (runs), where the read reached the
            # ring's end (the call is in flight) and the link is open (not its last read); a call
            # held back goes with the next read, empty or not (a frozen rank writes no more)
            runs = self.direct.takes_runs if self.direct is not None else state.encoder.send_runs
            state.encoder.hold = (
                runs and not closed and pending is not None and len(pending.slots) < MAX_SLOTS and not state.quiet
            )
            if (
                not has_records(pending)
                and not self._heartbeat_due(state)
                and not state.encoder.holding
                and not riding_due(state, self.mono())
            ):
                break
            held = state.encoder.held_mark()
            if self.direct is not None:
                header = make_header(state, now, self.mono(), self.fetcher)
                events = state.encoder.decode(
                    pending, state.identity.rank, self.direct.record_cost, runs=self.direct.takes_runs
                )
                rode = ride(state)
                if self.direct.accept_events(header, events + rode if rode else events) is None:
                    state.registered = False
                    state.encoder.held_restore(held)  # the same records again: the same held back
                    state.riding[:0] = rode
                    return  # register on the next tick and send the same records again
            elif self.outbox is not None and fan:
                told, said = state.flight_told, state.flight_said
                batch = self._batch(state, pending, now)
                self.outbox.add(Queued(state, batch, pending, [], held, told, said, ride(state, batch)))
            else:
                batch = self._batch(state, pending, now)
                rode = ride(state, batch)
                reply = self.intake.accept_report(batch)
                if reply.reregister:
                    state.registered = False
                    state.encoder.held_restore(held)  # the same records again: the same held back
                    state.riding[:0] = rode
                    return  # register on the next tick and send the same records again
            state.pending = None
            state.last_sent = self.mono()  # heartbeats are timed on the monotonic clock
            if (pending is None or len(pending.slots) < MAX_SLOTS) and not state.resend:
                break  # read to the end for now (a full read: more to read, whatever runs made of it)
        if state.flight is not None:
            self._flight_recorder(state, fan)  # an ending rank's farewell comes after its last read
        elif ending and not state.farewell:
            # no Flight Recorder to read last (no worker server): its ring is read to the end since
            # it said it is ending (its RankEnd read), so it may go; before, it waited out the
            # farewell's timeout. Ending said during the reads: the wake it made reads it again
            state.farewell = True
            self.server.farewell(link)
        # gone, once its last read (on a reader thread) is in: forgetting it first loses that read
        if closed and not state.gone_reported and (state.flight is None or not ending or state.farewell):
            self._gone(state)

    def _read(self, state: ShippedRank) -> Batch:
        asked = self.clock()
        state.blobs_dropped = state.link.reader.blobs_dropped  # (before: one dropped meanwhile is read next)
        batch = state.link.reader.poll(MAX_SLOTS)
        state.beat_head = state.link.reader.position  # what it wrote after this says it is alive
        if len(batch.slots) < MAX_SLOTS:
            state.read_to = asked
        return batch

    def _flight_recorder(self, state: ShippedRank, fan: bool = False) -> None:
        """Ship the entries of the newest Flight Recorder read that no Python call covered, once
        the rank's ring has been read past the moment of that read (every Python call an entry
        could belong to has then been seen: its record was written before it was issued). A
        rank that says it is ending is read once more, here, and then let go: from the dump it
        handed over, made as it ended, which outlives it; else from its worker server, while
        its process lives. With ``fan``, its batches wait in the outbox: an end said since the
        tick began is seen on the next tick, after them."""
        link = state.link
        assert state.flight is not None
        ending = link.ending_at is not None and not state.farewell and not fan
        if ending:
            assert link.ending_at is not None
            if state.last_asked is None:
                # read on a reader thread, from the dump it handed over or from its worker
                # server: this thread serves every rank of the node
                dump = link.take_last_read()
                self.fetcher.ask_now(id(link), LAST_READ_S, dump, link.ending_at, lambda: link.alive)
                state.last_asked = self.mono()
            done, last = self.fetcher.asked(id(link))
            if not done and self.mono() - state.last_asked < LAST_READ_S + TICK_S:
                return  # looked at again next tick (the rank waits for its farewell)
            state.fetched = last or state.fetched
            if not has_records(state.pending):
                state.pending = self._read(state)  # read the ring past this last read
        fetched = state.fetched
        if fetched is not None and state.pending is not None and has_records(state.pending):
            batch = self._batch(state, state.pending, self.clock())  # records read meanwhile go first
            if self.intake.accept_report(batch).reregister:
                state.registered = False
                return
            state.pending = None
        if fetched is not None and state.read_to >= fetched.time:
            state.fetched = None
            python = state.encoder.python
            state.unsent += state.flight.update(
                fetched.entries, python, state.encoder.last_step, self.clock(), fetched.status, python.busy_on
            )
            if fetched.complete:  # a ring that failed says nothing of when C++'s were last seen
                if state.unsent:
                    state.flight_pending = max(state.flight_pending, fetched.time)
                else:
                    state.flight_told = max(state.flight_told, fetched.time)  # it found nothing new
        if state.unsent:
            now = self.clock()
            held, told, said = state.encoder.held_mark(), state.flight_told, state.flight_said
            batch = self._batch(state, Batch([], {}, 0), now)
            for event in state.unsent:
                wire.event_to_pb(event, batch.events.add())
            batch.flight_read_time = max(batch.flight_read_time, state.flight_pending)  # they go in it
            state.flight_said = max(state.flight_said, batch.flight_read_time)
            rode = ride(state, batch)
            if self.outbox is not None and fan:
                self.outbox.add(Queued(state, batch, None, list(state.unsent), held, told, said, rode))
            elif self.intake.accept_report(batch).reregister:
                state.registered = False
                state.riding[:0] = rode
                return  # sent again after registering
            state.unsent.clear()
            state.flight_told = max(state.flight_told, state.flight_pending)
            state.last_sent = self.mono()  # heartbeats are timed on the monotonic clock
        if ending:
            if state.flight_told > state.flight_said:
                # the last read found nothing new, so no batch carried it: the coordinator must
                # still hear that a read asked after the rank's end saw all it issued from C++
                # (else it takes the rank's last C++ collectives for unknown: an early end of a
                # DDP rank was told by nothing so, on a loaded CI machine)
                if self.intake.accept_report(self._batch(state, Batch([], {}, 0), self.clock())).reregister:
                    state.registered = False
                    return
                state.last_sent = self.mono()
            state.farewell = True
            self.server.farewell(link)

    def _alive(self, state: ShippedRank) -> bool:
        """Between the reads of a steady rank read far apart (``steady_read``), say it is alive
        every ``pace`` with a batch sent unread (``unread_due``). Whether to read it now instead:
        nothing unread and a heartbeat due (a read costs no more, and says the rank did nothing
        since: a rank that left its loop, busy, is blamed on it; said alive only, never)."""
        if not state.steady_read or not state.registered:
            return False
        now = self.mono()
        if now - state.last_sent >= self.heartbeat_s and nothing_unread(state):
            return self._heartbeat_due(state)
        if not unread_due(state, now):
            return False
        batch = unread_header(state, self.clock(), now)
        if self.direct is not None:
            refused = self.direct.accept_events(batch, []) is None
        elif self.outbox is not None:
            told, said = state.flight_told, state.flight_said
            self.outbox.add(Queued(state, batch, None, [], state.encoder.held_mark(), told, said, []))
            refused = False  # (the outbox undoes what is refused)
        else:
            refused = self.intake.accept_report(batch).reregister
        if refused:
            state.registered = False
            state.steady_period = None  # registered again on the next tick
        else:
            state.last_beat = now
        return False

    def _heartbeat_due(self, state: ShippedRank) -> bool:
        """Time for a batch without records, and the rank itself is alive: its sender thread
        rewrote its status since the last batch (or never wrote one yet). The agent never
        heartbeats for a rank whose interpreter is stuck (the GIL held in native code, SIGSTOP):
        that silence is how the coordinator tells it frozen."""
        if self.mono() - state.last_sent < self.heartbeat_s:
            return False
        status = state.link.reader.status()
        return status is None or state.status_time is None or status[0] != state.status_time

    def _batch(self, state: ShippedRank, ring: Batch, now: float) -> pb.ReportBatch:
        batch = make_header(state, now, self.mono(), self.fetcher)
        state.encoder.encode(ring, batch)
        return batch

    def _gone(self, state: ShippedRank) -> None:
        """The rank's process is gone (its link closed): say so, with how it ended if /proc knows."""
        link = state.link
        closed_at = link.closed_at or self.clock()
        now_status = self.inspector.status(link.peer.pid)
        seen = link.exit_code is not None or link.exit_signal is not None  # at the moment it closed
        ended = r.ProcessStatus(
            pid=link.peer.pid,
            state=r.ProcState.ZOMBIE if seen or now_status.state is r.ProcState.ZOMBIE else r.ProcState.DEAD,
            time=closed_at,
            start_time=state.identity.start_time,
            exit_code=link.exit_code if seen else now_status.exit_code,
            signal=link.exit_signal if seen else now_status.signal,
            oom_killed=link.oom_killed,
        )
        self.intake.apply_process_statuses(self.host, [ended])
        state.gone_reported = True
        self.fetcher.forget(id(link))
        self.server.forget(link)
        del self._ranks[id(link)]
