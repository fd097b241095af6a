"""What every concern of a job's state shares: its bounds, and what a job holds (``_Base``).

``JobState`` (``state/__init__.py``) is made of one class per concern (``registry``, ``arena``,
``calls``, ``device``, ``runs``, ``groups``), each a module of its own over this base: the
attributes a job holds, declared here once, and the methods one concern asks of another,
each implemented by its own concern (the stubs here say whose).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state.history import History
from hangwatch.diagnosis.state.ranks import (
    RankState,
    Slot,
)
from hangwatch.flight_entries import ENTRY_CALL_IDS

if TYPE_CHECKING:
    from hangwatch.diagnosis.lag import Lag
    from hangwatch.diagnosis.state.joining import Joiner

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
    """A registration that contradicts what the job's incarnation already holds (the message says why)."""


ARRIVALS_KEPT = 32
#: In a group of more members than this, arrivals are a sample: one collective's at most every
#: ``ARRIVALS_SPREAD_S`` (by its first arrival), and of the seqs runs completed, the newest
#: alone a read (``Runs.arrivals``, once a tick; a seq costs a look at every member's runs and
#: a sort). A straggler is then last across seconds of batches, not across the calls of one
#: batch that a coordinator late for a moment mapped late.
ARRIVALS_SAMPLED_FROM = 256
ARRIVALS_SPREAD_S = 0.5
PRUNE_RUNS_EVERY = 16  # passed seqs between two walks of every member's runs (``_prune_runs``)
PRUNE_MEMBERS_PER_SEQ = 256  # a group's members a seq between two walks, where more (16,384: every 64 seqs)
#: A group made anew numbers from 1 again: its first call comes at one of these first seqs (after
#: the few C++ issued first, DDP's broadcast of the module's state), below the rank's last
NEW_NUMBERING_SEQS = 64
#: Runs a rank may have on its device at once per group (``OnDevice``); past them its runs go
#: call by call, each call open until its completion, as without runs
ON_DEVICE_RUNS = 64


def _same_process(claimed: r.RankIdentity, proven: r.RankIdentity) -> bool:
    """Whether a claim names the process an agent proved (a pid seen from inside a container
    differs from the agent's, so there only the host and start time are compared)."""
    pid_ok = claimed.pid == proven.pid or bool(claimed.pid_namespace)
    return claimed.host == proven.host and pid_ok and abs(claimed.start_time - proven.start_time) <= 1.0


def _run_waits(
    enters: Sequence[float], exits: Sequence[float], lo: int, hi: int, done_by: float | None = None
) -> list[float]:
    """The waits of a run's calls ``lo`` to ``hi - 1``: from enter to return, or to ``done_by``
    (a device's read, on the run's clock) where that came later. Returns grow along a run, so
    those before ``done_by`` are a prefix (no loop in Python). None below 0 (a clock stepped
    back inside a call: none waited less than nothing)."""
    j = lo if done_by is None else bisect.bisect_right(exits, done_by, lo, hi)
    waits = list(map(operator.sub, itertools.repeat(done_by, j - lo), enters[lo:j])) if j > lo else []
    waits += map(operator.sub, exits[j:hi], enters[j:hi])
    if waits and min(waits) < 0.0:
        waits = [w if w > 0.0 else 0.0 for w in waits]
    return waits


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


@dataclasses.dataclass(slots=True)
class _RunRef:
    """The first run through seqs ``lo`` to ``hi`` of a group: what it called at each seq (the
    key of ``keys[(seq - anchor) % len(keys)]``: one key, or a cycle's, in its shortest period)."""

    lo: int
    hi: int
    keys: tuple[tuple[object, ...], ...]
    anchor: int = 0

    def key_at(self, seq: int) -> tuple[object, ...]:
        keys = self.keys
        return keys[0] if len(keys) == 1 else keys[(seq - self.anchor) % len(keys)]

    def alike(self, other: _RunRef) -> bool:
        """Whether the two call alike at every seq."""
        keys = self.keys
        p = len(keys)
        if p != len(other.keys):
            return False
        shift = (other.anchor - self.anchor) % p
        return (keys[shift:] + keys[:shift] if shift else keys) == other.keys


def _run_key(t: r.CallRecord) -> tuple[object, ...]:
    """What two ranks' runs must agree on at a seq (a call site is no difference)."""
    return (t.op, t.inputs, t.outputs, t.reduce_op, t.root, t.async_op, t.extra)


def run_keys(templates: tuple[r.CallRecord, ...]) -> tuple[tuple[object, ...], ...]:
    """The keys (``_run_key``) of a run's templates a period, in their shortest period (a cycle
    of call sites may call alike)."""
    keys = tuple(map(_run_key, templates))
    p = len(keys)
    for q in range(1, p):
        if p % q == 0 and keys[q:] + keys[:q] == keys:
            return keys[:q]
    return keys


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


class _Base:
    """A job's state as every concern sees it (``JobState.__init__`` sets each of these)."""

    ledger: b.Ledger
    lag: Lag
    held: int
    refused: int
    refused_wide: int
    incarnation: str
    incarnations: int
    launch: str
    attempt: int
    job_id: str
    world_size: int
    from_dumps: bool
    ranks: dict[int, RankState]
    joining: dict[int, Joiner]
    sessions: dict[str, int]
    groups: dict[str, r.GroupInfo]
    slots: dict[str, collections.OrderedDict[int, Slot]]
    p2p_open: dict[tuple[int, int], r.CallRecord]
    wait_durations: collections.deque[float]
    records_received: int
    duplicates: int
    started: float
    changed_slots: set[tuple[str, int]]
    groups_changed: bool
    p2p_changed: bool
    aborted_at: float | None
    dropped_calls: int
    _arrivals: dict[str, collections.deque[tuple[int, float, int, float]]]
    _arrivals_due: dict[str, tuple[int, int, tuple[int, ...]]]
    _pruned_to: dict[str, int]
    group_owner: dict[str, int]
    _world: tuple[int, ...]
    conflicts: collections.deque[dict[str, object]]
    passed: dict[str, dict[int, collections.deque[r.CallRun]]]
    kept_order: dict[str, collections.deque[tuple[int, int]]]
    passed_to: dict[str, dict[int, int]]
    passed_low: dict[str, int]
    passed_counts: dict[str, tuple[tuple[int, ...], frozenset[int], dict[int, int]]]
    run_refs: dict[str, collections.deque[_RunRef]]
    numbering: dict[str, dict[int, int]]
    epoch: dict[str, int]
    created_index: dict[str, dict[int, int]]
    anew: dict[str, dict[int, int]]
    pinned: list[Slot]
    _in_run: bool
    runs_taken: int
    run_calls: int
    cycle_calls: int
    device_calls: int
    device_opened: int

    def _advance(self, group: str, rank: int, seq: int, members: tuple[int, ...]) -> None:
        raise NotImplementedError  # Runs's

    def _charge(self, state: RankState | None, n: int) -> None:
        raise NotImplementedError  # Arena's

    def _close(self, state: RankState, call: r.CallRecord, when: float, error: str | None) -> None:
        raise NotImplementedError  # Calls's

    def _continues_run(self, state: RankState, call: r.CallRecord) -> r.CallRun | None:
        raise NotImplementedError  # Runs's

    def _current(self, rank: int, group: str) -> bool:
        raise NotImplementedError  # Groups's

    def _device_from(self, state: RankState, run: r.CallRun, now: float) -> int:
        raise NotImplementedError  # Device's

    def _drop_run(self, run: r.CallRun) -> None:
        raise NotImplementedError  # Runs's

    def _enter(self, state: RankState, call: r.CallRecord, now: float) -> None:
        # the hot path of ingest (every call of every rank): locals, one kind lookup, no scans
        raise NotImplementedError  # Calls's

    def _evict(self, state: RankState, hist: History, k: int) -> None:
        raise NotImplementedError  # Arena's

    def _exit(self, state: RankState, done: r.CallExit, now: float) -> None:
        raise NotImplementedError  # Calls's

    def _free_slot(self, slot: Slot) -> None:
        # inlined ``_unhold``: every call passes here once its slot is pruned
        raise NotImplementedError  # Arena's

    def _group_event(self, state: RankState, event: r.GroupEvent) -> None:
        raise NotImplementedError  # Groups's

    def _into_slot(self, state: RankState, slot: Slot, call: r.CallRecord) -> None:
        raise NotImplementedError  # Calls's

    def _let_go_on_device(self, state: RankState, group: str | None = None) -> None:
        raise NotImplementedError  # Device's

    def _made_anew(self, state: RankState, group: str, hist: History, seq: int, call_id: int) -> bool:
        raise NotImplementedError  # Groups's

    def _new_slot(
        self,
        group: str,
        seq: int,
        slots: collections.OrderedDict[int, Slot],
        enter: float,
        rank: int,
        in_place: bool = False,
    ) -> Slot:
        raise NotImplementedError  # Calls's

    @staticmethod
    def _on_device_at(state: RankState, group: str, seq: int) -> bool:
        raise NotImplementedError  # Device's

    def _pin(self, slot: Slot) -> None:
        raise NotImplementedError  # Calls's

    def _progress(self, state: RankState, event: r.GroupProgress, now: float) -> None:
        raise NotImplementedError  # Device's

    def _prune(self, group: str, seq: int, members: tuple[int, ...] | None = None) -> None:
        raise NotImplementedError  # Calls's

    def _pull_passed(self, group: str, seq: int, slot: Slot, skip: int) -> None:
        raise NotImplementedError  # Runs's

    def _release_kept(self, state: RankState) -> None:
        raise NotImplementedError  # Arena's

    def _room(self, state: RankState | None, n: int) -> bool:
        raise NotImplementedError  # Arena's

    def _run(self, state: RankState, run: r.CallRun, now: float) -> None:
        raise NotImplementedError  # Runs's

    def _track_open(self, state: RankState, call: r.CallRecord) -> None:
        raise NotImplementedError  # Calls's

    def _unhold(self, state: RankState | None, call: r.CallRecord) -> None:
        raise NotImplementedError  # Arena's

    def _unhold_last(self, state: RankState | None, call: r.CallRecord) -> None:
        raise NotImplementedError  # Arena's

    def _unslot(self, call: r.CallRecord) -> None:
        raise NotImplementedError  # Calls's

    def _wrong_when_full(self, slot: Slot) -> bool:
        raise NotImplementedError  # Calls's

    def awaits_completion(
        self, state: RankState, call: r.CallRecord, seq_count: int, returned: float, now: float
    ) -> bool:
        raise NotImplementedError  # Device's

    def rank_for_session(self, session: str) -> RankState | None:
        raise NotImplementedError  # Registry's

    def members(self, group: str) -> tuple[int, ...]:
        raise NotImplementedError  # JobState's
