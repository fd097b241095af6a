"""A batch's calls in columns (``CallColumns`` in the proto), as every sender builds them.

``Columns`` is one list per column, for both encoders: ``CallEncoder`` here, which interns typed
records (a rank's own sender, the load generator), and ``ringwire.RingEncoder``, which reads a
rank's ring. ``CallEncoder`` keeps a bounded table from a call's fixed part to its wire id and
puts calls in columns, folding a call's exit into its entry when both are in the same batch; the
coordinator's side is ``signatures.CallDecoder``. Both tables start empty at every ``Register``.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hangwatch import records as r
from hangwatch import wire
from hangwatch.protos import hangwatch_pb2 as pb

if TYPE_CHECKING:
    from hangwatch.sendfold import SenderFold

#: Signatures one session may define. The sender evicts its least recently used one beyond this
#: (and reuses the id); the coordinator refuses definitions past it.
MAX_SIGNATURES = 4096

_NAN = float("nan")
_PER_CALL_FIELDS = ("call_id", "seq", "step", "enter_time", "exit_time", "seq_count", "error")

Key = tuple[object, ...]


def _key(c: r.CallRecord) -> Key:
    extra = tuple(sorted(c.extra.items())) if c.extra else ()
    return (c.op, c.group, c.inputs, c.outputs, c.reduce_op, c.root, c.peer, c.async_op, c.call_site, c.source, extra)


class Columns:
    """Calls being put into a batch's ``CallColumns``, one list per column (both encoders)."""

    __slots__ = (
        "counts",
        "cycle_sigs",
        "cycles",
        "enters",
        "exits",
        "ids",
        "leads",
        "per_steps",
        "run_enters",
        "run_exits",
        "runs",
        "seqs",
        "sigs",
        "steps",
    )

    def __init__(self) -> None:
        self.sigs: list[int] = []
        self.ids: list[int] = []
        self.seqs: list[int] = []
        self.steps: list[int] = []
        self.enters: list[float] = []
        self.exits: list[float] = []
        self.counts: list[int] = []
        self.runs: list[int] = []  # filled from the first run on (the proto's ``run``)
        self.run_enters: list[float] = []
        self.run_exits: list[float] = []
        self.cycles: list[int] = []  # filled from the first cycle on (the proto's ``run_cycle``)
        self.cycle_sigs: list[int] = []
        self.per_steps: list[int] = []  # filled from the first run that crosses steps on
        self.leads: list[int] = []

    def add(self, sid: int, call_id: int, seq: int, step: int, enter: float, exit_time: float, count: int) -> int:
        """Append a call (``exit_time`` NaN: still under way); its index."""
        self.sigs.append(sid)
        self.ids.append(call_id)
        self.seqs.append(seq)
        self.steps.append(step)
        self.enters.append(enter)
        self.exits.append(exit_time)
        self.counts.append(count)
        if self.runs:
            self.runs.append(1)
        if self.cycles:
            self.cycles.append(0)
        if self.per_steps:
            self.per_steps.append(0)
            self.leads.append(0)
        return len(self.ids) - 1

    def add_run(
        self,
        sid: int,
        call_id: int,
        seq: int,
        step: int,
        enters: list[float],
        exits: list[float],
        cycle: Sequence[int] = (),
        per_step: int = 0,
        lead: int = 0,
    ) -> None:
        """Append a run of alike calls (``records.CallRun``): one entry, the others' times after;
        ``cycle``: the signatures of a cycle's calls after the first in each period; ``per_step``
        and ``lead``: how its steps advance, where it crosses them."""
        i = self.add(sid, call_id, seq, step, enters[0], exits[0], 1)
        if not self.runs:
            self.runs = [1] * (i + 1)
        self.runs[i] = len(enters)
        self.run_enters.extend(enters[1:])
        self.run_exits.extend(exits[1:])
        if cycle:
            if not self.cycles:
                self.cycles = [0] * (i + 1)
            self.cycles[i] = len(cycle)
            self.cycle_sigs.extend(cycle)
        if per_step:
            if not self.per_steps:
                self.per_steps, self.leads = [0] * (i + 1), [0] * (i + 1)
            self.per_steps[i], self.leads[i] = per_step, lead

    def compact(self) -> None:
        """Fold each stretch of entries alike (one signature, call ids and seqs one apart, one
        step, each returned having issued one collective) into one entry standing for a run
        (the proto's ``run``): what ``RingEncoder`` gathers from a ring, for calls encoded from
        typed records. Entries that are runs already stay as they are."""
        if self.runs or len(self.ids) < 2:
            return
        sigs, ids, seqs, steps, enters, exits, counts = (
            self.sigs,
            self.ids,
            self.seqs,
            self.steps,
            self.enters,
            self.exits,
            self.counts,
        )
        out = Columns()
        i, n = 0, len(ids)
        while i < n:
            j = i + 1
            if counts[i] == 1 and exits[i] == exits[i]:
                while (
                    j < n
                    and sigs[j] == sigs[i]
                    and ids[j] == ids[j - 1] + 1
                    and seqs[j] == seqs[j - 1] + 1
                    and steps[j] == steps[i]
                    and counts[j] == 1
                    and exits[j] == exits[j]
                ):
                    j += 1
            if j - i >= 2:
                out.add_run(sigs[i], ids[i], seqs[i], steps[i], enters[i:j], exits[i:j])
            else:
                out.add(sigs[i], ids[i], seqs[i], steps[i], enters[i], exits[i], counts[i])
            i = j
        for name in self.__slots__:
            setattr(self, name, getattr(out, name))

    def fold_exit(self, i: int, exit_time: float, count: int) -> bool:
        """Fold an exit into call ``i`` if it is still open there; whether it was."""
        if not math.isnan(self.exits[i]):
            return False
        self.exits[i] = exit_time
        self.counts[i] = count
        return True

    def write(self, batch: pb.ReportBatch) -> None:
        if not self.ids:
            return
        cols = batch.calls
        cols.signature.extend(self.sigs)
        cols.call_id.extend(self.ids)
        cols.seq.extend(self.seqs)
        cols.step.extend(self.steps)
        cols.enter_time.extend(self.enters)
        cols.exit_time.extend(self.exits)
        cols.seq_count.extend(self.counts)
        if self.runs:
            cols.run.extend(self.runs)
            cols.run_enter.extend(self.run_enters)
            cols.run_exit.extend(self.run_exits)
        if self.cycles:
            cols.run_cycle.extend(self.cycles)
            cols.run_signature.extend(self.cycle_sigs)
        if self.per_steps:
            cols.run_per_step.extend(self.per_steps)
            cols.run_lead.extend(self.leads)


class CallEncoder:
    """The sender's side: interns calls into a batch. Not thread-safe (the sender thread owns it)."""

    def __init__(self, capacity: int = MAX_SIGNATURES) -> None:
        self.capacity = capacity
        self._ids: collections.OrderedDict[Key, int] = collections.OrderedDict()
        self._free: list[int] = []
        self._next = 1
        #: fold calls alike into runs (``Columns.compact``): the coordinator said it takes them
        self.send_runs = False
        #: fold the calls that repeat a cycle, as a node agent does (``hangwatch.sendfold``)
        self.fold: SenderFold | None = None

    def reset(self) -> None:
        """Forget every definition (after each registration: the coordinator's table is new)."""
        self._ids.clear()
        self._free.clear()
        self._next = 1
        if self.fold is not None:
            self.fold.reset()

    def __len__(self) -> int:
        return len(self._ids)

    def _intern(self, call: r.CallRecord, used: set[int], batch: pb.ReportBatch) -> int | None:
        key = _key(call)
        sid = self._ids.get(key)
        if sid is not None:
            self._ids.move_to_end(key)
            return sid
        if len(self._ids) >= self.capacity:
            victim_key, victim = next(iter(self._ids.items()))
            if victim in used:  # evicting it would change a call already in this batch
                return None
            del self._ids[victim_key]
            sid = victim
        else:
            sid = self._next
            self._next += 1
        self._ids[key] = sid
        sig = batch.signatures.add(id=sid)
        wire.call_to_pb(call, sig.call)
        for per_call in _PER_CALL_FIELDS:  # those travel in the columns
            sig.call.ClearField(per_call)
        if self.fold is not None:
            self.fold.define(sid, call)
        return sid

    def encode(self, events: Sequence[r.RankEvent], batch: pb.ReportBatch) -> None:
        """Add ``events`` to ``batch``: calls as columns, everything else as events."""
        cols = Columns()
        position: dict[int, int] = {}  # call id -> column index, for exits in the same batch
        used: set[int] = set()
        for ev in events:
            kind = type(ev)
            if kind is r.CallRecord:
                call: r.CallRecord = ev  # type: ignore[assignment]
                sid = None if call.error else self._intern(call, used, batch)
                if sid is None:
                    wire.event_to_pb(call, batch.events.add())
                    continue
                used.add(sid)
                exit_time = _NAN if call.exit_time is None else call.exit_time
                position[call.call_id] = cols.add(
                    sid, call.call_id, call.seq, call.step, call.enter_time, exit_time, call.seq_count
                )
                continue
            if kind is r.CallExit:
                done: r.CallExit = ev  # type: ignore[assignment]
                i = position.get(done.call_id)
                if i is not None and done.error is None and cols.fold_exit(i, done.exit_time, done.seq_count):
                    continue
            wire.event_to_pb(ev, batch.events.add())
        if self.send_runs:
            cols.compact()
        if self.fold is not None:
            self.fold.send(cols, batch)
        cols.write(batch)


#: The longest period of a cycle of signatures a sender gathers within a step (``ringruns``).
MAX_CYCLE = 8
