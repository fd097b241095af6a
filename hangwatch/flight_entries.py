"""Flight Recorder entries become hangwatch records, for whoever reads the ring.

torch's Flight Recorder keeps a ring of the collectives each process group issued, numbered by
the group's own collective sequence id, whether Python or C++ issued them (DDP's gradient
buckets, FSDP, functional collectives). The hook's own records already cover the collectives
issued from Python, with richer facts (call site, step, outputs); an entry becomes a record
only when no Python call covers its (group, seq), so the two sources line up on one sequence
and nothing is reported twice.

Two readers use this, with the same result: the node agent, which pulls the ring through the
rank's worker server from outside the process (``hangwatch.agent.flightrecorder``) and knows
which seqs Python calls covered from the records it reads out of the rank's ring
(:class:`PythonSeqs`); and, where no agent runs, the rank's own sender thread
(``hangwatch.client.flight_recorder``), which asks the recorder.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from hangwatch import records as r
from hangwatch.catalogue import FR_OP_NAMES

#: Flight Recorder's dtype spellings (c10's ScalarType names) -> torch's.
FR_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Int": "int32",
    "Long": "int64",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}

#: Covered seq ranges kept per group (older ones are below every entry a ring still holds).
KEEP_RANGES = 4096


#: Call ids from :func:`entry_call_id` have this bit set; a rank's own counter never reaches it.
ENTRY_CALL_IDS = 1 << 62


def entry_call_id(group: str, seq: int) -> int:
    """The call id of the record made from (group, seq)'s entry, by whoever makes it, however
    often: far above any id a rank's own counter reaches (bit 62 set), and the same each time,
    so a record made again (an agent restarted, a ring read anew) is the same record."""
    return ENTRY_CALL_IDS | (zlib.crc32(group.encode()) << 30) | (seq & ((1 << 30) - 1))


class Coverage(Protocol):
    """Which collective seqs of a group Python calls account for."""

    def covers(self, group: str, seq: int) -> bool: ...

    def newest(self, group: str) -> int:
        """The highest collective seq a finished Python call issued on ``group`` (0: none)."""
        ...


class PythonSeqs:
    """Coverage kept from the hook's records. A finished call covers the ``issued`` seqs it used
    from its first (a coalesced call uses many). A call under way covers its first seq, and a
    synchronous one every seq from it on (the thread is inside it; a coalesced call's later seqs
    appear before it returns); an async call returns at once and completes later, so it covers
    its first seq only until its completion says how many it used. A synchronous call entered
    on a group ends the older synchronous ones still open there (their exits were lost)."""

    def __init__(self, keep: int = KEEP_RANGES) -> None:
        self._keep = keep
        self._ranges: dict[str, collections.deque[tuple[int, int]]] = {}
        self._open: dict[str, dict[int, tuple[int, bool]]] = {}  # group -> call id -> (seq, async)
        self._groups: dict[int, str] = {}  # open call id -> its group
        #: the collectives finished calls issued, however told (``exited``, ``ran``): what the
        #: rank's ring gained from Python (an exit of a call not known here counts one)
        self.finished = 0
        self.created: set[str] = set()  # groups the rank said it created and has not destroyed
        self.destroyed: set[str] = set()  # and those it destroyed

    def entered(self, call_id: int, group: str, seq: int, async_op: bool = False) -> None:
        here = self._open.setdefault(group, {})
        if not async_op:
            for other in [c for c, (_, was_async) in here.items() if not was_async]:
                del here[other]
                self._groups.pop(other, None)
        here[call_id] = (seq, async_op)
        self._groups[call_id] = group
        if len(self._groups) > self._keep:  # exits lost (the ring overflowed): forget the oldest
            oldest = next(iter(self._groups))
            self._open.get(self._groups.pop(oldest), {}).pop(oldest, None)

    def busy_on(self, group: str) -> bool:
        """Whether an op under way on ``group`` may be a Python call's: one is open there. (A p2p
        op never shows as under way in gloo's counters, which ``EntryTracker`` asks this for:
        an isend, an irecv, a batch of them waiting on their peer leave ``last_enqueued`` and
        ``last_completed`` as they were, torch 2.13.)"""
        return bool(self._open.get(group))

    def exited(self, call_id: int, issued: int) -> None:
        self.finished += max(issued, 1)
        group = self._groups.pop(call_id, None)
        if group is None:
            return
        opened = self._open.get(group, {}).pop(call_id, None)
        if opened is None:
            return
        self._cover(group, opened[0], opened[0] + max(issued, 1) - 1)

    def ran(self, group: str, lo: int, hi: int) -> None:
        """Synchronous calls that began and finished one after another covered ``lo`` to ``hi``
        (a run of them: ``records.CallRun``), as their ``entered`` and ``exited`` would say."""
        here = self._open.get(group)
        if here:
            for other in [c for c, (_, was_async) in here.items() if not was_async]:
                del here[other]
                self._groups.pop(other, None)
        self.finished += hi - lo + 1
        self._cover(group, lo, hi)

    def _cover(self, group: str, lo: int, hi: int) -> None:
        ranges = self._ranges.get(group)
        if ranges is None:
            ranges = self._ranges[group] = collections.deque(maxlen=self._keep)
        if ranges and ranges[-1][1] == lo - 1:
            ranges[-1] = (ranges[-1][0], hi)  # one range for calls that follow on
        else:
            ranges.append((lo, hi))

    def told(self, group: str, created: bool) -> None:
        """The rank created (or destroyed) ``group``."""
        if created:
            self.created.add(group)
            self.destroyed.discard(group)
        else:
            self.created.discard(group)
            self.destroyed.add(group)

    def async_open(self) -> bool:
        """Whether an async call is under way (it may issue more than its first seq)."""
        return any(async_op for calls in tuple(self._open.values()) for _, async_op in tuple(calls.values()))

    def groups(self) -> tuple[str, ...]:
        """The groups finished calls covered seqs on."""
        return tuple(self._ranges)

    def _open_covers(self, group: str, seq: int) -> bool:
        for start, async_op in tuple(self._open.get(group, {}).values()):
            if start == seq or (start < seq and not async_op):
                return True
        return False

    def covers(self, group: str, seq: int) -> bool:
        if self._open_covers(group, seq):
            return True
        return any(lo <= seq <= hi for lo, hi in reversed(tuple(self._ranges.get(group, ()))))

    def newest(self, group: str) -> int:
        ranges = self._ranges.get(group)
        return ranges[-1][1] if ranges else 0

    def covers_all(self, group: str, lo: int, hi: int) -> bool:
        """Whether Python calls surely account for every seq from ``lo`` to ``hi`` on ``group``:
        finished calls' ranges and the first seq of calls under way only (whatever else a call
        under way may cover is not known yet). False when unsure: the answer only saves a read.
        Read from another thread than the one that updates it: snapshots, and any error is
        the caller's "unsure"."""
        if hi < lo:
            return True
        firsts = {start for start, _ in tuple(self._open.get(group, {}).values())}
        need = hi
        ranges = list(reversed(tuple(self._ranges.get(group, ()))))
        i = 0
        while need >= lo:
            if need in firsts:
                need -= 1
                continue
            while i < len(ranges) and ranges[i][0] > need:
                i += 1
            if i == len(ranges) or ranges[i][1] < need:
                return False  # a seq no Python call is known to have issued: C++ did, or may have
            need = ranges[i][0] - 1
        return True


def _cpu_record_id(entry: Any) -> int:
    """The ``record_id`` of a CPU ring entry (-1: a NCCL ring's, which numbers its own, or none)."""
    try:
        if str(entry.get("profiling_name", "")).startswith("nccl"):
            return -1
        return int(entry["record_id"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return -1


class EntryTracker:
    """Turns successive reads of one rank's ring(s) into records: a CallRecord for each entry no
    Python call covers (once), and its CallExit once the entry is retired or completed, or a
    later collective exists on its group (collectives of a group complete in order, and Flight Recorder keeps
    works alive past completion). ``new_call_id(group, seq)`` numbers the records in the rank's
    call-id space (default :func:`entry_call_id`). Entries that cannot be read (a newer torch's
    schema, a corrupt ring) are counted in ``skipped`` and passed over."""

    def __init__(self, rank: int, new_call_id: Callable[[str, int], int] = entry_call_id) -> None:
        self.rank = rank
        self._new_call_id = new_call_id
        self._seen: dict[str, int] = {}  # group -> highest collective seq handled
        self._open: dict[tuple[str, int], r.CallRecord] = {}  # reported, not yet seen retired
        #: each open record's group's enqueued count (``pg_status``) at the read that made it
        self._marks: dict[tuple[str, int], int] = {}
        self.skipped = 0
        #: reads in a row that held entries and no collective Python calls did not cover
        self.clean = 0
        self.held = 0  # the most CPU ring entries a read held: its size, once it has filled
        self.finished_at = 0  # the Python calls finished (``PythonSeqs.finished``) when the last read was handled
        self.reported = 0
        #: CPU ring entries overwritten before any read held them (torch numbers a ring's entries
        #: in one sequence: ``record_id``)
        self.lost = 0
        #: groups the rank is inside an op of that no read showed (:meth:`_unseen`), each with its
        #: completed count when that was found
        self.unseen: dict[str, int] = {}
        self._next_id = 0  # one past the newest record id any read held
        #: ``_next_id`` after the last read that held CPU entries: torch numbers a ring's entries
        #: from 0, so a first read that holds none below its first id shows entries lost too
        self._read_to = 0

    def skip_existing(self, entries: Iterable[Any]) -> None:
        """Take every entry of ``entries`` as handled: a reader that starts late (a rank whose
        agent, which read them, went away) reports only what comes after."""
        for entry in entries:
            try:
                group, seq = str((entry.get("process_group") or [""])[0]), int(entry.get("collective_seq_id") or 0)
            except (AttributeError, TypeError, ValueError, IndexError):
                continue
            if seq > self._seen.get(group, 0):
                self._seen[group] = seq
            self._next_id = self._read_to = max(self._next_id, _cpu_record_id(entry) + 1)

    def update(
        self,
        entries: Iterable[Any],
        coverage: Coverage,
        step: int,
        now: float,
        status: Mapping[str, tuple[int, int]] | None = None,
        busy: Callable[[str], bool] | None = None,
    ) -> list[r.RankEvent]:
        """The records one read of the rings makes (see the class). ``status``: the CPU ring's
        groups' ``(last_enqueued, last_completed)`` counters at that read, and ``busy``, whether
        an op under way on a group may be a Python call's: with them the tracker keeps
        :attr:`unseen` (:meth:`_unseen`)."""
        out: list[r.RankEvent] = []
        newest: dict[str, int] = {}
        pending: set[str] = set()  # groups with an entry of the CPU ring under way in this read
        held = 0
        first_id = -1
        for entry in entries:  # a record made and closed in one read travels complete: the
            # coordinator applies a batch's exits before its calls
            if not (isinstance(entry, dict) and str(entry.get("profiling_name", "")).startswith("nccl")):
                held += 1  # the CPU ring's (a NCCL ring is read through its own probe)
                record_id = _cpu_record_id(entry)
                if record_id >= 0:
                    first_id = record_id if first_id < 0 else min(first_id, record_id)
                    self._next_id = max(self._next_id, record_id + 1)
                    if not entry.get("retired") and not entry.get("is_p2p"):
                        pending.add(str((entry.get("process_group") or [""])[0]))
            try:
                self._handle(entry, coverage, step, now, newest, out)
            except (AttributeError, TypeError, ValueError, IndexError, KeyError):
                self.skipped += 1  # one malformed entry: skip it, keep the others
        made = {id(e) for e in out if isinstance(e, r.CallRecord)}
        counters = status or {}
        for key in self._open.keys() - self._marks.keys():  # the group's enqueued count when first seen open
            if key[0] in counters:
                self._marks[key] = counters[key[0]][0]
        # A record whose entry was overwritten before a read showed it retired is closed by the
        # group's counters: once they say nothing is under way, or that the group completed as
        # far as it had enqueued when the record was made (gloo completes a group's ops in order;
        # the rank may be inside a later one, DDP's bucket all-reduce after its constructor's).
        idle = {g for g, (enqueued, completed) in counters.items() if enqueued <= completed} - pending
        for key, record in list(self._open.items()):
            group, seq = key
            mark = self._marks.get(key)
            if (
                newest.get(group, 0) > seq
                or coverage.newest(group) > seq
                or group in idle
                or (mark is not None and group in counters and counters[group][1] >= mark)
            ):
                del self._open[key]
                self._marks.pop(key, None)
                if id(record) in made:
                    record.exit_time = now  # made in this read: it travels complete
                else:
                    out.append(r.CallExit(self.rank, record.call_id, now, None, 1))
        if newest:  # a read that held collectives: were they all Python's, and all done?
            self.clean = 0 if made or self._open else self.clean + 1
        self.held = max(self.held, held)
        self.finished_at = int(getattr(coverage, "finished", 0))
        if status is not None and busy is not None:
            gap = first_id > self._read_to
            if gap:
                self.lost += first_id - self._read_to
            self._unseen(status, busy, pending, gap)
        if first_id >= 0 or held:
            self._read_to = self._next_id
        return out

    def _unseen(
        self,
        status: Mapping[str, tuple[int, int]],
        busy: Callable[[str], bool],
        pending: set[str],
        gap: bool,
    ) -> None:
        """Groups with an op under way that no entry of the read shows, no Python call explains,
        and whose entry the CPU ring overwrote before it was read (``gap``: entries were lost
        since the last read): the rank is inside a collective C++ issued there (DDP's bucket
        all-reduce while a metrics thread's calls fill the ring), which no read will ever show.
        Kept while the group's completed count stands still; the coordinator then does not take
        the rank for absent from the group's collectives."""
        for group in list(self.unseen):
            counts = status.get(group)
            if counts is None or counts[1] != self.unseen[group] or counts[0] <= counts[1]:
                del self.unseen[group]
        for group, (enqueued, completed) in status.items():
            if (
                gap
                and enqueued > completed
                and group not in self.unseen
                and group not in pending
                and not busy(group)
                and len(self.unseen) < MAX_UNSEEN
            ):
                self.unseen[group] = completed

    def seen(self) -> dict[str, int]:
        """Each group's highest collective seq the reads held (a snapshot: other threads ask)."""
        return dict(tuple(self._seen.items()))

    def _handle(
        self,
        entry: dict[str, Any],
        coverage: Coverage,
        step: int,
        now: float,
        newest: dict[str, int],
        out: list[r.RankEvent],
    ) -> None:
        if entry.get("is_p2p"):
            return  # NCCL records p2p ops with the last collective's seq: not a collective
        seq = int(entry.get("collective_seq_id") or 0)
        if seq <= 0:
            return
        pg = entry.get("process_group") or ["", ""]
        group = str(pg[0])
        newest[group] = max(newest.get(group, 0), seq)
        key = (group, seq)
        done = bool(entry.get("retired")) or entry.get("state") == "completed"
        if seq <= self._seen.get(group, 0):
            record = self._open.get(key)
            if record is not None and done:
                del self._open[key]
                self._marks.pop(key, None)
                out.append(r.CallExit(self.rank, record.call_id, now, None, 1))
            return
        self._seen[group] = seq
        if coverage.covers(group, seq):
            return
        name = str(entry.get("profiling_name", ""))
        short = name.split(":", 1)[-1]
        dtypes = [FR_DTYPES.get(d, str(d).lower()) for d in entry.get("input_dtypes", [])]
        inputs = tuple(
            r.TensorMeta(tuple(map(int, shape)), dtypes[i] if i < len(dtypes) else "", "")
            for i, shape in enumerate(entry.get("input_sizes", []))
        )
        created = float(entry.get("time_created_ns", 0)) / 1e9 or now
        op = FR_OP_NAMES.get(short, short or "unknown")
        if op == "all_to_all" and len(inputs) == 1:
            # NCCL's ring names all_to_all_single "all_to_all" too: one tensor, not a list of one
            op = "all_to_all_single"
        record = r.CallRecord(
            rank=self.rank,
            call_id=self._new_call_id(group, seq),
            op=op,
            group=group,
            seq=seq,
            inputs=inputs,  # outputs are flattened by Flight Recorder: not comparable, not sent
            step=step,
            call_site=f"issued from C++ ({name})",
            enter_time=created,
            source="flight_recorder",
        )
        self.reported += 1
        if done:  # retired (CPU ring), or completed on its stream (NCCL ring)
            record.exit_time = now  # one record, complete (not a record and a separate exit)
        else:
            self._open[key] = record
        out.append(record)


#: Groups :attr:`EntryTracker.unseen` holds at most (a rank has few groups with an op under way).
MAX_UNSEEN = 64

#: Reads in a row that found every collective Python's, none under way, before a read of the
#: rank's CPU ring may be spared (:class:`PythonAccounts`).
CLEAN_READS = 3


class PythonAccounts:
    """Asked before each read of a rank's CPU Flight Recorder ring, which torch 2.13's worker
    server serialises whole, every entry, however little of it is new (milliseconds of the rank's
    CPU for a full ring: BENCHMARKS.md): do the rank's Python calls alone surely account
    for all the ring gained since it was last asked, so that reading it would find nothing?
    Yes only where:

    - the last ``CLEAN_READS`` reads found every collective covered by a Python call and none
      under way (a job whose C++ issues collectives, DDP's buckets, is never spared);
    - on every group the rank has (those it said it created, those its calls and the ring
      showed; not those it destroyed), Python calls finished since it was last asked: a rank
      inside one collective, or in none, is read (it may hang there, or C++ may be at work), and
      so is one whose main thread waits inside a collective C++ issued while another thread's
      Python calls go on elsewhere (a group that makes no progress in Python may be C++'s);
    - no async call is under way (it may issue more than its first seq);
    - on every group, the seqs Python calls covered since the highest the reads held follow on
      without a gap (a gap is a collective C++ issued);
    - the ring has not gained half its size since it was last read (counted in the collectives
      Python's calls issued: an object collective issues two), where a read every poll still
      sees every entry it gains (fewer a poll than the ring holds). Where the ring turns over
      between two polls anyway, reading each poll would only see more of what no read sees
      whole, and sparing goes on.

    What a "yes" can cost: a collective C++ issued between two Python calls on a group is read
    at the poll after the second (the gap), as it would be without sparing; the reader reads
    the ring whole at least every ``WHOLE_READ_EVERY_S`` whatever this says. Called from the
    reader's thread: it works on snapshots, and the reader takes any error for a "no"."""

    def __init__(self, tracker: EntryTracker, python: PythonSeqs) -> None:
        self._tracker = tracker
        self._python = python
        self._finished = 1 << 62  # nothing finished since it was last asked, the first time
        self._newest: dict[str, int] = {}  # each group's newest Python seq when it was last asked

    def __call__(self) -> bool:
        python, tracker = self._python, self._tracker
        finished = python.finished
        polled, self._finished = finished - self._finished, finished  # collectives since it was last asked
        seen = tracker.seen()
        groups = (set(seen) | set(python.groups()) | set(python.created)) - set(python.destroyed)
        newest = {group: python.newest(group) for group in groups}
        before, self._newest = self._newest, newest
        if tracker.clean < CLEAN_READS or polled <= 0 or python.async_open():
            return False
        if any(newest[group] <= before.get(group, 0) for group in groups):
            return False  # a group with no Python progress since: C++ may be at work there
        if finished - tracker.finished_at >= tracker.held // 2 and polled < tracker.held:
            return False  # read it before it turns over
        return all(python.covers_all(group, seen.get(group, 0) + 1, newest[group]) for group in groups)
