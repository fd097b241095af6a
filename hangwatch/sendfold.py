"""A node agent folds its ranks' cycles before they go, so the coordinator's work grows with
batches, not calls.

The coordinator folds calls sent one by one into runs itself (``folds``, in
``signatures.CallDecoder``): at 16,384 ranks and 50 collectives a second, a quarter of its
handler. A node agent runs the same ``folds.Folder`` on each rank's columns before sending, and
sends the runs it folds as column entries that cross steps (``CallColumns.run_per_step``), the
batch marked ``folded``; the coordinator takes them as they come. They are the runs the
coordinator would have folded, batch for batch, so the detectors see the same records. A batch
sends the steps that open its events in columns too (``steps_in_columns``), taken at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hangwatch import folds
from hangwatch import records as r
from hangwatch.columns import Columns
from hangwatch.protos import hangwatch_pb2 as pb


class SenderFold:
    """One rank link's folds on the sending side: the templates of its wire ids, as the
    coordinator's table holds them, and its ``folds.Folder``."""

    def __init__(self) -> None:
        #: wire id -> a template of its signature whose call id is the wire id (a run's
        #: templates name their entry's signatures so)
        self.table: dict[int, r.CallRecord] = {}
        self.folder = folds.Folder()

    def reset(self) -> None:
        """The coordinator's table starts empty (a registration): so does this one."""
        self.table.clear()
        self.folder = folds.Folder()

    def define(self, sid: int, call: r.CallRecord | None) -> None:
        """Wire id ``sid`` names ``call``'s signature from this batch on (None: one that cannot
        be read, which the coordinator refuses too)."""
        if sid in self.table:
            self.folder.forget()  # a cycle found of it may be another's now, as the coordinator does
        if call is None:
            self.table.pop(sid, None)
        else:
            self.table[sid] = dataclasses.replace(call, call_id=sid)

    def send(self, cols: Columns, batch: pb.ReportBatch) -> None:
        """What a node agent does to a batch before it goes: its columns folded (``fold``), the
        batch marked so, and the steps that open its events in columns."""
        self.fold(cols, batch.rank)
        batch.folded = True
        steps_in_columns(batch)

    def fold(self, cols: Columns, rank: int) -> None:
        """Fold ``cols`` where they repeat a cycle, as the coordinator would (``CallDecoder._columns``)."""
        n = len(cols.sigs)
        extra = bool(cols.runs)
        if not n or max(cols.counts) > 1 or (extra and n < 2):
            return
        columns: tuple[Sequence[Any], ...] = (
            cols.sigs, cols.ids, cols.seqs, cols.steps, cols.enters, cols.exits, cols.counts,
            cols.runs or [1] * n, cols.cycles or [0] * n,
        )  # fmt: skip
        before, rest, after, taken = self.folder.take(
            rank, self.table, columns, cols.run_enters, cols.run_exits, cols.cycle_sigs, extra
        )
        if not taken:
            return  # (nothing folded: the columns are as they came)
        out = Columns()
        for run in before:
            _add(out, run)
        for sid, cid, seq, step, enter, exit_time, count, k, _ in zip(*rest, strict=True) if rest[0] else ():
            assert k == 1, "a fold leaves calls one by one"  # (``Folder.take``: runs fold whole or not)
            out.add(sid, cid, seq, step, enter, exit_time, count)
        if after is not None:
            _add(out, after)
        for name in Columns.__slots__:
            setattr(cols, name, getattr(out, name))


def steps_in_columns(batch: pb.ReportBatch) -> None:
    """Move the steps that open ``batch``'s events into its step columns (``step_number``,
    ``step_time``): a steady rank's batch, whose steps the coordinator then takes at once. The
    coordinator applies the columns after the calls and before every event, so the steps that
    come before any other event keep their order; those after one stay events."""
    events = batch.events
    lead = 0
    for e in events:
        if not e.HasField("step"):
            break
        lead += 1
    if not lead:
        return
    batch.step_number.extend([e.step.step for e in events[:lead]])
    batch.step_time.extend([e.step.time for e in events[:lead]])
    del events[:lead]


def _add(cols: Columns, run: r.CallRun) -> None:
    """``run`` as one column entry: its templates' call ids are their wire ids (``SenderFold.table``)."""
    cycle = [t.call_id for t in run.cycle]
    cols.add_run(
        run.template.call_id, run.first_call_id, run.first_seq, run.step, run.enters, run.exits, cycle,
        run.per_step, run.lead,
    )  # fmt: skip
