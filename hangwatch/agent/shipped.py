"""What the shipper keeps of each linked rank, the pace it reads them at, and when device progress rides."""

from __future__ import annotations

from dataclasses import dataclass, field

from hangwatch import records as r
from hangwatch import wire
from hangwatch.agent.flightrecorder import Fetched, RingFetcher
from hangwatch.agent.rings import RankLink
from hangwatch.flight_entries import EntryTracker
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch, Kind, RingReader
from hangwatch.ringwire import RingEncoder

#: Slots read per rank per tick at most (a batch the coordinator takes in one piece).
MAX_SLOTS = 8000
#: How often the shipper looks at its ranks' rings.
TICK_S = 0.05
#: The program's own frames of a rank's status shipped (``Recorder.program_frames`` writes as many).
STACK_KEPT = 6
#: How long a rank's last Flight Recorder read, asked of its worker server as it ends, may take
#: (the rank waits ``client.session.FAREWELL_TIMEOUT_S`` for its farewell).
LAST_READ_S = 0.5
#: How often it looks at the ring of a rank in a steady state: whose last batch held only calls
#: of signatures shown before, each returned without error (``RingEncoder.steady``), and no call
#: under way held back; anything else is read every tick. Steady ranks are looked at on the same
#: tick, once a period of the monotonic clock, so that their records of one collective arrive
#: together, and read once every ``READ_S``; between reads a look is a few of the ring's stamps
#: (``RingReader.peek``), and the rank is read at once where it shows what a detector waits for:
#: nothing written since the last look while some slots are unread, or a call entered and still
#: under way a tick later. Fewer, larger batches cost the coordinator less per call.
STEADY_S = 0.2
#: How often a steady rank that keeps writing is read: every other look, or as far apart as the
#: coordinator asks its batches to be where that is longer (a large job: a batch every READ_S from
#: each of 16,384 ranks would be five times what the coordinator asked for). At most half the
#: Flight Recorder poll interval (``config.FR_POLL_INTERVAL_S``, spaced as far with it): a CPU
#: ring is left unread only where Python calls decoded since its last poll account for what it
#: gained (``PythonAccounts``), so every poll must follow a read of the rank's ring.
READ_S = 2 * STEADY_S
#: The furthest apart a coordinator may ask a steady rank's reads to be (the hook's own sender
#: bounds what it is asked so too: ``client.sender.MAX_INTERVAL_S``).
MAX_PACE_S = 5.0
#: The slots a call entered at a look may be followed by, before the look a tick later stops
#: searching them for its exit and reads the rank (another thread's calls, written meanwhile).
RECHECK_SLOTS = 256
#: With no rank linked, the loop sleeps this long at most: a new link wakes it
#: (``RingServer.changed``), so this only bounds how long a missed wake could last.
IDLE_S = 1.0


@dataclass
class ShippedRank:
    """What the shipper keeps of one linked rank between ticks."""

    link: RankLink
    identity: r.RankIdentity
    encoder: RingEncoder = field(default_factory=RingEncoder)
    registered: bool = False
    batch_seq: int = 0
    pending: Batch | None = None
    #: ring reads sent in a call that failed or was refused (``outbox``): sent again first
    resend: list[Batch] = field(default_factory=list)
    last_sent: float = -1e9  # monotonic time of the last batch read (none yet: long ago)
    last_beat: float = -1e9  # and of the last sent unread (``Shipper._alive``)
    beat_head: int = 0  # where its ring's published slots ended at its last read or sent unread
    gone_reported: bool = False
    #: the time of the rank's own status (its sender thread rewrites it every heartbeat) when
    #: the last batch left: a batch without records is a heartbeat only if the rank wrote since
    status_time: float | None = None
    #: Flight Recorder: entries made into records, a read waiting for the ring to be read past
    #: it, and when the ring was last read to its end
    flight: EntryTracker | None = None
    fetched: Fetched | None = None
    read_to: float = float("-inf")
    farewell: bool = False
    #: when its last Flight Recorder read was asked for, as it ends, where it handed none over
    last_asked: float | None = None
    unsent: list[r.RankEvent] = field(default_factory=list)
    #: device progress that rides with the rank's next batch (``take_progress``), since when
    #: (monotonic), and per NCCL group the completed seq last read and whether it stood then
    riding: list[r.RankEvent] = field(default_factory=list)
    riding_since: float = 0.0
    device: dict[str, tuple[int, bool]] = field(default_factory=dict)
    #: the STEADY_S period (of the monotonic clock) in which a steady rank's ring was last read
    #: or looked at (None: not steady, read every tick)
    steady_period: int | None = None
    #: the READ_S period in which a steady rank was last read; where its ring's published slots
    #: ended at the last look; whether a call it was entering then is to be looked at again on
    #: the next tick; whether its next read comes of a look that found it had written nothing
    #: since (what it holds under way has been so for a tick at least: sent, not held back)
    read_period: int | None = None
    peek_head: int = 0
    #: how far apart the coordinator asked its batches to be (``RegisterReply.report_interval_s``,
    #: 2 s from 2,048 ranks): a steady rank that keeps writing is read every ``READ_S`` or this,
    #: the longer (0: not said)
    pace: float = 0.0
    #: how far apart its ring is read while it is steady, where the coordinator asked for longer
    #: than ``pace`` (``RegisterReply.steady_read_s``, a large job; 0: not): between reads it is
    #: said alive every ``pace`` by a batch sent unread (``ReportBatch.unread``)
    steady_read: float = 0.0
    blobs_dropped: int = 0  # the ring's blobs dropped (its blob area full) as of its last read
    recheck: tuple[int, int] | None = None  # (position, call id) of a call entered at the last look
    quiet: bool = False
    #: when the latest Flight Recorder read whose records have all gone was asked (the
    #: header's ``flight_read_time``), and that of a read whose records wait in ``unsent``
    flight_told: float = 0.0
    flight_pending: float = 0.0
    flight_floor: float = 0.0  # when it last registered: polls vouched for before do not count
    flight_said: float = 0.0  # the ``flight_read_time`` of the latest batch sent


def has_records(batch: Batch | None) -> bool:
    """A read that found something to send (slots, or blobs alone)."""
    return batch is not None and bool(batch.slots or batch.blobs)


def returned(reader: RingReader, entered: tuple[int, int], head: int) -> bool:
    """Whether the call entered at ``entered``'s position (with its call id) has its exit among
    the slots after it, up to ``head`` (``RECHECK_SLOTS`` of them at most: beyond, no)."""
    at, call_id = entered
    for p in range(at + 1, min(head, at + 1 + RECHECK_SLOTS)):
        slot = reader.slot_at(p)
        if slot.kind == Kind.EXIT and slot.call_id == call_id:
            return True
    return False


def take_progress(state: ShippedRank, progress: r.GroupProgress, now: float, ride_ok: bool = True) -> None:
    """Where a NCCL group stands on the device, to ship: at once (``unsent``) where work is pending
    on it (enqueued, not completed: the first read of a device that stopped looks like any other,
    and a stop told from one rank's read alone named one waiting rank of two), where it stood at
    the last read and has moved since, or where nothing rides (``ride_ok``:
    ``HANGWATCH_READ_LESS=0``); else, the device caught up, with the rank's next batch
    (``riding``), within ``read_every``: it tells nothing a detector waits for."""
    last = state.device.get(progress.group)
    pending = progress.completed < progress.enqueued
    stands = last is not None and pending and progress.completed == last[0]
    state.device[progress.group] = (progress.completed, stands)
    if pending or (last is not None and last[1]) or not ride_ok:
        state.unsent.append(progress)
        return
    if not state.riding:
        state.riding_since = now
    state.riding.append(progress)


def ride(state: ShippedRank, batch: pb.ReportBatch | None = None) -> list[r.RankEvent]:
    """The device progress waiting to ride, taken (added to ``batch``, where given)."""
    rode, state.riding = state.riding, []
    if batch is not None:
        for event in rode:
            wire.event_to_pb(event, batch.events.add())
    return rode


def riding_due(state: ShippedRank, now: float) -> bool:
    """Whether device progress has waited to ride as long as it may (a batch goes for it)."""
    return bool(state.riding) and now - state.riding_since >= read_every(state)


def read_every(state: ShippedRank) -> float:
    """How far apart a steady rank that keeps writing is read."""
    return max(READ_S, state.pace, state.steady_read)


def due(state: ShippedRank, fetcher: RingFetcher, mono: float, clock: float, max_slots: int) -> bool:
    """Whether a steady rank, read in this ``READ_S`` already, is to be read now: a look at
    its ring's stamps (``RingReader.peek``, a few µs), its newest slot, and its Flight
    Recorder reads.

    Read now: a Flight Recorder read waits to be shipped, or device progress to ride; the
    rank made a blob since its last read (a call of a new kind, an error, a group); the
    writer lapped the last look, or a quarter of the ring (a full batch at most) waits; the
    rank wrote nothing for a tick at least (its newest slot's time, or no slot since the
    last look) while some slots are unread: it went quiet, inside a call that does not
    return or at work outside any, and its last records are what a detector needs. A call
    the rank had just entered at the last look is looked at again on the next tick
    (``recheck``): without its exit then (whatever another thread wrote meanwhile), it is
    read and sent, not held back (a mismatch's ranks are read a tick after they froze, as
    when they were read every period). A rank that keeps writing, not inside a call, is
    read at the next ``read_every``."""
    link = state.link
    if (state.flight is not None and fetcher.has_new(id(link))) or riding_due(state, mono):
        return True
    reader = link.reader
    if reader.blobs_waiting() or reader.blobs_dropped != state.blobs_dropped:
        return True  # a call of a new kind (a mismatch's), an error, a group: what a detector waits for
    head = reader.peek(state.peek_head)
    if head < 0 or head - reader.position >= min(max_slots, reader.capacity // 4):
        return True
    entered, state.recheck = state.recheck, None
    if entered is not None and not returned(reader, entered, head):
        state.quiet = True
        return True
    if head == state.peek_head:
        if head > reader.position:
            state.quiet = True
            return True
        return False
    state.peek_head = head
    newest = reader.slot_at(head - 1)
    if clock - newest.time >= TICK_S:
        state.quiet = True
        return True
    if newest.kind == Kind.ENTER and not newest.flags & 1:
        state.recheck = (head - 1, newest.call_id)
    return False


def nothing_unread(state: ShippedRank) -> bool:
    """Whether the rank's ring holds nothing unread (a look at its stamps)."""
    reader = state.link.reader
    return 0 <= reader.peek(state.peek_head) <= reader.position


def unread_due(state: ShippedRank, now: float) -> bool:
    """Whether a steady rank read far apart (``steady_read``) is to be said alive unread now: a
    ``pace`` since its last batch, and its sender thread rewrote its status or its main thread
    wrote records since the last (a frozen rank does neither: its silence is told as before)."""
    if now - max(state.last_sent, state.last_beat) < state.pace:
        return False
    reader = state.link.reader
    status = reader.status()
    head = reader.peek(state.beat_head)
    if status is not None and status[0] == state.status_time and 0 <= head <= state.beat_head:
        return False
    state.beat_head = max(head, state.beat_head)
    return True
