"""Per-rank and per-slot records of the job state (``hangwatch.diagnosis.state``): what the
coordinator knows of one rank (its clock, open calls, history, end, device progress) and of one
(group, seq) slot. ``JobState`` (in ``state``) is the one place that changes them.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from hangwatch import records as r
from hangwatch.diagnosis.state.history import History

OFFSET_SAMPLES = 32  # clock-offset samples per rank (batches: 6-64 s of them)
CLOCK_STEP_S = 30.0  # a sample this far from the estimate means the rank's clock was stepped
#: A change of (wall - monotonic) between two batches of a rank larger than this is a step of its
#: wall clock (NTP stepping it, a VM resumed): slewing moves it by under a millisecond a second,
#: and a sender descheduled between its two clock reads moves it by that gap (well under this on
#: a loaded host); a smaller step is harmless to thresholds of seconds.
CLOCK_JUMP_S = 1.0
#: Without ``mono_time``, this many batches in a row whose samples are ``CLOCK_BACK_S`` above the
#: estimate mean the rank's clock went back (or its batches are that late to arrive): its times
#: are mapped later from then on, which only delays a judgement; mapped too early, every later
#: call of the rank would look that much older.
CLOCK_BACK_BATCHES = 3
CLOCK_BACK_S = 2.0


#: gloo's monitored_barrier: seqs it takes on every rank but the group's rank 0 (a send, a recv)
UNEVEN_SEQS_ELSEWHERE = 2
SEQ_SHIFTS_KEPT = 64


def _shift_at(shifts: list[tuple[int, int]], raw: int) -> int:
    """The shift in force for torch's seq ``raw``: that of the last breakpoint before it."""
    for after, total in reversed(shifts):
        if raw > after:
            return total
    return 0


#: A rank's device progress (NCCL) is believed while it keeps coming (the agent sends it on every
#: read of the ring, about once a second). Older than this, completion is no longer watched: the
#: calls it held open are taken as complete when they returned, as on a backend without it, so
#: a lost agent can never keep a healthy rank "in" calls it finished long ago.
PROGRESS_FRESH_S = 5.0


#: DDP forward passes kept per rank: a skipped backward is told within this many steps.
FORWARDS_KEPT = 64


@dataclass
class RankState:
    identity: r.RankIdentity
    registered_at: float
    last_seen: float
    clock_offset: float = 0.0  # coordinator time minus rank time (see observe_clock)
    wall_skew: float | None = None  # the rank's wall minus monotonic clock at its latest batch
    clock_steps: int = 0  # steps of the rank's wall clock seen
    late_samples: int = 0  # batches in a row sampled ``CLOCK_BACK_S`` above the estimate (no mono_time)
    offset_samples: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=OFFSET_SAMPLES))
    step: int = 0
    step_times: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=64))
    timed_step: int = -1  # the step whose time ``step_times`` took last (calls move ``step`` first)
    open_calls: dict[int, r.CallRecord] = field(default_factory=dict)
    open_collectives: dict[str, dict[int, r.CallRecord]] = field(default_factory=dict)  # group -> id -> call
    last_call: r.CallRecord | None = None
    last_progress: float = 0.0  # coordinator time of the last enter/exit/step
    last_sent: float = 0.0  # coordinator time the latest batch left the rank (or its latest call began)
    #: coordinator time the latest batch left, read or not (``ReportBatch.unread``: a steady
    #: rank between its node agent's reads says only that it is alive): how late it is heard
    heard_to: float = 0.0
    #: coordinator time of the latest Flight Recorder read of the rank whose records have all
    #: come (0: its rings are not read by a node agent): what C++ issued before it is known
    flight_to: float = 0.0
    #: groups its node agent found it inside an op of that no Flight Recorder read showed (its
    #: entry overwritten before it was read: ``flight_entries.EntryTracker.unseen``), the agent's
    #: latest word: the rank is not absent from those groups' collectives
    unseen: tuple[str, ...] = ()
    history: dict[str, History] = field(default_factory=dict)
    groups: dict[str, r.GroupInfo] = field(default_factory=dict)
    end: r.RankEnd | None = None
    proc: r.ProcessStatus | None = None
    where: str = ""
    where_user: str = ""
    #: which of its own processes its main thread waits for, and where each is, from a stack
    #: dumped at ``waits_for_at`` (coordinator time): (pid, what, where)
    waits_for: tuple[tuple[int, str, str], ...] = ()
    waits_for_at: float = 0.0
    #: the program's own frames of its main thread at its latest batch, innermost first (a few)
    where_stack: tuple[str, ...] = ()
    #: what its hook or its node agent slowed down to stay within its CPU budget (its latest batch's word)
    budget_note: str = ""
    relay: str = ""  # the node agent relaying this rank's batches, if any
    via: str = "direct"  # "agent": a node agent reads the rank's ring and registered it (kernel-proven pid)
    #: a node agent registered this session from the rank's own link (its pid is the kernel's
    #: word): only such a rank is ever dumped or signalled, whichever path ships it later
    proven: bool = False
    queued: int = 0
    dropped: int = 0
    markers: collections.deque[r.MarkerEvent] = field(default_factory=lambda: collections.deque(maxlen=16))
    #: the rank's DDP forward passes that sync gradients: (its count of them, group, torch's seq
    #: on the group when it began, step), the latest ``FORWARDS_KEPT`` (see ``model.align``)
    forwards: collections.deque[tuple[int, str, int, int]] = field(
        default_factory=lambda: collections.deque(maxlen=FORWARDS_KEPT)
    )
    forward_count: int = 0
    #: calls, runs and forward passes applied: the rank's trace changed when this did (the model's
    #: stories are kept until it does: ``coordinator.explain``)
    traced: int = 0
    #: the highest call id of the rank's own numbering received (an agent taking over its ring
    #: resumes after it), and per group the highest seq of records an agent made from Flight
    #: Recorder entries (made again by a new agent, they are the same records: dropped)
    last_call_id: int = 0
    entry_seqs: dict[str, int] = field(default_factory=dict)
    #: per group: the highest seq of a collective the rank was seen to enter, by any source. Its
    #: history may have let that call go: it keeps calls as they came, and a late Flight Recorder
    #: read of older C++ collectives pushes out the newer Python calls before them.
    reached: dict[str, int] = field(default_factory=dict)
    #: per group: (last raw seq of a monitored_barrier this rank numbered unevenly, the total to
    #: take off torch's seqs after it), oldest first (see ``JobState._shift_after``)
    seq_shifts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    #: per group: where its collectives stand on the device (NCCL), read by the node agent from
    #: the rank's Flight Recorder ring (times on the coordinator's clock), and when the latest
    #: arrived (coordinator time). While it is fresh, a collective on the group is open from its
    #: enqueue to its completion, not to the host thread's return (``JobState.awaits_completion``)
    progress: dict[str, r.GroupProgress] = field(default_factory=dict)
    progress_seen: float = 0.0
    #: per group, oldest first: calls of runs its host returned from that its device has not
    #: been seen to complete (``OnDevice``), while its progress is watched
    on_device: dict[str, collections.deque[OnDevice]] = field(default_factory=dict)
    #: bytes charged to this rank (``budget``): its own tables (per-group tables, open-call
    #: entries, markers, device progress, the groups it announced), and its calls wherever the
    #: job holds them (each charged once, ``CallRecord.holds``; a call of an earlier process of
    #: the rank still in a slot is the job's)
    held: int = 0
    calls: int = 0
    #: the bytes of ``last_call`` while no table holds it any more (it alone keeps it alive)
    last_kept: int = 0
    table_bytes: int = 0  # its session's signature table (the coordinator's decoder), as charged

    @property
    def rank(self) -> int:
        return self.identity.rank

    def observe_clock(self, arrival: float, sent_time: float, held_s: float = 0.0, mono_time: float = 0.0) -> float:
        """Estimate the rank's clock offset from a batch sent at ``sent_time`` (rank clock) that
        arrived at ``arrival`` (coordinator clock) after ``held_s`` in a relay. Each sample is the
        true offset plus the batch's transit and queueing delay, so the estimate is the smallest
        recent sample: a batch that waited in a busy coordinator's queue does not shift the
        rank's times (which would make it look like a straggler).

        A step of the rank's wall clock is seen exactly where the batch carries the sender's
        monotonic clock (``mono_time``): ``sent_time - mono_time`` moves by the step, and the
        estimate starts afresh. Without it, only a sample ``CLOCK_STEP_S`` from the estimate is
        taken for a step, or ``CLOCK_BACK_BATCHES`` in a row ``CLOCK_BACK_S`` above it for a step
        back. Returns the offset to map this batch's events with: the larger of the
        old and new estimates across a step, since its events may have been stamped on either
        side of it, and a time mapped too late only delays a judgement where one mapped too
        early makes a wait look longer than it is."""
        sample = arrival - sent_time - max(0.0, held_s)
        before = self.clock_offset
        stepped = bool(self.offset_samples) and abs(sample - before) > CLOCK_STEP_S
        if mono_time:
            skew = sent_time - mono_time
            if self.wall_skew is not None and abs(skew - self.wall_skew) > CLOCK_JUMP_S:
                stepped = bool(self.offset_samples)
            self.wall_skew = skew
        elif self.offset_samples and sample > before + CLOCK_BACK_S and not stepped:
            # its clock went back, or the batch is late: mapped by its own sample, the latest
            # its events can have happened, until enough such batches say which
            self.late_samples += 1
            if self.late_samples < CLOCK_BACK_BATCHES:
                self.offset_samples.append(sample)
                return sample
            stepped = True
        else:
            self.late_samples = 0
        if stepped:
            self.late_samples = 0
        if stepped:
            self.offset_samples.clear()  # the rank's clock was stepped (or set): start afresh
            self.clock_steps += 1
        self.offset_samples.append(sample)
        self.clock_offset = min(self.offset_samples)
        return max(before, self.clock_offset) if stepped else self.clock_offset

    def to_local(self, rank_time: float) -> float:
        return rank_time + self.clock_offset

    @property
    def alive(self) -> bool:
        if self.end is not None and self.end.kind in (r.EndKind.EXCEPTION, r.EndKind.SIGNAL):
            return False
        return not (self.proc is not None and self.proc.state in (r.ProcState.DEAD, r.ProcState.ZOMBIE))

    def target(self) -> r.Target:
        ident = self.identity
        return r.Target(ident.rank, ident.pid, ident.start_time, ident.pid_namespace, r.link_tag(ident.session))

    def history_calls_after(self, since: float) -> list[r.CallRecord]:
        """Recent calls (all groups) entered at or after ``since`` (coordinator time)."""
        return [c for hist in self.history.values() for c in hist if c.enter_time >= since]

    def oldest_open(self) -> r.CallRecord | None:
        best: r.CallRecord | None = None
        for call in self.open_calls.values():
            if best is None or call.enter_time < best.enter_time:
                best = call
        return best


@dataclass(eq=False, slots=True)
class OnDevice:
    """Calls of a run (``records.CallRun``) from its ``start``-th on: the rank's host returned
    from them and its device (NCCL) has not been seen to complete them. Taken with the run as
    passed (no call, no slot each: ``JobState._run``) where call by call each would be an open
    call in a slot until a progress read completed it; made so (``JobState._open_on_device``)
    only where the device stops moving on one of them, or a slot is made at its seq. ``cost``:
    the bytes charged to the rank for it."""

    run: r.CallRun
    start: int
    cost: int

    @property
    def first_seq(self) -> int:
        """The seq of the first call the device has not been seen to complete."""
        return self.run.first_seq + self.start


@dataclass
class Slot:
    """The calls ranks made at one (group, seq)."""

    group: str
    seq: int
    calls: dict[int, r.CallRecord] = field(default_factory=dict)
    first_enter: float = 0.0  # coordinator time
    last_enter: float = 0.0
    open: int = 0  # calls in this slot not yet exited (kept in step by JobState)
    #: Every call so far is unrooted, extra-free and of the first one's signature (``sig``): then
    #: a new call of that signature cannot create a mismatch the last full check did not see
    #: (see detectors/mismatch.py).
    uniform: bool = True
    #: not pruned before the engine's next tick (``JobState.take_changes`` lets it go): made
    #: from runs for the detectors to look at (``JobState._materialize``), or holding calls that
    #: differ (a mismatch every rank returned from is still told)
    pinned: bool = False
    #: the first call's signature, and whether a later call's differs from it
    sig: tuple[object, ...] | None = None
    differs: bool = False
    #: the numbering of its group its calls are of (``JobState._renumbered``: 0 until a rank's
    #: numbering starts again)
    numbering: int = 0

    def add(self, call: r.CallRecord) -> None:
        prev = self.calls.get(call.rank)
        if prev is not None and prev.exit_time is None:
            self.open -= 1
        self.calls[call.rank] = call
        if call.exit_time is None:
            self.open += 1
        sig = (call.op, call.inputs, call.outputs, call.reduce_op, call.root, call.async_op, call.extra)
        first = self.sig
        if first is None:
            self.sig = first = sig
        elif not self.differs and sig != first:
            self.differs = True
        if self.uniform and (call.root is not None or call.extra or self.differs):
            self.uniform = False

    def remove(self, rank: int) -> None:
        call = self.calls.pop(rank, None)
        if call is not None and call.exit_time is None:
            self.open -= 1


@dataclass
class Changes:
    """What changed since the engine's last tick (``JobState.take_changes``): the detectors
    recompute what depends on these only (see detectors/mismatch.py, p2p.py)."""

    slots: set[tuple[str, int]] = field(default_factory=set)  # (group, seq) slots a call entered
    groups: bool = False  # a rank created or destroyed a group
    p2p: bool = False  # a p2p call arrived


@dataclass
class IngestResult:
    """What ``JobState.ingest`` did with a batch."""

    applied: int = 0  # events applied (a run of alike calls counts its calls)
    failed: int = 0  # events that raised (a bug or a hostile event): skipped, the rest applied
    error: Exception | None = None  # the first of them
