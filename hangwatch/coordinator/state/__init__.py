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

import bisect
import collections
import dataclasses
import itertools
import operator
import statistics
import time
import uuid
from collections.abc import Callable, Sequence

from hangwatch import catalogue, wire
from hangwatch import records as r
from hangwatch.coordinator import budget as b
from hangwatch.coordinator.rules.collective import compare_collective
from hangwatch.coordinator.state.history import History, RunSlice
from hangwatch.coordinator.state.ranks import (
    CLOCK_JUMP_S,
    CLOCK_STEP_S,
    OFFSET_SAMPLES,
    PROGRESS_FRESH_S,
    SEQ_SHIFTS_KEPT,
    UNEVEN_SEQS_ELSEWHERE,
    Changes,
    IngestResult,
    OnDevice,
    RankState,
    Slot,
    _shift_at,
)
from hangwatch.flight_entries import ENTRY_CALL_IDS

__all__ = [
    "CLOCK_JUMP_S",
    "CLOCK_STEP_S",
    "OFFSET_SAMPLES",
    "PROGRESS_FRESH_S",
    "SILENT_GONE_S",
    "Changes",
    "ClaimRefused",
    "IngestResult",
    "JobState",
    "RankState",
    "Slot",
]

HISTORY_PER_GROUP = 64
MAX_SLOTS_PER_GROUP = 4096
#: Slots a new slot is put below to keep seq order (``_new_slot``); past this many (a rank
#: thousands of seqs behind), it stays last, and the cap on slots bounds what that costs.
MAX_REORDER = 256
MAX_OPEN_CALLS = 4096  # per rank
#: Process groups tracked per job; calls on groups beyond this are counted and dropped (a job with
#: more real groups than this is not one a single coordinator can diagnose anyway).
MAX_GROUPS = 16384
#: The world group: never refused for the cap (a flood of other groups must not blind it).
WORLD = "0"
DURATIONS_KEPT = 512
#: A rank is bound to its first registrant: another process claiming the rank is refused while
#: the first is alive and was heard from this recently (a rank's process restarted alone is
#: accepted once its predecessor is gone or silent).
CLAIM_SILENT_S = 5.0
CONFLICTS_KEPT = 32
#: A rank silent this long counts as gone (killed with no agent on its node to see it): its job
#: can end, and a new run of it begin. Longer than any hang hangwatch reports (torch's own NCCL
#: timeout is 10 minutes).
SILENT_GONE_S = 900.0


class ClaimRefused(ValueError):
    """A registration that contradicts what the job's run already holds (the message says why)."""


ARRIVALS_KEPT = 32
PRUNE_RUNS_EVERY = 16  # passed seqs between two walks of every member's runs (``_prune_runs``)
#: A group made anew numbers from 1 again: its first call comes at one of these first seqs (after
#: the few C++ issued first, DDP's broadcast of the module's state), below the rank's last
NEW_NUMBERING_SEQS = 64
#: Runs a rank may have on its device at once per group (``OnDevice``); past them its runs go
#: call by call, each call open until its completion, as without runs
ON_DEVICE_RUNS = 64


#: Events that change a rank's trace (a DDP forward pass is a marker: counted too, harmlessly).
_TRACED = frozenset((r.CallRecord, r.CallRun, r.MarkerEvent))


def _same_process(claimed: r.RankIdentity, proven: r.RankIdentity) -> bool:
    """Whether a claim names the process an agent proved (a pid seen from inside a container
    differs from the agent's, so there only the host and start time are compared)."""
    pid_ok = claimed.pid == proven.pid or bool(claimed.pid_namespace)
    return claimed.host == proven.host and pid_ok and abs(claimed.start_time - proven.start_time) <= 1.0


class JobState:
    def __init__(self, ledger: b.Ledger | None = None) -> None:
        #: the coordinator's account of memory held, against its budgets (``budget``)
        self.ledger = ledger or b.Ledger()
        self.held = 0  # bytes this run's tables hold (its ranks' included)
        self.refused = 0  # calls and groups refused for a memory budget
        #: this run of the job: a fresh id for each run (a rerun, a restart by the launcher, the
        #: coordinator restarted), so one run's incidents are never taken for another's
        self.run = uuid.uuid4().hex[:8]
        self.runs = 1  # runs this coordinator has seen of the job
        self.launch = ""  # the run's rendezvous endpoint, from its first rank
        self.attempt = 0  # the launcher's restart count of this run
        self.job_id = ""
        self.world_size = 0
        #: made from Flight Recorder dumps (``hangwatch analyze``): a rank with no dump is unknown,
        #: not one that never registered
        self.from_dumps = False
        self.ranks: dict[int, RankState] = {}
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
        # members and how many ranks stand there; and what the first run through each range of
        # seqs was ([lo, hi, key], oldest first), which the others' runs are compared with
        self.passed: dict[str, dict[int, collections.deque[r.CallRun]]] = {}
        self.passed_to: dict[str, dict[int, int]] = {}
        self.passed_low: dict[str, tuple[int, int]] = {}
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
        self._faults: dict[int, tuple[r.CallRecord, int | None, bool]] = {}  # see ``_faulty``
        #: inside ``_run``'s loop: a call it applies whole does not move the rank's passed seq
        #: (the run does, once kept: its seqs before that call are not in ``passed`` yet)
        self._in_run = False
        self.runs_taken = 0  # runs taken whole, and the calls in them
        self.run_calls = 0
        self.cycle_calls = 0  # of them, in runs of a cycle of signatures
        self.device_calls = 0  # of them, on the device still as they came (NCCL: ``OnDevice``)
        self.device_opened = 0  # of those, made open calls where the device stopped at them

    # ---- registration ---------------------------------------------------------------------

    def _new_run(self, identity: r.RankIdentity, now: float, via: str) -> bool:
        """Whether ``identity`` starts a new run of the job: the launcher restarted it (a higher
        attempt), or every rank of the current run has ended. A run's state is never mixed with
        another's. (Another launch is another job: ``coordinator.jobs``.)"""
        if not self.ranks:
            return False
        if identity.attempt > self.attempt:
            proven = [st for st in self.ranks.values() if st.proven and st.end is None and st.alive]
            return via == "agent" or not proven  # an unproven claim never ends a run of proven ranks
        live = [st for st in self.ranks.values() if st.end is None and st.alive and now - st.last_seen <= SILENT_GONE_S]
        previous = self.ranks.get(identity.rank)
        if previous is None or previous.identity.session == identity.session:
            return False  # a rank of this run registering at its own pace (the others may be done)
        return not live  # a rank number of a run that is over, in a new process: the next run

    def _shaped_by_claims(self, identity: r.RankIdentity) -> bool:
        """Whether only unproven claims made this job's shape (world size, attempt, launch) and
        ``identity`` contradicts it."""
        if not self.ranks or any(st.proven for st in self.ranks.values()):
            return False
        return (identity.world_size, identity.attempt, identity.launch) != (
            self.world_size or identity.world_size,
            self.attempt,
            self.launch,
        )

    def register(self, identity: r.RankIdentity, now: float, via: str = "direct") -> RankState:
        # a proven rank is never refused for what unproven claims alone said of the job
        set_aside = len(self.ranks) if via == "agent" and self._shaped_by_claims(identity) else 0
        if set_aside or self._new_run(identity, now, via):
            runs, ledger = self.runs + 1, self.ledger
            ledger.held -= self.held
            self.__init__(ledger)  # type: ignore[misc]  # a clean slate: nothing of the last run is kept
            self.runs = runs
        if set_aside:
            self._conflict(
                identity, now, via, f"set aside {set_aside} unproven claim(s) that shaped this job otherwise"
            )
        if not self.ranks:
            self.launch, self.attempt = identity.launch, identity.attempt
        previous = self.ranks.get(identity.rank)
        if previous is not None and previous.identity.session == identity.session:
            # the same session, whichever path ships it: only its holder knows it. A rank is
            # proven by the link its agent registers, and is then the process of that link,
            # whatever an earlier registration under the session named.
            previous.last_seen = now
            previous.via = via
            if via == "agent":
                if not previous.proven and not _same_process(previous.identity, identity):
                    self._conflict(
                        identity, now, via, f"proved pid {identity.pid}, not pid {previous.identity.pid} it claimed"
                    )
                previous.identity = identity
                previous.proven = True
            return previous
        self._check_claim(identity, previous, now, via)
        if not self._room(None, b.RANK_BYTES - (previous.held if previous is not None else 0)):
            self._conflict(identity, now, via, "refused: the coordinator's memory budget is spent")
            raise ClaimRefused(f"rank {identity.rank}: no room left in the coordinator's memory budget")
        if previous is not None:
            self._forget_session(previous)
        state = RankState(
            identity=identity, registered_at=now, last_seen=now, last_progress=now, via=via, proven=via == "agent"
        )
        self._charge(state, b.RANK_BYTES)
        self.ranks[identity.rank] = state
        self.sessions[identity.session] = identity.rank
        self.job_id = identity.job_id or self.job_id
        self.world_size = self.world_size or identity.world_size  # the launch's, as its first rank said
        return state

    def _check_claim(self, identity: r.RankIdentity, previous: RankState | None, now: float, via: str) -> None:
        """Refuse (``ClaimRefused``) a registration that contradicts the run: another world size,
        an older attempt, or a second process for a rank whose first is alive and heard from. A
        process an agent proved (``via="agent"``) takes the rank from an unproven claim."""
        why = ""
        if self.world_size and identity.world_size != self.world_size:
            why = f"claims world size {identity.world_size}, but this run's ranks have {self.world_size}"
        elif identity.attempt != self.attempt:  # older, or newer and unproven beside proven ranks
            why = f"is of attempt {identity.attempt}, but this run is attempt {self.attempt}"
        elif previous is not None:
            same = (previous.identity.host, previous.identity.pid, previous.identity.start_time) == (
                identity.host,
                identity.pid,
                identity.start_time,
            )  # the same process, a new session (it initialised its process group again)
            live = previous.end is None and previous.alive and now - previous.last_seen < CLAIM_SILENT_S
            held = live and not same
            holder = f"pid {previous.identity.pid} on {previous.identity.host} ({previous.via})"
            if held and via == "agent" and not previous.proven:
                self._conflict(identity, now, via, f"took rank {identity.rank} from an unproven claim by {holder}")
                return
            if live and previous.proven and via != "agent":
                why = f"claims rank {identity.rank}, held by {holder}, which its node's agent proved"
            elif held:
                why = f"claims rank {identity.rank}, held by {holder}"
        if why:
            self._conflict(identity, now, via, f"refused: {why}")
            raise ClaimRefused(f"rank {identity.rank} (pid {identity.pid} on {identity.host}) {why}")

    def _conflict(self, identity: r.RankIdentity, now: float, via: str, what: str) -> None:
        self.conflicts.append(
            {"time": now, "rank": identity.rank, "pid": identity.pid, "host": identity.host, "via": via, "what": what}
        )

    def _forget_session(self, previous: RankState) -> None:
        """A rank registers again with a new session (its process restarted): the old session's
        open calls leave their slots and the p2p pairing. (Its completed calls stay; slots the
        old numbering left behind are pruned as stale, see ``_prune``.)"""
        self.sessions.pop(previous.identity.session, None)
        for call in previous.open_calls.values():
            self._unslot(call)
            self.p2p_open.pop((previous.rank, call.call_id), None)
        # its tables go with it: their calls are let go (those still in slots stay charged), then
        # what is charged to it alone (per-group tables, markers...)
        for call in previous.open_calls.values():
            self._unhold(previous, call)
        for hist in previous.history.values():
            self._evict(previous, hist, len(hist))
        if previous.last_kept:
            self._release_kept(previous)
        self._charge(None, -previous.held)  # its own tables, exactly (what calls it left in slots stay the job's)
        previous.held = 0

    def rank_for_session(self, session: str) -> RankState | None:
        rank = self.sessions.get(session)
        return None if rank is None else self.ranks.get(rank)

    # ---- batches ---------------------------------------------------------------------------

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
    ) -> IngestResult | None:
        """Apply one batch of ``rank``'s session ``session`` that arrived at ``now``.

        ``sent_time`` (rank clock; 0: unknown) and ``held_s`` (seconds a relay held it) feed the
        rank's clock offset; ``flight_time`` (the clock of ``sent_time``; 0: none) is when the
        latest Flight Recorder read of the rank whose records have all come was asked, and
        ``flight_unseen`` the groups its agent found it inside an op of that no read showed;
        ``alive_time`` (rank clock; 0: the rank sent it) bounds what the batch proves the rank
        had not done (a node agent reads a frozen rank's ring too); the rest of the header
        (``relay``, ``queued``, ``dropped``, ``where``, ``where_user``) is recorded as the
        rank's latest word. Events of another rank
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
            state.last_sent = max(state.last_sent, proven + state.clock_offset)
            if batch_offset != state.clock_offset:
                settled_offset, state.clock_offset = state.clock_offset, batch_offset  # for this batch
        if flight_time:
            state.flight_to = max(state.flight_to, flight_time + state.clock_offset)
        # only a node agent reads the rings, and only a rank it registered is proven: a rank's own
        # word that it is inside a collective (which spares it blame) is not believed
        state.unseen = flight_unseen if state.proven else ()
        state.queued = queued
        state.dropped = dropped
        state.where = where
        state.where_user = where_user
        state.where_stack = where_stack
        state.budget_note = budget_note
        result = IngestResult()
        for event in events:
            if event.rank != rank:
                continue
            try:
                self.apply(state, event, now)
                result.applied += len(event.enters) if type(event) is r.CallRun else 1  # a run: its calls
            except Exception as exc:  # a bug or a hostile event must not block this rank's stream
                result.failed += 1
                if result.error is None:
                    result.error = exc
        if settled_offset is not None:
            state.clock_offset = settled_offset
        return result

    def take_changes(self) -> Changes:
        """What changed since the last call (the engine calls it once per tick), and forget it."""
        for slot in self.pinned:
            slot.pinned = False  # the detectors look at it in this tick: prunable after it
        self.pinned = []
        changes = Changes(self.changed_slots, self.groups_changed, self.p2p_changed)
        self.changed_slots = set()
        self.groups_changed = self.p2p_changed = False
        return changes

    # ---- events ---------------------------------------------------------------------------

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
            if event.step != state.step:
                state.step_times.append(state.to_local(event.time))
            state.step = event.step
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

    def _continues_run(self, state: RankState, call: r.CallRecord) -> r.CallRun | None:
        """Where a completed call sent alone is the next call of the run its rank's previous call
        on its group came in (the seq after it, alike to the call the run, or its cycle, would
        have made there, call site included), that call as a run of one on the run's template;
        else None (it is entered as a call, with its slot). A read's edge that falls one call
        from the end of a run or a step cuts such a call off; at 1,024 ranks some rank does so
        at nearly every step, and a slot made there would have every other rank's run enter its
        call there whole (``_run_by_slots``). Made on the run's template, as the run's calls
        are, ``_faulty`` knows it. Calls that come alone as a rule (no two alike in a row) go on
        as calls."""
        done = call.exit_time
        hist = state.history.get(call.group) if done is not None else None
        run = hist.last_run() if hist is not None else None
        if run is None or done is None:
            return None
        n = len(run.enters)
        t = run.template_at(n)
        if (
            call.seq == run.first_seq + n
            and run.first_call_id + n <= call.call_id < ENTRY_CALL_IDS  # (calls on other groups between)
            and call.error is None
            and call.seq_count == 1
            and call.returned_time is None
            and _run_key(call) == _run_key(t)
            and (call.call_site, call.peer, call.source) == (t.call_site, t.peer, t.source)
        ):
            return r.CallRun(state.rank, t, call.call_id, call.seq, call.step, [call.enter_time], [done])
        return None

    def _group_event(self, state: RankState, event: r.GroupEvent) -> None:
        self.groups_changed = True
        info, name = event.group, event.group.name
        if event.kind is not r.GroupEventKind.CREATED:
            held = state.groups.pop(name, None)
            if held is not None and held is not self.groups.get(name):
                self._charge(state, -b.group_bytes(held))
            if name != "0" and not any(name in st.groups for st in self.ranks.values()):
                self._forget_group(name)  # every member destroyed it
            return
        canonical = self.groups.get(name)
        if canonical is None:
            if len(self.groups) >= MAX_GROUPS and name != WORLD:
                self.dropped_calls += 1
                return
            if not self._room(state, b.group_bytes(info) + b.JOB_GROUP_BYTES):
                return
            canonical = self.groups[name] = info
            # the job's, charged to the rank that made it (as its calls are: it may outlive it)
            self._charge(None, b.group_bytes(info) + b.JOB_GROUP_BYTES)
            state.calls += b.group_bytes(info) + b.JOB_GROUP_BYTES
            self.group_owner[name] = state.rank
        # (kept for groups the job holds: as many as ``state.groups``, and let go of with them)
        seen = self.created_index.setdefault(name, {})
        was = seen.get(state.rank)
        if was is None or info.index > was:
            # (a rank first heard of tells of one of the group's makings, not which: it may be
            # late, and of the one before the others' newest)
            seen[state.rank] = info.index
            if was is not None:  # made anew: its calls number from 1 again, from where they drop
                pending = self.anew.setdefault(name, {})
                pending[state.rank] = pending.get(state.rank, 0) + 1
        # one membership tuple per group, not one per rank (the world group is O(world) long)
        before = state.groups.get(name)
        if before is not None and before is not canonical:
            self._charge(state, -b.group_bytes(before))
        if canonical.ranks == info.ranks:
            state.groups[name] = canonical
        elif self._room(state, b.group_bytes(info)):
            state.groups[name] = info
            self._charge(state, b.group_bytes(info))
        else:
            state.groups.pop(name, None)

    def _forget_group(self, name: str) -> None:
        info = self.groups.pop(name, None)
        if info is not None:
            n = b.group_bytes(info) + b.JOB_GROUP_BYTES
            self._charge(None, -n)
            owner = self.ranks.get(self.group_owner.pop(name, -1))
            if owner is not None:
                owner.calls = owner.calls - n if owner.calls > n else 0
        for slot in (self.slots.pop(name, None) or {}).values():
            self._free_slot(slot)
        for runs in (self.passed.pop(name, None) or {}).values():
            for run in runs:
                self._drop_run(run)
        self.passed_to.pop(name, None)
        self.passed_low.pop(name, None)
        self.run_refs.pop(name, None)
        self.numbering.pop(name, None)
        self.epoch.pop(name, None)
        self.created_index.pop(name, None)
        self.anew.pop(name, None)
        self._arrivals.pop(name, None)
        self._arrivals_due.pop(name, None)
        self._pruned_to.pop(name, None)
        self.changed_slots = {key for key in self.changed_slots if key[0] != name}
        for st in self.ranks.values():
            hist = st.history.pop(name, None)
            if hist is not None:
                self._evict(st, hist, len(hist))
                self._charge(st, -b.RANK_GROUP_BYTES)
            shifts = st.seq_shifts.pop(name, None)
            if shifts:
                self._charge(st, -b.SHIFT_BYTES * len(shifts))

    # ---- memory budget ----------------------------------------------------------------------

    def _charge(self, state: RankState | None, n: int) -> None:
        """Account ``n`` bytes (negative: released) to ``state``, the job and the coordinator."""
        if state is not None:
            state.held += n
        self.held += n
        self.ledger.held += n

    def _unhold(self, state: RankState | None, call: r.CallRecord) -> None:
        """A table let go of ``call``: released when it was the last."""
        held = call.holds - 1
        call.holds = held
        if not held:
            self._unhold_last(state, call)

    def _unhold_last(self, state: RankState | None, call: r.CallRecord) -> None:
        """No table holds ``call`` any more: released, unless it is still its rank's latest call
        (``RankState.last_call``), which keeps it alive: then charged to the rank until a later
        call takes its place."""
        if state is None:
            state = self.ranks.get(call.rank)
        if state is not None and state.last_call is call:
            state.last_kept = call.cost
            return
        n = call.cost
        if state is not None:
            state.calls = state.calls - n if state.calls > n else 0
        self.held -= n
        self.ledger.held -= n

    def _release_kept(self, state: RankState) -> None:
        n = state.last_kept
        state.last_kept = 0
        state.calls = state.calls - n if state.calls > n else 0
        self.held -= n
        self.ledger.held -= n

    def _room(self, state: RankState | None, n: int) -> bool:
        """Whether ``n`` more bytes for ``state`` (None: a rank not yet made) fit its, the job's
        and the coordinator's budgets, its oldest history let go first if that makes room;
        counted when not."""
        ledger = self.ledger
        budget = ledger.budget
        mine = 0 if state is None else state.held + state.calls
        if mine + n <= budget.rank and self.held + n <= budget.job and ledger.held + n <= budget.total:
            return True
        if state is not None:
            self._trim(state, max(mine + n - budget.rank, self.held + n - budget.job, ledger.held + n - budget.total))
            mine = state.held + state.calls
        for which, excess in (
            ("rank", mine + n - budget.rank),
            ("job", self.held + n - budget.job),
            ("total", ledger.held + n - budget.total),
        ):
            if excess > 0:
                self.refused += 1
                ledger.refuse(which)
                return False
        return True

    def _trim(self, state: RankState, need: int) -> None:
        """Let go of ``state``'s oldest history records (the longest history first) until
        ``need`` bytes are freed or none is left: history only feeds the rules' explanations."""
        before = self.held
        while before - self.held < need:
            hist = max(state.history.values(), key=len, default=None)
            if not hist:
                break
            self._evict(state, hist, 1)
            self.ledger.trimmed += 1

    def _evict(self, state: RankState, hist: History, k: int) -> None:
        """Let go of the ``k`` oldest calls of ``hist``, one of ``state``'s histories."""
        records, loose = hist.drop_oldest(k)
        for call in records:  # inlined ``_unhold``
            call.holds -= 1
            if not call.holds:
                self._unhold_last(state, call)
        if loose:  # calls of a run never made whole: charged alike, and no other table holds them
            state.calls = state.calls - loose if state.calls > loose else 0
            self.held -= loose
            self.ledger.held -= loose

    def _free_slot(self, slot: Slot) -> None:
        # inlined ``_unhold``: every call passes here once its slot is pruned
        freed = b.SLOT_BYTES + b.SLOT_ENTRY_BYTES * len(slot.calls)
        ranks = self.ranks
        for call in slot.calls.values():
            held = call.holds - 1
            call.holds = held
            if not held:
                st = ranks.get(call.rank)
                if st is not None and st.last_call is call:
                    st.last_kept = call.cost  # still its rank's latest call: kept, and charged
                    continue
                n = call.cost
                freed += n
                if st is not None:
                    st.calls = st.calls - n if st.calls > n else 0
        self.held -= freed
        self.ledger.held -= freed

    def _enter(self, state: RankState, call: r.CallRecord, now: float) -> None:
        # the hot path of ingest (every call of every rank): locals, one kind lookup, no scans
        group, seq = call.group, call.seq
        slots = self.slots.get(group)
        hist = state.history.get(group)
        if hist is None and slots is None and len(state.history) >= MAX_GROUPS and group != WORLD:
            self.dropped_calls += 1
            return
        call_id = call.call_id
        resent = False
        if call_id < ENTRY_CALL_IDS:
            if call_id > state.last_call_id:
                state.last_call_id = call_id
                self.records_received += 1
            else:  # a batch sent again (its reply was lost): applied again, the same, counted once
                self.duplicates += 1
                resent = True
        elif seq <= state.entry_seqs.get(group, 0) and not (
            self.anew and hist is not None and self._made_anew(state, group, hist, seq, call_id)
        ):  # (a Flight Recorder record of a group made anew numbers from 1 again)
            self.duplicates += 1  # made again from the same entry (an agent took over the ring)
            return
        cost = call.cost = call.cost or b.call_bytes(call)  # decoded calls carry their signature's
        need = cost + (b.CALL_TABLES_BYTES if hist is not None else b.CALL_TABLES_BYTES + b.RANK_GROUP_BYTES)
        ledger = self.ledger
        limits = ledger.budget
        mine = state.held + state.calls + need
        over = mine > limits.rank or self.held + need > limits.job or ledger.held + need > limits.total
        if over and not self._room(state, need):
            return  # over a memory budget: dropped, and counted (``budget``)
        if call_id >= ENTRY_CALL_IDS:
            state.entry_seqs[group] = seq  # (one per group with a history: charged with it)
            self.records_received += 1
        # charged once, held while it is applied; each table that keeps it adds a hold
        call.holds = 1
        state.calls += cost
        self.held += cost
        ledger.held += cost
        try:
            shifts = state.seq_shifts.get(group) if state.seq_shifts else None
            if shifts and call.kind is not r.OpKind.P2P:
                seq = call.seq = seq - _shift_at(shifts, seq)  # torch's numbering, lined up again
            offset = state.clock_offset
            enter = call.enter_time = call.enter_time + offset
            done = call.exit_time is not None
            if done:
                call.exit_time += offset  # type: ignore[operator]
                if (
                    state.progress
                    and call.error is None
                    and self.awaits_completion(state, call, call.seq_count, call.exit_time, now)
                ):
                    call.returned_time, call.exit_time, done = call.exit_time, None, False
            last = state.last_call
            if last is None or enter >= last.enter_time:
                state.last_call = call  # Flight Recorder records may arrive after later Python calls
                if state.last_kept:  # the one before was kept alive by this reference alone
                    self._release_kept(state)
                if enter > state.last_sent:
                    state.last_sent = enter  # its batch left after it began
            state.last_progress = now
            if call.step > state.step:
                state.step = call.step
            if hist is None:
                if slots is None and len(self.slots) >= MAX_GROUPS and group != WORLD:
                    self.dropped_calls += 1
                    return
                hist = state.history[group] = History()
                self._charge(state, b.RANK_GROUP_BYTES)
            elif self.anew and call.kind is r.OpKind.COLLECTIVE:
                self._made_anew(state, group, hist, seq, call_id)
            oldest = hist.push(call, HISTORY_PER_GROUP)  # the oldest leaves (inlined ``_unhold``)
            if oldest is not None:
                oldest.holds -= 1
                if not oldest.holds:
                    self._unhold_last(state, oldest)
            elif len(hist) > HISTORY_PER_GROUP:  # its oldest stood in a run
                self._evict(state, hist, len(hist) - HISTORY_PER_GROUP)
            call.holds += 1
            open_calls = state.open_calls
            kind = call.kind
            if not done:
                before = open_calls.get(call_id)
                if before is not None and before is not call:  # its id again: the old call is replaced
                    del open_calls[call_id]
                    self._drop_open(state, before)
                    self._unslot(before)
                    self._charge(state, -b.OPEN_BYTES)
                    self._unhold(state, before)
            if kind is r.OpKind.COLLECTIVE:
                open_here = state.open_collectives.get(group)
                if open_here:
                    # Collectives on one group complete in order on a rank: older open ones are done
                    # (those the host returned from and the device has not completed are not).
                    for other in [c for c in open_here.values() if c.seq < seq and c.returned_time is None]:
                        self._close(state, other, enter, None)
                if not done:
                    if open_here is None:
                        open_here = state.open_collectives[group] = {}
                    open_here[call.call_id] = call
            if not done:
                open_calls[call_id] = call
                call.holds += 1
                self._charge(state, b.OPEN_BYTES)
                if len(open_calls) > MAX_OPEN_CALLS:  # exits that never come: keep the newest
                    # by time, not id: ids made from Flight Recorder entries (bit 62) are not newer
                    oldest = open_calls.pop(min(open_calls, key=lambda k: open_calls[k].enter_time))
                    self._unslot(oldest)
                    self._drop_open(state, oldest)
                    self._charge(state, -b.OPEN_BYTES)
                    self._unhold(state, oldest)
            if kind is r.OpKind.P2P:
                self.p2p_changed = True
                if not done:
                    self.p2p_open[(state.rank, call.call_id)] = call
                return
            if kind is not r.OpKind.COLLECTIVE:
                return
            if slots is None:
                slots = self.slots[group] = collections.OrderedDict()
            slot = slots.get(seq)
            numbers = self.numbering.get(group)
            if numbers is not None and slot is not None:
                mine = numbers.get(state.rank, 0)
                if slot.numbering > mine:
                    return  # a numbering before the slot's (a rank behind a restart): no call of it
                if slot.numbering < mine:
                    del slots[seq]  # the numbering before's: this rank's is newer, and so is its slot
                    self._free_slot(slot)
                    slot = None
            if slot is None:  # (a call sent again goes below the slots of the rank's later calls)
                slot = self._new_slot(group, seq, slots, enter, state.rank, in_place=resent)
            elif enter > slot.last_enter:
                slot.last_enter = enter
            elif enter < slot.first_enter:
                slot.first_enter = enter
            self._into_slot(state, slot, call)
            members = self.members(group)
            if len(slot.calls) == len(members) > 1:
                here = slot.calls
                times = [c.enter_time for c in here.values()]
                arrived = max(times)
                times.sort()  # floats: a third of the cost of sorting (time, rank) pairs
                median = times[(len(times) - 1) // 2]  # of the others: the last rank's lag behind it
                lasts = self._arrivals.get(group)
                if lasts is None:
                    lasts = self._arrivals[group] = collections.deque(maxlen=ARRIVALS_KEPT)
                latest = max(rk for rk, c in here.items() if c.enter_time == arrived)  # a tie: the highest
                lasts.append((latest, arrived - median, seq, slot.first_enter))
            if done and call.error is None:  # reported already complete
                waited = call.exit_time - enter  # type: ignore[operator]
                self.wait_durations.append(waited if waited > 0.0 else 0.0)
                if numbers is None or self._current(state.rank, group):  # (another numbering's prune nothing)
                    self._prune(group, seq, members)
                    if group in self.passed_to and not self._in_run:
                        self._advance(group, state.rank, seq, members)
            if done and call.seq_count > UNEVEN_SEQS_ELSEWHERE and catalogue.uneven_seqs(call.op):
                self._shift_after(state, call)
        finally:  # the hold it had while it was applied (inlined ``_unhold``: every call)
            held = call.holds - 1
            call.holds = held
            if not held:
                self._unhold_last(state, call)

    def _exit(self, state: RankState, done: r.CallExit, now: float) -> None:
        call = state.open_calls.get(done.call_id)
        state.last_progress = now
        if call is None:
            return
        call.seq_count = done.seq_count
        if done.seq_count > UNEVEN_SEQS_ELSEWHERE and catalogue.uneven_seqs(call.op):
            self._shift_after(state, call)
        when = state.to_local(done.exit_time)
        if state.progress and done.error is None and self.awaits_completion(state, call, done.seq_count, when, now):
            call.returned_time = when  # enqueued: open until the device completes it
            return
        self._close(state, call, when, done.error)

    def _shift_after(self, state: RankState, call: r.CallRecord) -> None:
        """``call`` (gloo's monitored_barrier, the group's rank 0) took ``seq_count`` of torch's
        seqs where the other ranks took 2: from its end on, this rank's seqs (Python's and
        Flight Recorder's alike: both follow torch's counter) are numbered back by the excess."""
        shifts = state.seq_shifts.setdefault(call.group, [])
        before = shifts[-1][1] if shifts else 0
        raw_last = call.seq + before + call.seq_count - 1
        shifts.append((raw_last, before + call.seq_count - UNEVEN_SEQS_ELSEWHERE))
        self._charge(state, b.SHIFT_BYTES)
        if len(shifts) > SEQ_SHIFTS_KEPT:
            self._charge(state, -b.SHIFT_BYTES * (len(shifts) - SEQ_SHIFTS_KEPT))
            del shifts[:-SEQ_SHIFTS_KEPT]
        call.seq_count = UNEVEN_SEQS_ELSEWHERE

    # ---- device progress (NCCL) -------------------------------------------------------------

    def awaits_completion(
        self, state: RankState, call: r.CallRecord, seq_count: int, returned: float, now: float
    ) -> bool:
        """Whether a collective ``call`` the host returned from is still under way on the device:
        its group's progress is watched (fresh) and has not completed its last seq. A progress
        read after the return that shows everything enqueued completed settles it whatever the
        numbering (so a seq that torch counts differently never holds a call open)."""
        progress = state.progress.get(call.group)
        if progress is None or call.kind is not r.OpKind.COLLECTIVE or call.source != "python" or call.async_op:
            # records made from Flight Recorder entries carry their own completion, and an async
            # call's exit is its work's completion (the hook polls it), not its return
            return False
        if now - state.progress_seen > PROGRESS_FRESH_S:
            return False
        if call.seq + max(1, seq_count) - 1 <= progress.completed:
            return False
        return not (progress.enqueued == progress.completed and progress.time >= returned)

    def _progress(self, state: RankState, event: r.GroupProgress, now: float) -> None:
        group = event.group
        if group not in state.progress:
            if len(state.progress) >= MAX_GROUPS:
                self.dropped_calls += 1
                return
            if not self._room(state, b.PROGRESS_BYTES + b.text_bytes(group)):
                return
            self._charge(state, b.PROGRESS_BYTES + b.text_bytes(group))
        local = dataclasses.replace(
            event,
            time=state.to_local(event.time),
            completed_time=state.to_local(event.completed_time) if event.completed_time else 0.0,
            started_time=state.to_local(event.started_time) if event.started_time else 0.0,
        )
        prior = state.progress.get(group)
        state.progress[group] = local
        state.progress_seen = now
        open_here = state.open_collectives.get(group)
        closed: set[int] = set()
        for call in list(open_here.values()) if open_here else ():
            returned = call.returned_time
            if returned is None:
                continue  # the host thread is still inside it
            last = call.seq + max(1, call.seq_count) - 1
            settled = local.enqueued == local.completed and local.time >= returned
            if last > local.completed and not settled:
                continue
            when = local.completed_time if local.completed_time and last == local.completed else local.time
            self._close(state, call, max(returned, min(when, local.time)), None)
            closed.add(call.call_id)
            state.last_progress = now
            self.changed_slots.add((group, call.seq))
        if state.on_device.get(group):
            self._settle_device(state, group, prior, local, closed)

    def before_detection(self, now: float, stuck_after: Callable[[], float]) -> None:
        """What the detectors need of the state before they read it (they never write it), done
        by the state once a tick: device progress that stopped coming let go
        (``lapse_progress``), and the calls a device holds below each group's first open slot,
        entered the stuck threshold ago, made open calls (``open_on_device_below``)."""
        self.lapse_progress(now)
        if not any(st.on_device for st in self.ranks.values()):
            return
        firsts: list[tuple[str, int]] = []
        for group, slots in self.slots.items():
            for seq, slot in slots.items():
                if slot.open and any(c.exit_time is None for c in slot.calls.values()):
                    firsts.append((group, seq))
                    break
        if firsts:
            self.open_on_device_below(firsts, lambda: now - stuck_after())

    def lapse_progress(self, now: float) -> None:
        """Ranks whose device progress stopped coming (their agent is gone, their worker server no
        longer answers): completion is no longer watched, so the calls it held open are taken
        as complete when their host thread returned (the engine calls this every tick)."""
        for state in self.ranks.values():
            if not state.progress or now - state.progress_seen <= PROGRESS_FRESH_S:
                continue
            self._charge(state, -sum(b.PROGRESS_BYTES + b.text_bytes(g) for g in state.progress))
            state.progress.clear()
            self._let_go_on_device(state)
            for call in list(state.open_calls.values()):
                if call.returned_time is not None:
                    self._close(state, call, call.returned_time, None)

    # ---- runs on the device (NCCL): ``OnDevice`` -------------------------------------------

    def _device_from(self, state: RankState, run: r.CallRun, now: float) -> int:
        """The first call of ``run`` that ``awaits_completion`` would hold open (its group's
        progress watched and fresh, its seq not completed, not settled by a read that found
        everything enqueued completed after it returned); ``len(run)`` for none. Those before
        it are a prefix: seqs and returns both grow along a run."""
        n = len(run.enters)
        t = run.template
        progress = state.progress.get(t.group)
        if progress is None or t.source != "python" or now - state.progress_seen > PROGRESS_FRESH_S:
            return n  # not watched: each call is complete when its host returned (records of
            # Flight Recorder's carry their own completion, and never come as runs)
        return max(0, _completed_in(run, progress, state.clock_offset))

    def _settle_device(
        self,
        state: RankState,
        group: str,
        prior: r.GroupProgress | None,
        progress: r.GroupProgress,
        closed: set[int],
    ) -> None:
        """A progress read of ``group`` (``prior``: the read before): the calls of runs on the
        device it completes are done, their waits kept as ``_close`` keeps an open call's (but
        those open calls it closed, ``closed``: a slot took them from the run). Where the device
        has not moved since ``prior``, which had the first call still on it enqueued and came
        after it returned, the device is stopped at that call: it is made an open call, with its
        slot, as it would have been without runs (``_open_on_device``), for the detectors. (A
        read that had not enqueued it is another numbering's: the group made anew, whose reads
        may come before the rank's first call of it.)"""
        pending = state.on_device[group]
        while pending:
            entry = pending[0]
            run = entry.run
            n = len(run.enters)
            k = _completed_in(run, progress, run.offset)
            if k > entry.start:
                self._device_waits(run, entry.start, k, progress, closed)
                entry.start = k
                state.last_progress = state.progress_seen  # (as a call closed by progress)
            if k < n:
                break
            pending.popleft()
            self._charge(state, -entry.cost)
        if pending and prior is not None and prior.completed == progress.completed:
            entry = pending[0]
            run = entry.run
            i = entry.start
            if run.first_seq + i <= prior.enqueued and run.exits[i] + run.offset <= prior.time:
                self._open_first(state, group, pending)
        if not pending:
            state.on_device.pop(group, None)

    def _open_first(self, state: RankState, group: str, pending: collections.deque[OnDevice]) -> bool:
        """The first call ``state``'s device holds on ``group`` (``pending[0]``), made an open
        call (``_open_on_device``); whether it is one now."""
        entry = pending[0]
        if not self._open_on_device(state, entry.run, entry.start):
            return False
        entry.start += 1
        if entry.start == len(entry.run.enters):
            pending.popleft()
            self._charge(state, -entry.cost)
            if not pending:
                del state.on_device[group]
        return True

    def open_on_device_below(self, firsts: Sequence[tuple[str, int]], due: Callable[[], float]) -> bool:
        """Before the stuck detector judges a group's first open slot (``firsts``: (group, seq)),
        the first call each rank's device holds below it, of those entered by ``due()`` (asked
        only where there is one: the adaptive threshold's cost), is made an open call, as it
        would have been call by call: a device that stopped there is told there, not at the
        slot above of a call sent alone (another shape, a call after ``ON_DEVICE_RUNS``), which
        the detector would otherwise judge first (a hang told at a later seq; where a rank's
        host came late to that later call, a false one). Whether any was."""
        opened = False
        limit: float | None = None
        for group, seq in firsts:
            for st in self.ranks.values():
                pending = st.on_device.get(group) if st.on_device else None
                if not pending or pending[0].first_seq >= seq:
                    continue
                entry = pending[0]
                if limit is None:
                    limit = due()
                if entry.run.enters[entry.start] + entry.run.offset <= limit and self._open_first(st, group, pending):
                    opened = True
        return opened

    def _device_waits(self, run: r.CallRun, lo: int, hi: int, progress: r.GroupProgress, closed: set[int]) -> None:
        """The waits of ``run``'s calls ``lo`` to ``hi - 1`` that ``progress`` completed (but
        ``closed``'s, kept as they closed): from enter to completion (torch's watchdog's time for
        the last it completed, else the read's)."""
        lo = max(lo, hi - DURATIONS_KEPT)
        off, read = run.offset, progress.time
        # as ``_close`` takes each: done at the read (the host returned before it, or at its return)
        waits = [max(x + off, read) - (e + off) for e, x in zip(run.enters[lo:hi], run.exits[lo:hi], strict=True)]
        i = progress.completed - run.first_seq
        if progress.completed_time and lo <= i < hi:  # torch's watchdog's time for the last it completed
            waits[i - lo] = max(run.exits[i] + off, min(progress.completed_time, read)) - (run.enters[i] + off)
        if closed:
            first = run.first_call_id
            waits = [w for j, w in enumerate(waits, lo) if first + j not in closed]
        self.wait_durations.extend(map(max, itertools.repeat(0.0), waits))

    def _open_on_device(self, state: RankState, run: r.CallRun, i: int) -> bool:
        """``run``'s ``i``-th call as the open call it would be without runs: its host returned,
        its device has not completed it; in the rank's open calls and in its slot. Whether it
        is one now (not: the rank's open calls are full, or a memory budget; tried again at the
        next read)."""
        group = run.template.group
        call_id = run.first_call_id + i
        if call_id in state.open_calls:
            return True  # open already: a slot took it from the run
        if len(state.open_calls) >= MAX_OPEN_CALLS or not self._current(state.rank, group):
            return False
        call = run.call(i, run.offset)
        call.returned_time, call.exit_time = call.exit_time, None
        cost = call.cost = call.cost or b.call_bytes(call)
        if not self._room(state, cost + b.OPEN_BYTES + b.SLOT_ENTRY_BYTES + b.SLOT_BYTES):
            return False  # over a memory budget (counted)
        call.holds = 0
        state.calls += cost
        self.held += cost
        self.ledger.held += cost
        self.device_opened += 1
        self._track_open(state, call)
        slots = self.slots.get(group)
        if slots is None:
            slots = self.slots[group] = collections.OrderedDict()
        seq = call.seq
        slot = slots.get(seq)
        if slot is not None and slot.numbering != self.epoch.get(group, 0):
            del slots[seq]  # the numbering before's (this rank's is the newest): made again
            self._free_slot(slot)
            slot = None
        if slot is None:  # (below slots of its later calls, sent alone: in its place all the same)
            slot = self._new_slot(group, seq, slots, call.enter_time, state.rank, in_place=True)
        else:
            slot.first_enter = min(slot.first_enter, call.enter_time)
            slot.last_enter = max(slot.last_enter, call.enter_time)
        self._into_slot(state, slot, call)
        return True

    def _into_slot(self, state: RankState, slot: Slot, call: r.CallRecord) -> None:
        """``call`` in ``slot`` as its rank's, held there (the rank's call there before, if any,
        let go of)."""
        before_here = slot.calls.get(state.rank)
        slot.add(call)
        if not slot.pinned and (slot.differs or self._wrong_when_full(slot)):
            self._pin(slot)
        call.holds += 1
        if before_here is None:
            self.held += b.SLOT_ENTRY_BYTES
            self.ledger.held += b.SLOT_ENTRY_BYTES
        else:
            self._unhold(state, before_here)
        self.changed_slots.add((slot.group, slot.seq))

    def _track_open(self, state: RankState, call: r.CallRecord) -> None:
        """``call`` (on the device, a run's) in its rank's open calls, held and charged there; its
        rank's latest call where it is that one."""
        state.open_calls[call.call_id] = call
        call.holds += 1
        self._charge(state, b.OPEN_BYTES)
        here = state.open_collectives.get(call.group)
        if here is None:
            here = state.open_collectives[call.group] = {}
        here[call.call_id] = call
        last = state.last_call
        if last is not None and last.call_id == call.call_id:  # its latest call is this one, open
            state.last_call = call
            if state.last_kept:
                self._release_kept(state)

    @staticmethod
    def _on_device_at(state: RankState, group: str, seq: int) -> bool:
        """Whether ``state``'s call at (``group``, ``seq``) is a run's its device has not been
        seen to complete."""
        return any(e.first_seq <= seq <= e.run.last_seq for e in state.on_device.get(group, ()))

    def _let_go_on_device(self, state: RankState, group: str | None = None) -> None:
        """Forget ``state``'s runs on the device (of ``group``; None: every group): its progress
        stopped coming, so they are complete as their host returned, or they are of a numbering
        its group was made anew after."""
        for g in [group] if group is not None else list(state.on_device):
            for entry in state.on_device.pop(g, ()):
                self._charge(state, -entry.cost)

    def _close(self, state: RankState, call: r.CallRecord, when: float, error: str | None) -> None:
        if call.exit_time is None and call.kind is r.OpKind.COLLECTIVE:
            slots = self.slots.get(call.group)
            slot = None if slots is None else slots.get(call.seq)
            if slot is not None and slot.calls.get(call.rank) is call:
                slot.open -= 1
        call.exit_time = when
        if state.open_calls.get(call.call_id) is call:
            del state.open_calls[call.call_id]
            self._charge(state, -b.OPEN_BYTES)
            self._unhold(state, call)
        if error is not None and call.error is None and call.holds:
            extra = b.text_bytes(error)  # the error's text, held with the call
            state.calls += extra
            self.held += extra
            self.ledger.held += extra
            call.cost += extra
        call.error = error
        self._drop_open(state, call)
        if call.kind is r.OpKind.COLLECTIVE and error is None:
            self.wait_durations.append(max(0.0, when - call.enter_time))
            if self._current(state.rank, call.group):
                self._prune(call.group, call.seq)
                if call.group in self.passed_to:
                    self._advance(call.group, state.rank, call.seq, self.members(call.group))

    def _drop_open(self, state: RankState, call: r.CallRecord) -> None:
        self.p2p_open.pop((state.rank, call.call_id), None)
        open_here = state.open_collectives.get(call.group)
        if open_here is not None:
            open_here.pop(call.call_id, None)
            if not open_here:
                del state.open_collectives[call.group]

    def _unslot(self, call: r.CallRecord) -> None:
        slots = self.slots.get(call.group)
        slot = None if slots is None else slots.get(call.seq)
        held = None if slot is None else slot.calls.get(call.rank)
        if slot is not None and held is not None:
            slot.remove(call.rank)
            self._charge(None, -b.SLOT_ENTRY_BYTES)
            self._unhold(None, held)

    def _prune(self, group: str, seq: int, members: tuple[int, ...] | None = None) -> None:
        """Drop slots older than ``seq`` whose calls have all completed, keeping a short tail."""
        slots = self.slots.get(group)
        if not slots or seq - 8 <= next(iter(slots)) <= seq + 8:
            return
        if members is None:
            members = self.members(group)
        while slots:
            first_seq, first = next(iter(slots.items()))
            if first_seq > seq + 8 and not first.open:
                if not self._left_behind(group, first):
                    break  # ahead of this rank: others passed the seqs between in runs
                # older than every slot after it, yet numbered ahead, and every rank in it has
                # called below it since: left by a numbering that started again (the group
                # made anew; torchelastic restarts every worker, and seqs start from 1)
                self._free_slot(slots.popitem(last=False)[1])
                continue
            if first_seq >= seq - 8:
                break
            if first.open or first.pinned:
                break
            if members and len(first.calls) < len(members) and first_seq >= seq - 256:
                break  # someone has not arrived yet: keep it for the detectors
            self._free_slot(slots.popitem(last=False)[1])

    # ---- runs of alike calls (``records.CallRun``) -------------------------------------------

    def _run(self, state: RankState, run: r.CallRun, now: float) -> None:
        """Apply a run of calls alike (``records.CallRun``) with what each of them would have
        done, except that a call is made only where a table needs one: a slot that exists at
        its seq (made by a rank that sent that call alone), and the rank's history (its last
        ``HISTORY_PER_GROUP`` calls). The other seqs stay the run's (``passed``): a slot made at
        one later takes the call from it (``_pull_passed``); the run is compared with the first
        run through the same seqs (``_compare_run``), and where they differ slots are made
        for the detectors; once every member has passed a seq, its arrivals are counted
        (``_runs_complete``) and the runs below it let go (``_prune_runs``). A run that its
        rank's state would treat call by call (device progress watched, seqs renumbered, a
        first call on the group, a call sent again) is applied call by call."""
        group = run.template.group
        n = len(run.enters)
        t = run.template
        if run.cycle:  # each call's bytes, as ``_enter`` charges it
            templates = run.templates
            costs = tuple(c.cost or b.call_bytes(c) for c in templates)
            odd = any(
                c.kind is not r.OpKind.COLLECTIVE or c.group != group or self._faulty(c, group) for c in templates
            )
        else:
            costs = (t.cost or b.call_bytes(t),)
            odd = t.kind is not r.OpKind.COLLECTIVE or self._faulty(t, group)
        # from which call the device (NCCL) has not been seen to complete them: those are the
        # run's as the others are, and on the device until a progress read completes them
        device = self._device_from(state, run, now) if state.progress and n == len(run.exits) else n
        if (
            not n
            or len(run.exits) != n
            or odd
            or group not in state.history
            or (device < n and len(state.on_device.get(group) or ()) >= ON_DEVICE_RUNS)
            or state.seq_shifts.get(group)
            or run.first_call_id <= state.last_call_id
            or not self._room(state, b.run_bytes(n) * (2 if device < n else 1) + min(n, HISTORY_PER_GROUP) * max(costs))
        ):
            for i in range(n):
                self._enter(state, run.call(i), now)
            return
        hist = state.history[group]
        first = run.first_seq
        if self.anew:
            self._made_anew(state, group, hist, first, run.first_call_id)
        offset = run.offset = state.clock_offset
        slots = self.slots.get(group)
        open_here = state.open_collectives.get(group)
        if open_here:  # collectives on one group complete in order (as ``_enter`` closes them)
            for other in [c for c in open_here.values() if c.seq < first and c.returned_time is None]:
                self._close(state, other, run.enters[0] + offset, None)
        if not slots or not _any_in(slots, first, first + n - 1):
            # no slot waits for any of its calls (the steady state): taken whole, the history
            # keeping the run's last calls as the run (``state.history``)
            passed, last = True, self._pass(state, run, hist, 0, n, costs, device)
        else:
            passed, last = self._run_by_slots(state, run, hist, costs, now, device)
        if last is not None:
            before = state.last_call
            if before is None or last.enter_time >= before.enter_time:
                state.last_call = last
                if state.last_kept:
                    self._release_kept(state)
                if last.enter_time > state.last_sent:
                    state.last_sent = last.enter_time
            state.last_progress = now
            if run.step > state.step:
                state.step = run.step
        self.runs_taken += 1
        self.run_calls += n
        if run.cycle:
            self.cycle_calls += n
        current = self._current(state.rank, group)
        if device < n and current:
            entry = OnDevice(run, device, b.run_bytes(n))
            self.device_calls += n - device
            self._charge(state, entry.cost)
            state.on_device.setdefault(group, collections.deque()).append(entry)
        if not current:
            pass  # a numbering a restart left behind: not kept, compared, counted, or pruning
        elif passed:
            self._keep_run(state, run)  # compared with the others', then the rank's passed seq moves
        elif group in self.passed_to:
            self._advance(group, state.rank, run.last_seq, self.members(group))
        if slots and current:
            self._prune(group, run.last_seq)

    def _pass(
        self,
        state: RankState,
        run: r.CallRun,
        hist: History,
        lo: int,
        hi: int,
        costs: tuple[int, ...],
        device: int,
    ) -> r.CallRecord | None:
        """Take calls ``lo`` to ``hi - 1`` of ``run`` as passed (no slot waits for them): counted,
        their waits kept (those of the run's last ``DURATIONS_KEPT`` before ``device``, the first
        still on the device: theirs are kept as progress completes them), and those among the
        run's last ``HISTORY_PER_GROUP`` kept in the rank's history as a slice of the run (no
        record each: ``history.RunSlice``). The last call made whole for the history, if any."""
        n = len(run.enters)
        state.last_call_id = run.first_call_id + hi - 1
        self.records_received += hi - lo
        enters, exits = run.enters, run.exits
        d = max(lo, n - DURATIONS_KEPT)
        w = min(hi, device)
        if d < w:
            self.wait_durations.extend(map(max, itertools.repeat(0.0), map(operator.sub, exits[d:w], enters[d:w])))
        lo = max(lo, n - HISTORY_PER_GROUP)
        k = hi - lo
        if k <= 0:
            return None
        if len(hist) + k > HISTORY_PER_GROUP:
            self._evict(state, hist, len(hist) + k - HISTORY_PER_GROUP)
        last = run.call(hi - 1, run.offset)
        piece = RunSlice.part(run, lo, hi, last, costs)  # its own copy: not the whole run's times
        last.cost = piece.cost_of(k - 1)
        last.holds = 1
        charged = piece.bytes(0, k)
        state.calls += charged
        self.held += charged
        self.ledger.held += charged
        hist.append_run(piece)
        return last

    def _run_by_slots(
        self, state: RankState, run: r.CallRun, hist: History, costs: tuple[int, ...], now: float, device: int
    ) -> tuple[bool, r.CallRecord | None]:
        """``_run``'s calls where slots wait for some of them: those are made whole and entered;
        the stretches between them are taken as passed (``_pass``), so a run through a few
        slots costs a few calls, not one per call. (A rank that sent a call alone at a seq,
        at the edge of a batch, makes a slot there that every other rank's run goes through.)
        Whether any call stayed the run's, and the last call made for the history."""
        group, first = run.template.group, run.first_seq
        n = len(run.enters)
        slots = self.slots[group]
        if len(slots) <= n:
            waiting = sorted(seq - first for seq in slots if first <= seq < first + n)
        else:
            waiting = [i for i in range(n) if first + i in slots]
        passed = False
        last: r.CallRecord | None = None
        start = 0  # the first call of the stretch not yet taken
        self._in_run = True
        try:
            for i in waiting:
                if first + i not in slots:  # let go of since, by a call entered before it
                    continue
                if i > start:
                    passed = True
                    last = self._pass(state, run, hist, start, i, costs, device) or last
                self._enter(state, run.call(i), now)  # a slot waits for it: the call, whole
                start = i + 1
            if start < n:
                passed = True
                last = self._pass(state, run, hist, start, n, costs, device) or last
        finally:
            self._in_run = False
        return passed, last

    def _faulty(self, template: r.CallRecord, group: str) -> bool:
        """Whether a call of ``template`` is wrong in itself (against its group's size): each
        such call is a repeat the mismatch detector counts, so a run of them goes call by call."""
        size = len(self.members(group)) or None
        known = self._faults.get(id(template))
        if known is not None and known[0] is template and known[1] == size:
            return known[2]
        faulty = compare_collective({template.rank: template}, size) is not None
        if len(self._faults) >= MAX_SLOTS_PER_GROUP:
            self._faults.clear()
        self._faults[id(template)] = (template, size, faulty)
        return faulty

    def _keep_run(self, state: RankState, run: r.CallRun) -> None:
        group = run.template.group
        run.cost = b.run_bytes(len(run.enters))
        run.holder = state
        self._charge(state, run.cost)
        byrank = self.passed.get(group)
        if byrank is None:
            byrank = self.passed[group] = {}
        runs = byrank.get(state.rank)
        if runs is None:
            runs = byrank[state.rank] = collections.deque()
        elif runs and runs[-1].last_seq >= run.first_seq:
            # numbered from below again (the group was made anew): the older runs are another
            # numbering's, and so is what the others' runs were compared with
            while runs:
                self._drop_run(runs.popleft())
            self.run_refs.pop(group, None)
            self._arrivals_due.pop(group, None)
        runs.append(run)
        while len(runs) > 1 and runs[-1].last_seq - runs[0].first_seq >= MAX_SLOTS_PER_GROUP:
            self._drop_run(runs.popleft())  # a member that never comes: bounded as slots are
        members = self.members(group)
        self._compare_run(group, run)
        self._advance(group, state.rank, run.last_seq, members)

    def _drop_run(self, run: r.CallRun) -> None:
        holder = run.holder
        state = holder if isinstance(holder, RankState) and self.ranks.get(holder.rank) is holder else None
        self._charge(state, -run.cost)
        run.cost = 0
        run.holder = None

    def _compare_run(self, group: str, run: r.CallRun) -> None:
        """Compare ``run`` with the first run through its seqs; where they differ, make the slots
        of the seqs they share, for the detectors to judge as they judge any slot (each one
        a mismatch's repeat, or a difference no rule minds: split sizes of ``all_to_all``).
        A call site is no difference: rules judge it only where a slot is made anyway. A
        cycle's calls are compared seq by seq, each with its own template's."""
        mine = _RunRef.of(run)
        refs = self.run_refs.get(group)
        if refs is None:
            refs = self.run_refs[group] = collections.deque()
        lo, hi = run.first_seq, run.last_seq
        covered = refs[-1].hi if refs else lo - 1
        for ref in reversed(refs):
            if ref.hi < lo:
                break
            if ref.lo > hi or ref.alike(mine):
                continue
            for seq in range(max(lo, ref.lo), min(hi, ref.hi) + 1):
                if ref.key_at(seq) != mine.key_at(seq):
                    self._materialize(group, seq)
        if hi > covered:
            start = max(lo, covered + 1)
            last = refs[-1] if refs else None
            if last is not None and last.hi == start - 1 and last.alike(mine):
                last.hi = hi
            else:
                mine.lo = start
                refs.append(mine)
                if len(refs) > MAX_SLOTS_PER_GROUP:
                    refs.popleft()

    def _new_slot(
        self,
        group: str,
        seq: int,
        slots: collections.OrderedDict[int, Slot],
        enter: float,
        rank: int,
        in_place: bool = False,
    ) -> Slot:
        """A slot at (group, seq), with the calls other ranks' runs hold at that seq. ``in_place``:
        put in seq order even where ``rank`` has calls in the slots above (a call of its own
        run made a call late, where its device stopped: not a numbering started again)."""
        slot = slots[seq] = Slot(group, seq, first_enter=enter, last_enter=enter)
        numbers = self.numbering.get(group)
        if numbers is not None:
            slot.numbering = numbers.get(rank, 0) if rank >= 0 else self.epoch.get(group, 0)
        self.held += b.SLOT_BYTES
        self.ledger.held += b.SLOT_BYTES
        # Slots stand in seq order (``_prune`` reads them oldest first). One made below slots
        # already there is a slow rank's (others passed its seq in runs, making no slot): put in
        # its place. Unless ``rank`` has calls in those slots: then its numbering started again
        # (its group made anew), and the old slots are left to ``_prune`` as such.
        higher: list[int] = []
        most = MAX_SLOTS_PER_GROUP if in_place else MAX_REORDER  # (in place: rare, where a device stopped)
        for k in reversed(slots):
            if k < seq or len(higher) > most:
                break
            if k != seq:
                higher.append(k)
        if higher and len(higher) <= most and (in_place or not any(rank in slots[k].calls for k in higher)):
            for k in reversed(higher):
                slots.move_to_end(k)
        while len(slots) > MAX_SLOTS_PER_GROUP:
            self._free_slot(slots.popitem(last=False)[1])
        if self.passed.get(group):
            self._pull_passed(group, seq, slot, rank)
        return slot

    def _pull_passed(self, group: str, seq: int, slot: Slot, skip: int) -> None:
        """Put into ``slot`` the calls that ranks' runs hold at its seq (each charged as the
        call it is), but ``skip``'s and those it has."""
        byrank = self.passed.get(group)
        if not byrank or slot.numbering != self.epoch.get(group, 0):
            return  # (runs kept are the newest numbering's: ``_renumbered``)
        ledger = self.ledger
        for rank, runs in byrank.items():
            if rank == skip or rank in slot.calls:
                continue
            run = _run_at(runs, seq)
            if run is None:
                continue
            st = self.ranks.get(rank)
            i = seq - run.first_seq
            # its device holds calls (not a run of an earlier session of the rank: ids start again)
            watched = st if st is not None and st.on_device and run.holder is st else None
            opened = watched.open_calls.get(run.first_call_id + i) if watched is not None else None
            device = False
            if opened is not None:  # made an open call already (its device stopped at it): charged
                call, cost = opened, 0
                call.holds += 1
            else:
                call = run.call(i, run.offset)
                cost = call.cost = call.cost or b.call_bytes(call)
                call.holds = 1
                device = watched is not None and self._on_device_at(watched, group, seq)
                if device:  # on its device still: open, as it would be without runs
                    call.returned_time, call.exit_time = call.exit_time, None
            empty = not slot.calls and not slot.last_enter  # made by ``_materialize``: no time yet
            slot.add(call)
            if not slot.pinned and (slot.differs or self._wrong_when_full(slot)):
                self._pin(slot)
            enter = call.enter_time
            if empty or enter < slot.first_enter:
                slot.first_enter = enter
            if empty or enter > slot.last_enter:
                slot.last_enter = enter
            if st is not None:
                st.calls += cost
                if device:
                    self._track_open(st, call)
            self.held += cost + b.SLOT_ENTRY_BYTES
            ledger.held += cost + b.SLOT_ENTRY_BYTES

    def _materialize(self, group: str, seq: int) -> None:
        """Make (or fill) the slot at (group, seq) from the runs that hold it, for the detectors."""
        slots = self.slots.get(group)
        if slots is None:
            slots = self.slots[group] = collections.OrderedDict()
        slot = slots.get(seq)
        if slot is None:
            slot = self._new_slot(group, seq, slots, 0.0, -1)
        else:
            self._pull_passed(group, seq, slot, -1)
        if not slot.pinned:
            self._pin(slot)
        self.changed_slots.add((group, seq))

    def _current(self, rank: int, group: str) -> bool:
        """Whether ``rank`` numbers ``group`` as its newest numbering does (``_renumbered``)."""
        numbers = self.numbering.get(group)
        return numbers is None or numbers.get(rank, 0) == self.epoch.get(group, 0)

    def _made_anew(self, state: RankState, group: str, hist: History, seq: int, call_id: int) -> bool:
        """A collective of ``state``'s rank on ``group`` (``seq``, ``call_id``): where the rank
        told of makings of the group whose calls have not come yet, the first numbered below its
        last of the same kind (``_from_below``) is the newest making's first. Whether it was."""
        pending = self.anew.get(group)
        makings = pending.get(state.rank) if pending else None
        if not makings or not _from_below(hist, seq, call_id):
            return False
        del pending[state.rank]  # type: ignore[union-attr]
        if not pending:
            del self.anew[group]
        self._renumbered(state, group, makings)
        return True

    def _renumbered(self, state: RankState, group: str, makings: int = 1) -> None:
        """``state``'s rank made ``group`` anew (it said it created it again, with a higher
        creation index): destroy then init again in the same process, an in-process restart.
        Its calls from here (``_made_anew``) number from 1 again. Its runs and what it passed are the
        numbering before's, as are those of every rank not yet heard making it anew: let go of
        (a slot its new calls made would take their calls at the same seqs, a mismatch where the
        shapes changed between the two: a false alarm). Until such a rank makes it anew too, its
        runs are not kept, its calls share no slot with the new numbering's and prune nothing."""
        rank = state.rank
        numbers = self.numbering.setdefault(group, {})
        mine = numbers[rank] = numbers.get(rank, 0) + makings  # (one it made without a call counts)
        epoch = self.epoch.get(group, 0)
        if mine > epoch:
            epoch = self.epoch[group] = mine
            self.run_refs.pop(group, None)  # all the numbering before's
            self._arrivals.pop(group, None)

        def behind(rk: int) -> bool:  # its runs and passed seqs are the numbering before's
            return rk == rank or numbers.get(rk, 0) != epoch

        byrank = self.passed.get(group) or {}
        for rk in [rk for rk in byrank if behind(rk)]:
            for run in byrank.pop(rk):
                self._drop_run(run)
        passed_to = self.passed_to.get(group) or {}
        for rk in [rk for rk in passed_to if behind(rk)]:
            del passed_to[rk]
        self.passed_low.pop(group, None)  # worked out again at the next rank's advance
        self._arrivals_due.pop(group, None)
        self._pruned_to.pop(group, None)
        state.entry_seqs.pop(group, None)  # Flight Recorder's numbering starts again with it
        self._let_go_on_device(state, group)
        shifts = state.seq_shifts.pop(group, None)  # and gloo's uneven numbering of monitored barriers
        if shifts:
            self._charge(state, -b.SHIFT_BYTES * len(shifts))

    def _advance(self, group: str, rank: int, seq: int, members: tuple[int, ...]) -> None:
        """``rank`` passed every seq of ``group`` up to ``seq``. When the lowest rank moves up,
        what every member has now passed is counted and the runs below let go."""
        passed_to = self.passed_to.get(group)
        if passed_to is None:
            passed_to = self.passed_to[group] = {}
        before = passed_to.get(rank, 0)
        if seq <= before:
            return
        passed_to[rank] = seq
        low, at_low = self.passed_low.get(group, (0, 0))
        if before != low:
            return
        at_low -= 1
        if at_low <= 0 and members:
            where = list(map(passed_to.get, members, itertools.repeat(0)))
            new_low = min(where)
            at_low = where.count(new_low)
            if new_low > low:
                due = self._arrivals_due.get(group)
                self._arrivals_due[group] = (due[0] if due else low, new_low, members)
                if new_low >= self._pruned_to.get(group, 0) + PRUNE_RUNS_EVERY:
                    self._prune_runs(group, new_low)
            low = new_low
        self.passed_low[group] = (low, at_low)

    @property
    def arrivals(self) -> dict[str, collections.deque[tuple[int, float, int, float]]]:
        """Per group, the last rank to arrive at each of its latest complete collectives (at most
        ``ARRIVALS_KEPT``, in seq order of those that runs completed): (rank, its lag behind the
        median arrival, seq, first arrival). The seqs runs completed are counted here, when
        read (the straggler detector, once a tick), not each time the slowest rank's run comes:
        at 1,024 ranks that was half the job state's work (``bench/ingest.py``)."""
        while self._arrivals_due:
            group, (low, new_low, members) = self._arrivals_due.popitem()
            self._runs_complete(group, low, new_low, members)
        return self._arrivals

    def _runs_complete(self, group: str, low: int, new_low: int, members: tuple[int, ...]) -> None:
        """Every member passed the seqs above ``low`` up to ``new_low``: the arrivals of those
        the runs hold (their newest ``ARRIVALS_KEPT``: the detectors read no more) are counted
        as a complete slot's are, and the newest ``ARRIVALS_KEPT`` by seq kept."""
        if len(members) < 2:
            return
        byrank = self.passed.get(group, {})
        slots: dict[int, Slot] = self.slots.get(group) or {}
        lasts = self._arrivals.get(group)
        counted = {seq for _, _, seq, _ in lasts} if lasts else set()
        want = [
            seq
            for seq in range(max(low + 1, new_low - ARRIVALS_KEPT + 1), new_low + 1)
            if seq not in slots and seq not in counted  # counted where its slot completed (it may be pruned since)
        ]
        if not want:
            return
        lo = want[0]
        # a row per member of its arrival times at lo..new_low (None where no run of its holds
        # the seq), made of its runs' slices, then read a column per seq: the work per call is
        # in C but for adding the rank's clock offset (1,024 ranks: every call is counted here)
        rows: list[list[float | None]] = []
        for m in members:
            runs = byrank.get(m)
            if not runs:
                return  # no seq is complete in runs alone
            pieces: list[list[float | None]] = []
            top = new_low  # each seq is taken from the newest run that holds it
            for run in reversed(runs):
                first = run.first_seq
                if first > top:
                    continue
                hi = min(top, first + len(run.enters) - 1)
                if hi < lo:
                    break
                start = max(lo, first)
                if hi < top:
                    pieces.append([None] * (top - hi))
                pieces.append(list(map(run.offset.__add__, run.enters[start - first : hi - first + 1])))
                top = start - 1
                if top < lo:
                    break
            if top >= lo:
                pieces.append([None] * (top - lo + 1))
            row = pieces[-1] if len(pieces) == 1 else list(itertools.chain.from_iterable(reversed(pieces)))
            rows.append(row)
        columns = list(zip(*rows, strict=True))  # every row spans lo..new_low
        n = len(members)
        counts: list[tuple[int, float, int, float]] = []
        for seq in want:
            arrived = columns[seq - lo]
            if None in arrived:
                continue
            ordered = sorted(arrived)  # no None left
            last, rank = max(zip(arrived, members, strict=True))  # of a tie, the highest rank (as a slot's sort)
            counts.append((rank, last - ordered[(n - 1) // 2], seq, ordered[0]))
        if counts:
            kept = sorted([*(lasts or ()), *counts], key=operator.itemgetter(2))[-ARRIVALS_KEPT:]
            self._arrivals[group] = collections.deque(kept, maxlen=ARRIVALS_KEPT)

    def _prune_runs(self, group: str, low: int) -> None:
        """Let go of runs every member has passed, but for the last ``ARRIVALS_KEPT`` seqs (whose
        arrivals may not be counted yet; slots are kept so too). Done every ``PRUNE_RUNS_EVERY``
        seqs, not at each: it walks every member's runs."""
        self._pruned_to[group] = low
        tail = low - ARRIVALS_KEPT
        for st in self.ranks.values():  # a slot made where a device stopped takes its calls from them
            held = st.on_device.get(group) if st.on_device else None
            if held and held[0].first_seq < tail:
                tail = held[0].first_seq
        for runs in self.passed.get(group, {}).values():
            while runs and runs[0].last_seq < tail:
                self._drop_run(runs.popleft())
        refs = self.run_refs.get(group)
        while refs and refs[0].hi < tail:
            refs.popleft()

    def _wrong_when_full(self, slot: Slot) -> bool:
        """Whether ``slot`` just got its last member's call and its calls, alike, are wrong in
        themselves (against the group's size): kept for the detectors, which may be waiting for
        the others' batches before they tell it, rather than pruned as complete before they see it."""
        members = self.members(slot.group)
        if not members or len(slot.calls) != len(members):
            return False
        first = next(iter(slot.calls.values()))
        return compare_collective({first.rank: first}, len(members)) is not None  # once a slot

    def _pin(self, slot: Slot) -> None:
        """Keep ``slot`` until the engine's next tick has looked at it (``take_changes``)."""
        slot.pinned = True
        self.pinned.append(slot)
        if len(self.pinned) > MAX_SLOTS_PER_GROUP:  # no engine ticks (a replay, a bench): bounded
            for old in self.pinned[: MAX_SLOTS_PER_GROUP // 2]:
                old.pinned = False
            del self.pinned[: MAX_SLOTS_PER_GROUP // 2]

    def _left_behind(self, group: str, slot: Slot) -> bool:
        """Whether every rank with a call in ``slot`` has since made a call on ``group`` numbered
        below it (its numbering started again), or is gone from the job's state."""
        for rank in slot.calls:
            st = self.ranks.get(rank)
            hist = st.history.get(group) if st is not None else None
            if hist and hist[-1].seq >= slot.seq:
                return False
        return True

    # ---- queries --------------------------------------------------------------------------

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


@dataclasses.dataclass(slots=True)
class _RunRef:
    """The first run through seqs ``lo`` to ``hi`` of a group: what it called at each seq (the
    key of ``keys[(seq - anchor) % len(keys)]``: one key, or a cycle's, in its shortest period)."""

    lo: int
    hi: int
    keys: tuple[tuple[object, ...], ...]
    anchor: int = 0

    @classmethod
    def of(cls, run: r.CallRun) -> _RunRef:
        if not run.cycle:
            return cls(run.first_seq, run.last_seq, (_run_key(run.template),))
        keys = tuple(map(_run_key, run.templates))
        p = len(keys)
        for q in range(1, p):  # the shortest period that repeats the keys (a cycle of call sites may call alike)
            if p % q == 0 and all(keys[j] == keys[j % q] for j in range(p)):
                keys = keys[:q]
                break
        return cls(run.first_seq, run.last_seq, keys, run.first_seq)

    def key_at(self, seq: int) -> tuple[object, ...]:
        keys = self.keys
        return keys[0] if len(keys) == 1 else keys[(seq - self.anchor) % len(keys)]

    def alike(self, other: _RunRef) -> bool:
        """Whether the two call alike at every seq."""
        p = len(self.keys)
        if p != len(other.keys):
            return False
        if p == 1:
            return self.keys[0] == other.keys[0]
        shift = other.anchor - self.anchor
        return all(self.keys[(j + shift) % p] == other.keys[j] for j in range(p))


def _run_key(t: r.CallRecord) -> tuple[object, ...]:
    """What two ranks' runs must agree on at a seq (a call site is no difference)."""
    return (t.op, t.inputs, t.outputs, t.reduce_op, t.root, t.async_op, t.extra)


def _any_in(slots: collections.OrderedDict[int, Slot], lo: int, hi: int) -> bool:
    """Whether ``slots`` has one at a seq from ``lo`` to ``hi``, by whichever is fewer: its
    seqs or the range's."""
    if len(slots) <= hi - lo:
        return any(lo <= seq <= hi for seq in slots)
    return any(seq in slots for seq in range(lo, hi + 1))


def _run_at(runs: Sequence[r.CallRun], seq: int) -> r.CallRun | None:
    """The run of ``runs`` (oldest first) that holds ``seq``, if any."""
    for run in reversed(runs):
        if run.first_seq <= seq:
            return run if seq <= run.first_seq + len(run.enters) - 1 else None
    return None


def _completed_in(run: r.CallRun, progress: r.GroupProgress, offset: float) -> int:
    """How many of ``run``'s first calls ``progress`` shows complete (at most its length; below
    0 where it completed less than the call before its first), by ``awaits_completion``'s rule:
    its seq completed, or returned (its time + ``offset``) before a read that found everything
    enqueued completed. Seqs and returns both grow along a run, so those are a prefix."""
    n = len(run.enters)
    k = progress.completed - run.first_seq + 1
    if k < n and progress.enqueued == progress.completed:
        k = max(k, bisect.bisect_right(run.exits, progress.time, key=offset.__add__))
    return min(k, n)


def _from_below(hist: History, seq: int, call_id: int) -> bool:
    """Whether a collective (``seq``, a new ``call_id``) is numbered below the last of its kind
    in a rank's ``hist``ory on the group (issued from Python, or read from Flight Recorder:
    records of the one may come after later calls of the other; the other kind's last where
    the rank made none of its own, as a rank whose calls after the making are all C++'s), among
    the first ``NEW_NUMBERING_SEQS``: the first call of a group made anew. p2p calls count per
    pair."""
    if seq > NEW_NUMBERING_SEQS:
        return False
    entry = call_id >= ENTRY_CALL_IDS
    other: r.CallRecord | None = None  # the last of the other kind, where none of its own
    for last in reversed(list(hist)):
        if last.kind is not r.OpKind.COLLECTIVE:
            continue
        if (last.call_id >= ENTRY_CALL_IDS) is entry:
            return seq < last.seq and last.call_id < call_id  # (not a batch sent again)
        other = other or last
    return other is not None and seq < other.seq


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
    return isinstance(event, r.GroupEvent) and event.kind is r.GroupEventKind.CREATED and event.time > since
