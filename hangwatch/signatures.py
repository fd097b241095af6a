"""Interned calls on the wire, the coordinator's side: each rank session defines a call's fixed
part once and then sends a handful of numbers per call (``Signature`` and ``CallColumns`` in the
proto; the senders' side is ``hangwatch.columns``).

A training loop repeats the same few dozen calls (same op, group, tensors, call site) millions of
times; only the id, seq, step and times change. The coordinator (:class:`CallDecoder`, one per
session) keeps the ids it was told and rebuilds ordinary :class:`~hangwatch.records.CallRecord`
objects (and runs of them, ``records.CallRun``), so nothing past this module sees the
difference. Its table starts empty at every ``Register``, as the sender's does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from hangwatch import folds, wire
from hangwatch import records as r
from hangwatch.columns import MAX_SIGNATURES
from hangwatch.protos import hangwatch_pb2 as pb

#: Tensor lists and extras shared by every session's signatures (ranks of one job make the same
#: calls): one object each, so comparing two ranks' calls is mostly an identity check.
_SHARED: dict[object, object] = {}
MAX_SHARED = 65536


#: Only lists this small are shared (a call's usual few tensors): the table holds a bounded
#: number of bounded values, whatever a client sends.
SHARED_TENSORS = 8
SHARED_DIMS = 8


def _shared(value: Any) -> Any:
    found = _SHARED.get(value)
    if found is not None:
        return found
    if (
        len(_SHARED) < MAX_SHARED
        and len(value) <= SHARED_TENSORS
        and all(len(m.shape) <= SHARED_DIMS and len(m.dtype) <= 32 and len(m.device) <= 32 for m in value)
    ):
        _SHARED[value] = value
    return value


#: Signatures as decoded once, by their bytes, for every session: a job's ranks define the same
#: calls, all in their first steps (16 each at 16,384 ranks: 262,144 at once). A rank's template
#: is a copy with its rank; what the budget charges it is worked out once. Only short ones are
#: kept, and the cache starts again when full: a session's signatures cost another none.
_DECODED: dict[bytes, tuple[r.CallRecord, Callable[[r.CallRecord], int] | None, int]] = {}
MAX_DECODED = 4096
DECODED_BYTES = 512


def _template(rank: int, msg: pb.Call, cost: Callable[[r.CallRecord], int] | None) -> r.CallRecord:
    """The template of a signature's call for ``rank``, its ``cost`` set (raises as
    ``wire.call_from_pb`` does)."""
    key = msg.SerializeToString()
    known = _DECODED.get(key)
    if known is not None and known[1] is cost:
        t = known[0]
        template = r.CallRecord(
            rank, t.call_id, t.op, t.group, t.seq, t.inputs, t.outputs, t.reduce_op, t.root, t.peer, t.async_op,
            t.step, t.call_site, t.enter_time, t.exit_time, t.source, t.error, t.seq_count, t.extra,
        )  # fmt: skip
        template.cost = known[2]
        return template
    template = wire.call_from_pb(rank, msg)
    template.cost = cost(template) if cost is not None else 0
    if len(key) <= DECODED_BYTES:
        if len(_DECODED) >= MAX_DECODED:
            _DECODED.clear()
        _DECODED[key] = (dataclasses.replace(template, rank=-1), cost, template.cost)
    return template


#: Calls a batch's runs may stand for beyond their entries (``CallColumns.run``): a batch of
#: more is refused whole, as a batch whose columns do not line up is.
MAX_RUN_CALLS = 1 << 20
#: The longest period a batch's run may be (``CallColumns.run_cycle``, plus one): a node agent's
#: folds are of up to a step of ``folds.MAX_FOLD`` calls.
MAX_WIRE_CYCLE = folds.MAX_FOLD


def _call_of(rank: int, t: r.CallRecord, cid: int, seq: int, step: int, enter: float, exit_time: float) -> r.CallRecord:
    """A completed call of template ``t`` (as ``CallDecoder._columns`` makes one that came alone)."""
    return r.CallRecord(
        rank, cid, t.op, t.group, seq, t.inputs, t.outputs, t.reduce_op, t.root, t.peer, t.async_op, step,
        t.call_site, enter, exit_time, t.source, None, 1, t.extra, None, t.cost,
    )  # fmt: skip


def _steps_line_up(cols: pb.CallColumns, runs: list[int]) -> bool:
    """Whether each entry's steps (``run_per_step``, ``run_lead``) are a run's that crosses them."""
    pers, leads = cols.run_per_step, cols.run_lead
    if len(pers) != len(runs) or len(leads) != len(runs):
        return False
    for p, q, k in zip(pers, leads, runs, strict=True):
        if (p or q) and not (k > 1 and q < p <= MAX_RUN_CALLS):
            return False
    return True


class CallDecoder:
    """The coordinator's side for one rank session: its signature table."""

    def __init__(
        self,
        capacity: int = MAX_SIGNATURES,
        *,
        cost: Callable[[r.CallRecord], int] | None = None,
        charge: Callable[[int], bool] | None = None,
        fold: bool = False,
    ) -> None:
        """``cost`` sizes a signature in bytes and ``charge(n)`` asks for ``n`` more (negative:
        gives back) from the coordinator's memory budget; a signature it refuses is rejected."""
        self.capacity = capacity
        self.table: dict[int, r.CallRecord] = {}
        self.cost = cost
        self.charge = charge
        self.bytes = 0  # what the table holds, as charged
        #: folds calls that repeat a cycle into runs (``hangwatch.folds``); None: does not
        self.folder = folds.Folder() if fold else None

    def decode(self, rank: int, batch: pb.ReportBatch) -> tuple[list[r.RankEvent], int, int]:
        """Records in the order the coordinator applies them (see the proto), the number of
        entries rejected (malformed, or naming an undefined signature), and the number of exits
        folded into column entries (counted as accepted events)."""
        rejected = 0
        if self.folder is not None and any(sig.id in self.table for sig in batch.signatures):
            self.folder.forget()  # an id redefined: a cycle found of it may be another's now
        for sig in batch.signatures:
            if sig.id not in self.table and len(self.table) >= self.capacity:
                rejected += 1
                continue
            try:
                template = _template(rank, sig.call, self.cost)
            except (wire.WireError, ValueError, OverflowError):
                self._drop(sig.id)
                rejected += 1
                continue
            self._drop(sig.id)
            if self.cost is not None and self.charge is not None:
                if not self.charge(template.cost):
                    rejected += 1
                    continue
                self.bytes += template.cost
            template.inputs = _shared(template.inputs)  # only once admitted
            template.outputs = _shared(template.outputs)
            self.table[sig.id] = template
        first: list[r.RankEvent] = []
        rest: list[r.RankEvent] = []
        in_columns: set[int] | None = None  # call ids in this batch's columns, built on the first exit
        for msg in batch.events:
            if msg.HasField("step"):  # (a few in each batch: taken here, as ``wire.step_from_pb`` takes them)
                step = msg.step
                t = step.time
                if t - t != 0:  # NaN or infinity: no time
                    rejected += 1
                else:
                    rest.append(r.StepEvent(rank, step.step, t))
                continue
            try:
                ev = wire.event_from_pb(rank, msg)
            except (wire.WireError, ValueError, OverflowError):
                rejected += 1
                continue
            kind = type(ev)
            if kind is r.GroupEvent and ev.kind is r.GroupEventKind.CREATED:  # type: ignore[union-attr]
                first.append(ev)
            elif kind is r.CallExit:
                if in_columns is None:
                    in_columns = set(batch.calls.call_id)
                # an exit of a call from an earlier batch: it ended before this batch's calls began
                (rest if ev.call_id in in_columns else first).append(ev)  # type: ignore[union-attr]
            else:
                rest.append(ev)
        calls, bad, folded = self._columns(rank, batch.calls, batch.folded)
        times: Sequence[float] = batch.step_time
        if times or batch.step_number:  # the steps that opened its events (a node agent's)
            numbers: Sequence[int] = batch.step_number
            if len(numbers) != len(times):
                bad += max(len(numbers), len(times))
            else:
                if not math.isfinite(sum(times)):  # a step without a time: that step alone is refused
                    kept = [(n, t) for n, t in zip(numbers, times, strict=True) if t - t == 0]
                    bad += len(times) - len(kept)
                    numbers, times = [n for n, _ in kept], [t for _, t in kept]
                if numbers:
                    calls.append(r.Steps(rank, tuple(numbers), tuple(times)))
        return first + calls + rest, rejected + bad, folded

    @staticmethod
    def _one_by_one(
        rank: int,
        templates: tuple[r.CallRecord | None, ...],
        cid: int,
        seq: int,
        step: int,
        per: int,
        leads: Sequence[int],
        entry: int,
        enters: list[float],
        exits: list[float],
    ) -> list[r.RankEvent]:
        """The calls of a cycle's run whose signatures are known, each alone (none where they
        are not on one group or their times are not finite)."""
        known = [t for t in templates if t is not None]
        if not known or any(t.group != known[0].group for t in known) or not math.isfinite(sum(enters) + sum(exits)):
            return []
        lead = leads[entry] if per else 0
        out: list[r.RankEvent] = []
        for i, (enter, exit_time) in enumerate(zip(enters, exits, strict=True)):
            t = templates[i % len(templates)]
            if t is not None:
                at_step = step + (lead + i) // per if per else step
                out.append(_call_of(rank, t, cid + i, seq + i, at_step, enter, exit_time))
        return out

    def _drop(self, sid: int) -> None:
        old = self.table.pop(sid, None)
        if old is not None and old.cost and self.charge is not None:
            self.bytes -= old.cost
            self.charge(-old.cost)

    def release(self) -> None:
        """Give back everything the table holds (its session is over)."""
        if self.bytes and self.charge is not None:
            self.charge(-self.bytes)
        self.bytes = 0
        self.table.clear()
        if self.folder is not None:
            self.folder.forget()

    def _columns(self, rank: int, cols: pb.CallColumns, sent_folded: bool) -> tuple[list[r.RankEvent], int, int]:
        n = len(cols.signature)
        if not n:
            return [], 0, 0
        lengths = {len(cols.call_id), len(cols.seq), len(cols.step), len(cols.enter_time), len(cols.exit_time)}
        counts = list(cols.seq_count) or [1] * n
        runs = list(cols.run) or [1] * n
        cycles = list(cols.run_cycle) or [0] * n
        # (no runs, no cycles: a batch of calls one by one, as most are; nothing to add up)
        extra = sum(k - 1 for k in runs if k > 1) if cols.run else 0
        if (
            lengths != {n}
            or len(counts) != n
            or len(runs) != n
            or len(cycles) != n
            or extra > MAX_RUN_CALLS
            or len(cols.run_enter) != extra
            or len(cols.run_exit) != extra
            or (cols.run_cycle and any(c and (k < 2 or c >= MAX_WIRE_CYCLE) for c, k in zip(cycles, runs, strict=True)))
            or len(cols.run_signature) != (sum(cycles) if cols.run_cycle else 0)
            or (cols.run_per_step and not _steps_line_up(cols, runs))
        ):
            return [], n, 0  # columns that do not line up cannot be trusted at all
        table = self.table
        calls: list[r.RankEvent] = []
        rejected = folded = 0
        columns: tuple[Sequence[Any], ...] = (
            cols.signature, cols.call_id, cols.seq, cols.step, cols.enter_time, cols.exit_time, counts, runs, cycles
        )  # fmt: skip
        after: r.CallRun | None = None  # a run after the calls that go one by one
        pers, leads = cols.run_per_step, cols.run_lead  # (runs that cross steps: a node agent's folds)
        sent_folded = sent_folded or bool(pers)  # (``folds.expand`` knows no steps in a run)
        if self.folder is not None and not sent_folded and max(counts) <= 1 and (not extra or n > 1):
            before, columns, after, taken = self.folder.take(
                rank, table, columns, cols.run_enter, cols.run_exit, cols.run_signature, bool(extra)
            )
            calls += before
            folded += taken
        record = r.CallRecord
        at = 0  # the next of a run's other calls' times
        cat = 0  # the next of a cycle's other signatures
        entry = -1
        for sid, cid, seq, step, enter, exit_time, count, k, c in zip(*columns, strict=True) if columns[0] else ():
            entry += 1
            t = table.get(sid)
            done = exit_time == exit_time  # not NaN: NaN marks a call still under way
            if k > 1:
                enters = [enter, *cols.run_enter[at : at + k - 1]]
                exits = [exit_time, *cols.run_exit[at : at + k - 1]]
                at += k - 1
                sids = (sid, *cols.run_signature[cat : cat + c]) if c else (sid,)
                cat += c
                per = pers[entry] if pers else 0
                # its rank's cycle, as a fold here finds it: its templates the table's, on one group
                made = self.folder.shape(table, sids) if self.folder is not None and (c or per) else None
                cycle: tuple[r.CallRecord, ...] = ()
                if made is not None:
                    t, cycle = made[2][0], made[2][1:]
                elif c:
                    found = [table.get(x) for x in sids[1:]]
                    if t is None or None in found:
                        # a signature this table refused (its budget, a full table): the calls of
                        # the others come one by one, as where the coordinator folds
                        made_one = self._one_by_one(rank, (t, *found), cid, seq, step, per, leads, entry, enters, exits)
                        rejected += k - len(made_one) if count <= 1 else k
                        if count <= 1:
                            calls += made_one
                            folded += len(made_one)
                        continue
                    if any(x.group != t.group for x in found):  # type: ignore[union-attr]
                        rejected += k  # a cycle is of signatures on one group, or not taken
                        continue
                    cycle = tuple(found)  # type: ignore[arg-type]  # (None ruled out above)
                if t is None or not math.isfinite(sum(enters) + sum(exits)) or count > 1:  # (NaN, inf: not)
                    rejected += k  # a run is whole (complete, finite, one seq each) or not taken
                    continue
                folded += k
                run = r.CallRun(rank, t, cid, seq, step, enters, exits, cycle=cycle)
                if per:
                    run.per_step, run.lead = per, leads[entry]
                if made is not None:
                    run.shape, run.turn = made[0], made[1]
                calls.append(run)
                continue
            if t is None or enter - enter != 0 or (done and exit_time - exit_time != 0):  # infinite times
                rejected += 1
                continue
            folded += done
            calls.append(
                record(
                    rank,
                    cid,
                    t.op,
                    t.group,
                    seq,
                    t.inputs,
                    t.outputs,
                    t.reduce_op,
                    t.root,
                    t.peer,
                    t.async_op,
                    step,
                    t.call_site,
                    enter,
                    exit_time if done else None,
                    t.source,
                    None,
                    count or 1,
                    t.extra,
                    None,
                    t.cost,  # what its template's strings and tensors take (the budget's charge)
                )
            )
        if after is not None:
            calls.append(after)
        return calls, rejected, folded
