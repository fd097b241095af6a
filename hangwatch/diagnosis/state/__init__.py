"""What the coordinator knows about a job: its ranks, their open calls, and calls aligned by slot.

Pure bookkeeping on typed records (no gRPC, no protobuf, no threads, no findings): every change
to a job goes through this module. ``JobState.ingest`` applies one rank's batch (the daemon calls
it under the coordinator's lock after decoding the protobuf; the load generator and the flood
tests call the same function), ``JobState.register`` a (re)registration, and
``JobState.take_changes`` hands the engine what changed since its last tick. Detectors read this
state and never write it. Memory is bounded by windows: per rank a short history per group, and
slots are pruned once every member has left them.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
import uuid
from collections.abc import Sequence

from hangwatch import records as r
from hangwatch import wire
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.lag import Heard, Lag
from hangwatch.diagnosis.state.arena import Arena
from hangwatch.diagnosis.state.arrivals import Arrivals
from hangwatch.diagnosis.state.base import (
    ARRIVALS_KEPT,
    CLAIM_SILENT_S,
    CONFLICTS_KEPT,
    DURATIONS_KEPT,
    HISTORY_PER_GROUP,
    MAX_GROUPS,
    MAX_OPEN_CALLS,
    MAX_REORDER,
    MAX_SLOTS_PER_GROUP,
    NEW_NUMBERING_SEQS,
    ON_DEVICE_RUNS,
    PRUNE_RUNS_EVERY,
    SILENT_GONE_S,
    WORLD,
    ClaimRefused,
    _RunRef,
)
from hangwatch.diagnosis.state.calls import Calls
from hangwatch.diagnosis.state.device import Device
from hangwatch.diagnosis.state.groups import Groups
from hangwatch.diagnosis.state.joining import Joiner, Joining
from hangwatch.diagnosis.state.ranks import (
    CLOCK_JUMP_S,
    CLOCK_STEP_S,
    OFFSET_SAMPLES,
    PROGRESS_FRESH_S,
    Changes,
    IngestResult,
    OnDevice,
    RankState,
    Slot,
)
from hangwatch.diagnosis.state.registry import Registry
from hangwatch.diagnosis.state.runs import Runs

__all__ = [
    "ARRIVALS_KEPT",
    "CLAIM_SILENT_S",
    "CLOCK_JUMP_S",
    "CLOCK_STEP_S",
    "CONFLICTS_KEPT",
    "DURATIONS_KEPT",
    "HISTORY_PER_GROUP",
    "MAX_GROUPS",
    "MAX_OPEN_CALLS",
    "MAX_REORDER",
    "MAX_SLOTS_PER_GROUP",
    "NEW_NUMBERING_SEQS",
    "OFFSET_SAMPLES",
    "ON_DEVICE_RUNS",
    "PROGRESS_FRESH_S",
    "PRUNE_RUNS_EVERY",
    "SILENT_GONE_S",
    "WORLD",
    "Changes",
    "ClaimRefused",
    "IngestResult",
    "JobState",
    "Joiner",
    "OnDevice",
    "RankState",
    "Slot",
]

#: Events that change a rank's trace (a DDP forward pass is a marker: counted too, harmlessly).
_TRACED = frozenset((r.CallRecord, r.CallRun, r.MarkerEvent))


class JobState(Registry, Joining, Arena, Calls, Device, Runs, Arrivals, Groups):
    """A job's state: each concern its own class (``state/<concern>.py``), this the facade: a
    batch applied (``ingest``, ``apply``), what changed handed to the engine (``take_changes``),
    and what the detectors ask of the job (``members``, its rhythm)."""

    def __init__(self, ledger: b.Ledger | None = None, lag: Lag | None = None) -> None:
        #: the coordinator's account of memory held, against its budgets (``budget``)
        self.ledger = ledger or b.Ledger()
        self.lag = lag or Lag()  # how far behind the coordinator runs (shared by its jobs)
        self.heard = Heard()  # how late this job's ranks are heard, wherever the delay arises
        self.held = 0  # bytes this incarnation's tables hold (its ranks' included)
        self.refused = 0  # calls and groups refused for a memory budget
        self.refused_wide = 0  # of which for the job's or the coordinator's, not one rank's
        #: this incarnation of the job: a fresh id each time it runs (a rerun, a restart by the launcher, the
        #: coordinator restarted), so one run's incidents are never taken for another's
        self.incarnation = uuid.uuid4().hex[:8]
        self.incarnations = 1  # incarnations of the job this coordinator has seen
        self.launch = ""  # the run's rendezvous endpoint, from its first rank
        self.attempt = 0  # the launcher's restart count of this incarnation
        self.job_id = ""
        self.world_size = 0
        #: made from Flight Recorder dumps (``hangwatch analyze``): a rank with no dump is unknown,
        #: not one that never registered
        self.from_dumps = False
        self.ranks: dict[int, RankState] = {}
        self.joining: dict[int, Joiner] = {}  # processes started as ranks, not joined yet
        self.sessions: dict[str, int] = {}  # session id -> rank
        self.groups: dict[str, r.GroupInfo] = {}  # canonical (first seen) membership per group name
        self.slots: dict[str, collections.OrderedDict[int, Slot]] = {}
        self.p2p_open: dict[tuple[int, int], r.CallRecord] = {}  # (rank, call_id) -> open p2p call
        self.wait_durations: collections.deque[float] = collections.deque(maxlen=DURATIONS_KEPT)
        self.records_received = 0
        self.duplicates = 0  # records received again (see RankState.entry_seqs)
        self.started = time.time()
        # the change feed, drained by the engine once per tick (take_changes)
        self.changed_slots: set[tuple[str, int]] = set()
        self.groups_changed = False
        self.p2p_changed = False
        self.aborted_at: float | None = None
        self.dropped_calls = 0  # calls and group announcements refused because they would exceed MAX_GROUPS
        # per group, for complete slots: (last rank to arrive, its lag behind the median, seq, time),
        # read through ``arrivals``; and the seqs that runs completed, counted when it is read
        self._arrivals: dict[str, collections.deque[tuple[int, float, int, float]]] = {}
        self._arrivals_due: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._pruned_to: dict[str, int] = {}  # per group, the lowest passed seq runs were let go below
        self.group_owner: dict[str, int] = {}  # group -> the rank whose announcement made it
        self._world: tuple[int, ...] = ()
        #: claims refused or overridden (a second process for a held rank, another world size, an
        #: older attempt): what ``status`` shows of them, newest last
        self.conflicts: collections.deque[dict[str, object]] = collections.deque(maxlen=CONFLICTS_KEPT)
        # Runs of alike calls (``records.CallRun``, see ``_run``): per group and rank, the runs
        # holding seqs no slot was made for (a slot made at one later takes the rank's call from
        # it); per group, the highest seq each rank passed in order, the lowest of those over the
        # members (how many stand at each seq: ``passed_counts``); and what the first run through each range of
        # seqs was ([lo, hi, key], oldest first), which the others' runs are compared with
        self.passed: dict[str, dict[int, collections.deque[r.CallRun]]] = {}
        #: per group, where the runs of ``passed`` end and whose they are, in the order they
        #: were kept: ``_prune_runs`` lets go of them oldest first, without a walk of every
        #: member's runs
        self.kept_order: dict[str, collections.deque[tuple[int, int]]] = {}
        self.passed_to: dict[str, dict[int, int]] = {}
        self.passed_low: dict[str, int] = {}
        #: per group, how many members stand at each seq they passed (``Runs._advance``): for
        #: the members it was counted over, and those as a set
        self.passed_counts: dict[str, tuple[tuple[int, ...], frozenset[int], dict[int, int]]] = {}
        self.run_refs: dict[str, collections.deque[_RunRef]] = {}
        #: Numberings (``_renumbered``): per group, how many times each rank made it anew (its
        #: process group destroyed and created again in the same process, an in-process
        #: restart: seqs from 1 again), and the newest over its ranks. A rank behind, still
        #: sending the numbering before: its runs are not kept or compared, its calls share no
        #: slot with the newer numbering's and prune nothing, until it says it made the group
        #: anew too. Per group and rank, the creation index of the group it last said it created
        #: (``records.GroupInfo.index``: a rank's hook numbers every group it learns, so a group
        #: made anew has a higher one, and one told again the same)
        self.numbering: dict[str, dict[int, int]] = {}
        self.epoch: dict[str, int] = {}
        self.created_index: dict[str, dict[int, int]] = {}
        #: per group and rank, the makings it told of whose calls have not come yet: the first
        #: of its calls numbered below its last starts the newest (``_made_anew``). Not at the
        #: event itself: a batch on the wire carries its group creations before its calls
        #: (``signatures.CallDecoder.decode``), the last calls of the making before included
        self.anew: dict[str, dict[int, int]] = {}
        self.pinned: list[Slot] = []  # slots made from runs, kept until the engine's next tick
        #: inside ``_run``'s loop: a call it applies whole does not move the rank's passed seq
        #: (the run does, once kept: its seqs before that call are not in ``passed`` yet)
        self._in_run = False
        self.runs_taken = 0  # runs taken whole, and the calls in them
        self.run_calls = 0
        self.cycle_calls = 0  # of them, in runs of a cycle of signatures
        self.device_calls = 0  # of them, on the device still as they came (NCCL: ``OnDevice``)
        self.device_opened = 0  # of those, made open calls where the device stopped at them

    def ingest(
        self,
        session: str,
        rank: int,
        events: Sequence[r.RankEvent],
        *,
        now: float,
        sent_time: float = 0.0,
        alive_time: float = 0.0,
        held_s: float = 0.0,
        mono_time: float = 0.0,
        relay: str = "",
        queued: int = 0,
        dropped: int = 0,
        where: str = "",
        where_user: str = "",
        where_stack: tuple[str, ...] = (),
        budget_note: str = "",
        flight_time: float = 0.0,
        flight_unseen: tuple[str, ...] = (),
        unread: bool = False,
    ) -> IngestResult | None:
        """Apply one batch of ``rank``'s session ``session`` that arrived at ``now``.

        ``sent_time`` (rank clock; 0: unknown) and ``held_s`` (seconds a relay held it) feed the
        rank's clock offset; ``flight_time`` (the clock of ``sent_time``; 0: none) is when the
        latest Flight Recorder read of the rank whose records have all come was asked, and
        ``flight_unseen`` the groups its agent found it inside an op of that no read showed;
        ``alive_time`` (rank clock; 0: the rank sent it) bounds what the batch proves the rank
        had not done (a node agent reads a frozen rank's ring too); the rest of the header
        (``relay``, ``queued``, ``dropped``, ``where``, ``where_user``) is recorded as the
        rank's latest word. An ``unread`` batch (a node agent did not read the rank's ring for
        it) says only that the rank is alive, and where: it proves nothing of its calls or its
        Flight Recorder. Events of another rank
        are ignored; an event that raises is counted and skipped, so one bad event does not block
        the rank's stream. Returns None when the session is not the rank's registered one (it
        must register again)."""
        state = self.rank_for_session(session)
        if state is None or state.rank != rank:
            return None
        state.last_seen = now
        state.relay = relay
        settled_offset = None
        if sent_time:
            batch_offset = state.observe_clock(now, sent_time, held_s, mono_time)
            # what the batch proves the rank had not done yet holds up to when the rank itself was
            # last seen alive: a node agent reads a frozen rank's ring as well as a live one's
            # (stamped as it left: on the rank's clock as it is now, whatever it was before)
            proven = min(sent_time, alive_time) if alive_time else sent_time
            if unread:
                state.heard_to = max(state.heard_to, proven + state.clock_offset)
            else:
                state.last_sent = max(state.last_sent, proven + state.clock_offset)
            if batch_offset != state.clock_offset:
                settled_offset, state.clock_offset = state.clock_offset, batch_offset  # for this batch
        if flight_time and not unread:
            state.flight_to = max(state.flight_to, flight_time + state.clock_offset)
        # only a node agent reads the rings, and only a rank it registered is proven: a rank's own
        # word that it is inside a collective (which spares it blame) is not believed
        if not unread:
            state.unseen = flight_unseen if state.proven else ()
        state.queued = queued
        state.dropped = dropped
        state.where = where
        state.where_user = where_user
        state.where_stack = where_stack
        if not unread:
            state.budget_note = budget_note  # (of its Flight Recorder's reads)
        result = IngestResult()
        for event in events:
            if event.rank != rank:
                continue
            try:
                self.apply(state, event, now)
                result.applied += _counted(event)
            except Exception as exc:  # a bug or a hostile event must not block this rank's stream
                result.failed += 1
                if result.error is None:
                    result.error = exc
        if settled_offset is not None:
            state.clock_offset = settled_offset
        return result

    def behind(self, now: float) -> float:
        """Seconds of silence that are the coordinator's or its transport's, not any rank's: the
        larger of its own queue (``Lag``) and how late this job's ranks are heard (``Heard``)."""
        live = self.ranks.values
        heard = self.heard.late(
            now, lambda: (max(st.last_sent, st.heard_to) for st in live() if st.end is None and st.alive)
        )
        return max(self.lag.behind(now), heard)

    def take_changes(self) -> Changes:
        """What changed since the last call (the engine calls it once per tick), and forget it."""
        for slot in self.pinned:
            slot.pinned = False  # the detectors look at it in this tick: prunable after it
        self.pinned = []
        changes = Changes(self.changed_slots, self.groups_changed, self.p2p_changed)
        self.changed_slots = set()
        self.groups_changed = self.p2p_changed = False
        return changes

    def apply(self, state: RankState, event: r.RankEvent, now: float) -> None:
        if state.end is not None and state.end.kind is r.EndKind.DESTROYED and _active(event, state.end.time):
            state.end = None  # destroy_process_group(), then init_process_group() again: it goes on
        if type(event) in _TRACED:
            state.traced += 1
        if isinstance(event, r.CallRecord):
            run = self._continues_run(state, event)
            if run is not None:
                self._run(state, run, now)  # a run cut short by the edge of a batch
            else:
                self._enter(state, event, now)
        elif isinstance(event, r.CallRun):
            self._run(state, event, now)
        elif isinstance(event, r.CallExit):
            self._exit(state, event, now)
        elif isinstance(event, r.StepEvent):
            _stepped(state, event.step, event.time)
            state.last_progress = now
        elif isinstance(event, r.Steps):
            for step, t in zip(event.steps, event.times, strict=True):
                _stepped(state, step, t)
            state.last_progress = now
        elif isinstance(event, r.GroupEvent):
            self._group_event(state, event)
        elif isinstance(event, r.RankEnd):
            state.end = event
            state.step = max(state.step, event.step)
        elif isinstance(event, r.MarkerEvent):
            if event.name == r.DDP_FORWARD:
                group, _, seq = event.detail.rpartition(":")
                if group and seq.isdigit() and len(group) <= wire.MAX_NAME and self._room(state, b.FORWARD_BYTES):
                    state.forward_count += 1
                    freed = b.FORWARD_BYTES if len(state.forwards) == state.forwards.maxlen else 0
                    state.forwards.append((state.forward_count, group, int(seq), event.step))
                    self._charge(state, b.FORWARD_BYTES - freed)
            else:
                cost = b.marker_bytes(event)
                if self._room(state, cost):
                    freed = b.marker_bytes(state.markers[0]) if len(state.markers) == state.markers.maxlen else 0
                    state.markers.append(event)
                    self._charge(state, cost - freed)
            state.last_progress = now
        elif isinstance(event, r.GroupProgress):
            self._progress(state, event, now)

    def members(self, group: str) -> tuple[int, ...]:
        info = self.groups.get(group)
        if info is not None and info.ranks:
            return info.ranks
        if group == "0" and self.world_size:
            if len(self._world) != self.world_size:
                self._world = tuple(range(self.world_size))
            return self._world
        return ()

    def median_step_time(self) -> float | None:
        gaps: list[float] = []
        for state in self.ranks.values():
            times = list(state.step_times)
            gaps.extend(b - a for a, b in itertools.pairwise(times))
        return statistics.median(gaps) if gaps else None

    def wait_quantile(self, q: float) -> float | None:
        if len(self.wait_durations) < 8:
            return None
        data = sorted(self.wait_durations)
        return data[min(len(data) - 1, int(q * len(data)))]


def _counted(event: r.RankEvent) -> int:
    """The events ``event`` counts for: a run, its calls; steps, each."""
    kind = type(event)
    if kind is r.CallRun:
        return len(event.enters)  # type: ignore[union-attr]
    return len(event.steps) if kind is r.Steps else 1  # type: ignore[union-attr]


def _stepped(state: RankState, step: int, t: float) -> None:
    """``state``'s rank began ``step`` at ``t`` (its clock): timed once a step (not by
    ``state.step``: a batch's calls come before its steps, and a step's first calls have moved
    the rank to it already)."""
    if step != state.timed_step:
        state.step_times.append(state.to_local(t))
        state.timed_step = step
    state.step = step


def _active(event: r.RankEvent, since: float) -> bool:
    """An event of a process group made after ``since`` (rank clock): a Python call or a step, or
    a group created. (A Flight Recorder read after the rank's end still ships calls made before
    it: those are no sign of a new process group.)"""
    if isinstance(event, r.CallRecord):
        return event.source == "python" and event.enter_time > since
    if isinstance(event, r.CallRun):
        return bool(event.enters) and event.enters[-1] > since
    if isinstance(event, r.StepEvent):
        return event.time > since
    if isinstance(event, r.Steps):
        return any(t > since for t in event.times)
    return isinstance(event, r.GroupEvent) and event.kind is r.GroupEventKind.CREATED and event.time > since
