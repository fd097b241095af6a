"""Calls sent one by one that repeat a cycle come out of the decoder as one run (``hangwatch.folds``)
that makes every call exactly as it was sent; anything that breaks the cycle comes as it was."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch import folds
from hangwatch import records as r
from hangwatch.columns import CallEncoder
from hangwatch.diagnosis.state import JobState
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.sendfold import SenderFold
from hangwatch.signatures import CallDecoder

RANK = 3
LAYERS = 8


def _call(
    i: int, layer: int, step: int, width: int | None = None, op: str = "", async_op: bool = False
) -> r.CallRecord:
    """Call ``i`` (id and seq ``i + 1``): FSDP's gather in a layer's forward, its scatter in the backward."""
    forward = (not op and layer < LAYERS) or op == "all_gather_into_tensor"
    shard = width or 4096 + 512 * layer
    return r.CallRecord(
        RANK, i + 1, op or ("all_gather_into_tensor" if forward else "reduce_scatter_tensor"), "0", i + 1,
        (r.TensorMeta((shard,), "bfloat16"),), (r.TensorMeta((shard * 4,), "bfloat16"),),
        None if forward else "sum", None, None, async_op, step, f"fsdp.py:{120 + layer} in forward",
        100.0 + i, 100.0 + i + 0.5,
    )  # fmt: skip


def _fsdp(n: int, start: int = 0, per: int = 2 * LAYERS) -> list[r.CallRecord]:
    return [_call(i, i % (2 * LAYERS), i // per) for i in range(start, start + n)]


def _batches(
    calls: list[r.CallRecord], cuts: list[int], runs: bool = False, fold: bool = False
) -> list[pb.ReportBatch]:
    enc = CallEncoder()
    enc.send_runs = runs  # a sender that gathers runs (within a step)
    enc.fold = SenderFold() if fold else None  # a node agent that folds its ranks' cycles
    out, lo = [], 0
    for hi in [*cuts, len(calls)]:
        batch = pb.ReportBatch(rank=RANK)
        enc.encode(calls[lo:hi], batch)
        out.append(batch)
        lo = hi
    return out


def _decoded(batches: list[pb.ReportBatch], fold: bool) -> tuple[list[tuple[object, ...]], list[r.RankEvent]]:
    dec = CallDecoder(fold=fold)
    made: list[tuple[object, ...]] = []
    events: list[r.RankEvent] = []
    for batch in batches:
        got, rejected, _ = dec.decode(RANK, batch)
        assert rejected == 0
        events += got
        for ev in got:
            calls = ev.calls() if isinstance(ev, r.CallRun) else [ev]
            made += [_fields(c) for c in calls if isinstance(c, r.CallRecord)]
    return made, events


def _fields(c: r.CallRecord) -> tuple[object, ...]:
    return (c.call_id, c.op, c.group, c.seq, c.inputs, c.outputs, c.reduce_op, c.root, c.async_op, c.step,
            c.call_site, c.enter_time, c.exit_time, c.seq_count, c.extra)  # fmt: skip


def test_a_batch_of_fsdp_steps_is_one_run_that_makes_every_call_as_sent() -> None:
    calls = _fsdp(45, start=5)  # from the middle of a step, across three more
    made, events = _decoded(_batches(calls, []), fold=True)
    runs = [ev for ev in events if isinstance(ev, r.CallRun)]
    assert len(events) == 1 and len(runs) == 1
    run = runs[0]
    assert (len(run.templates), run.per_step, run.lead, run.step, run.last_step) == (16, 16, 5, 0, 3)
    assert made == [_fields(c) for c in calls]


def test_batches_of_less_than_two_periods_fold_once_the_cycle_is_seen() -> None:
    """Ten calls a batch (a rank's 2 s at 5 collectives a second): the first, ten calls each
    another, is a run of its own; the second finds the cycle with the first leading in (a period
    and ``FOLD_MIN`` calls more), and every later one is a run taking up where the last ended."""
    calls = _fsdp(200)
    batches = _batches(calls, list(range(10, 200, 10)))
    made, events = _decoded(batches, fold=True)
    assert made == [_fields(c) for c in calls]
    kinds = ["run" if isinstance(ev, r.CallRun) else "call" for ev in events]
    assert kinds == ["run"] * 20
    assert [len(ev.templates) for ev in events[:3]] == [10, 16, 16]  # type: ignore[union-attr]


def test_a_rank_s_first_batch_of_a_step_and_a_part_is_a_run() -> None:
    """Every rank's first batch comes at once: 20 calls of a 16-call step went one by one, a slot
    each that every other rank's calls filled (327,680 calls at 16,384 ranks). Where no cycle is
    known yet, a period whose first calls come again folds; the next batch takes it up. A first
    batch that opens with calls of its own (a broadcast of the weights) does not fold."""
    calls = _fsdp(60)
    made, events = _decoded(_batches(calls, [20, 40]), fold=True)
    assert made == [_fields(c) for c in calls]
    assert [type(ev).__name__ for ev in events] == ["CallRun"] * 3
    opening = [_call(1, 0, 0, op="broadcast", width=5), *_fsdp(19, start=1)]
    for i, c in enumerate(opening):
        c.call_id = c.seq = i + 1
    made, events = _decoded(_batches(opening, []), fold=True)
    assert made == [_fields(c) for c in opening]
    assert not any(isinstance(ev, r.CallRun) for ev in events)


def test_the_last_call_under_way_stays_a_call_and_the_next_batch_takes_up_after_it() -> None:
    calls = _fsdp(60)
    calls[39].exit_time = None
    made, events = _decoded(_batches(calls, [40]), fold=True)
    assert [type(ev).__name__ for ev in events] == ["CallRun", "CallRecord", "CallRun"]
    assert made == [_fields(c) for c in calls]


def test_what_breaks_the_cycle_comes_as_it_was_sent() -> None:
    """The look-alikes: a shape that differs once, a skipped call, a step one call short, an
    async call. None is inside a run; every call comes as sent."""
    shape = _fsdp(48)
    shape[37] = _call(37, 37 % 16, 2, width=999)
    skipped = [c for c in _fsdp(49) if c.call_id != 38]  # the ids and seqs after it close up
    for i, c in enumerate(skipped):
        c.call_id = c.seq = i + 1
    short = _fsdp(48)
    for c in short[31:]:
        c.step += 1  # the third step has fifteen calls
    async_ = _fsdp(48)
    async_[20] = _call(20, 4, 1, async_op=True)
    for calls, odd in ((shape, 38), (skipped, 38), (short, 32), (async_, 21)):
        made, events = _decoded(_batches(calls, []), fold=True)
        assert made == [_fields(c) for c in calls]
        assert not any(isinstance(ev, r.CallRun) and ev.first_call_id <= odd <= ev.first_call_id + len(ev) - 1
                       for ev in events)  # fmt: skip


def test_steps_of_names_how_steps_advance() -> None:
    assert folds.steps_of([4, 4, 4], 0) == (0, 0)
    assert folds.steps_of([4, 4, 5, 5, 5, 6], 0) == (3, 1)
    assert folds.steps_of([4, 5, 5], 3) == (3, 2)
    assert folds.steps_of([4, 5, 5], 0) is None  # one change, and how many a step not known
    assert folds.steps_of([4, 4, 5, 5, 5, 5, 6], 0) == (4, 2)
    assert folds.steps_of([4, 5, 5, 6, 6, 6, 7], 0) is None  # a step longer than the one before
    assert folds.steps_of([4, 6, 6], 2) is None


@settings(max_examples=150, deadline=None)
@given(
    period=st.integers(1, 20),
    per_periods=st.integers(1, 3),
    n=st.integers(2, 160),
    lead=st.integers(0, 40),
    cuts=st.lists(st.integers(1, 159), max_size=8),
    runs=st.booleans(),
    odd=st.lists(
        st.tuples(st.integers(0, 159), st.sampled_from(["shape", "open", "async", "step", "skip"])), max_size=3
    ),
)
def test_folding_changes_no_call(
    period: int, per_periods: int, n: int, lead: int, cuts: list[int], runs: bool, odd: list[tuple[int, str]]
) -> None:
    """Whatever the cycle, the steps, the batches and what breaks them: the calls made of what
    the decoder hands on are the calls sent, folded or not."""
    per = period * per_periods
    calls = [_call(i, i % period, (lead + i) // per, width=64 + (i % period)) for i in range(n)]
    for at, what in odd:
        if at >= len(calls):
            continue
        c = calls[at]
        if what == "shape":
            calls[at] = _call(at, 0, c.step, width=7)
        elif what == "open":
            c.exit_time = None
        elif what == "async":
            c.async_op = True
        elif what == "step":
            for later in calls[at:]:
                later.step += 1
        else:
            del calls[at]
            for i, later in enumerate(calls[at:], at):
                later.call_id = later.seq = i + 1
    at = sorted({c for c in cuts if c < len(calls)})
    batches = _batches(calls, at, runs)
    folded, events = _decoded(batches, fold=True)
    plain, _ = _decoded(batches, fold=False)
    assert folded == plain == [_fields(c) for c in calls]
    # a node agent's folds are the coordinator's, batch for batch
    sent = _batches(calls, at, runs, fold=True)
    assert all(b.folded for b in sent)
    by_sender, as_sent = _decoded(sent, fold=True)
    assert by_sender == folded
    assert [_form(ev) for ev in as_sent] == [_form(ev) for ev in events]


def _form(ev: r.RankEvent) -> tuple[object, ...]:
    """What the job state takes of a decoded record: a run's extent, steps and cycle. (Whether
    it knows the rank's cycle as a ``Shape``, and in which turn, is what the job state caches
    its facts on: either way they are the same, ``state.facts``, and compared in any turn,
    ``state.base._RunRef.alike``.)"""
    if not isinstance(ev, r.CallRun):
        return (type(ev).__name__, getattr(ev, "call_id", None))
    if ev.shape is not None:  # the cycle, turned to the run's first call, is the run's
        assert ev.shape.templates[ev.turn :] + ev.shape.templates[: ev.turn] == ev.templates
    sites = tuple(t.call_site for t in ev.templates)
    return ("run", ev.first_call_id, len(ev), ev.step, ev.per_step, ev.lead, sites)


def test_a_steps_runs_that_a_sender_cut_at_each_step_fold_into_one() -> None:
    """Tensor parallelism: one all_reduce signature, 64 a step. A sender gathers each step's
    calls into a run; the decoder makes the batch's runs one, across steps."""
    calls = [_call(i, 0, (10 + i) // 64, width=4096) for i in range(150)]
    made, events = _decoded(_batches(calls, [], runs=True), fold=True)
    assert made == [_fields(c) for c in calls]
    runs = [ev for ev in events if isinstance(ev, r.CallRun)]
    assert len(events) == 1 and len(runs) == 1
    assert (runs[0].per_step, runs[0].lead, runs[0].last_step) == (64, 10, 2)
    _, cut = _decoded(_batches(calls, [], runs=True), fold=False)
    assert len(cut) == 3  # as the sender cut them


def test_a_batch_that_parts_from_its_cycle_at_one_call_is_a_run_that_call_and_a_run() -> None:
    """The rank's cycle is known from its last batch; this one holds one call of another shape,
    an extra call, or has one skipped: the calls before it and after it are runs, that call
    alone (one slot for the other ranks' runs to fill, not one at every seq of the batch)."""
    odd_shape = _fsdp(80)
    odd_shape[50] = _call(50, 50 % 16, 50 // 16, width=999)
    extra = _fsdp(80)
    extra.insert(50, _call(50, 3, 50 // 16, op="all_gather_into_tensor", width=31))
    skipped = [c for c in _fsdp(81) if c.call_id != 51]
    for calls in (odd_shape, extra, skipped):
        for i, c in enumerate(calls):
            c.call_id = c.seq = i + 1
        made, events = _decoded(_batches(calls, [40]), fold=True)
        assert made == [_fields(c) for c in calls]
        assert [type(ev).__name__ for ev in events][-3:] == ["CallRun", "CallRecord", "CallRun"]
        assert [len(ev) if isinstance(ev, r.CallRun) else 1 for ev in events][-3:] == [10, 1, len(calls) - 51]


def test_a_signature_redefined_folds_with_its_new_call() -> None:
    """A sender whose table is full redefines its signature ids for new calls, here in the same
    order: a layer's shapes change, and the cycle's ids stay the same. The runs folded after
    make the new calls, not the templates the cycle's ids named before (``Folder.known``)."""
    calls = _fsdp(64)
    calls += [_call(i, i % 16, i // 16, width=8192 + 512 * (i % 16)) for i in range(64, 128)]
    for c in calls[64:]:  # each layer's new width, its own shapes
        c.outputs = (r.TensorMeta((c.inputs[0].shape[0] * 4,), "bfloat16"),)
    enc = CallEncoder(capacity=16)
    batches, lo = [], 0
    for hi in [*range(20, 128, 20), 128]:
        batch = pb.ReportBatch(rank=RANK)
        enc.encode(calls[lo:hi], batch)
        batches.append(batch)
        lo = hi
    assert {s.id for s in batches[3].signatures} <= set(range(1, 17))  # the same ids, redefined
    made, events = _decoded(batches, fold=True)
    assert made == [_fields(c) for c in calls]
    assert isinstance(events[-1], r.CallRun)  # folded after the redefinition too


def test_a_call_that_parts_at_a_batchs_edge_costs_that_call_alone() -> None:
    """The odd call first, second, next to last or last of its batch (another shape, an extra
    call, a skipped one): only the calls beside it that cannot be runs go alone, and the next
    batch takes the cycle up again. Before, such a rank's next 128 calls went one by one, each a
    slot that every other rank's run filled."""
    for where in (40, 41, 58, 59):  # batches of 20: first, second, next to last, last
        odd_shape = _fsdp(120)
        odd_shape[where] = _call(where, where % 16, where // 16, width=999)
        extra = _fsdp(120)
        extra.insert(where, _call(where, 3, where // 16, op="all_gather_into_tensor", width=31))
        skipped = [c for c in _fsdp(121) if c.call_id != where + 1]
        for calls in (odd_shape, extra, skipped):
            calls = calls[:120]
            for i, c in enumerate(calls):
                c.call_id = c.seq = i + 1
            made, events = _decoded(_batches(calls, list(range(20, 120, 20))), fold=True)
            assert made == [_fields(c) for c in calls]
            alone = [ev.seq for ev in events if isinstance(ev, r.CallRecord) and ev.seq > 40]
            assert where + 1 in alone and len(alone) <= 2, (where, alone)
            assert isinstance(events[-1], r.CallRun)


def test_a_node_agent_sends_a_batch_of_fsdp_steps_as_one_entry_across_steps() -> None:
    """The sender folds what the coordinator would: one column entry for three steps and more,
    its cycle's 15 further signatures and its steps on the wire; the decoder takes it as it
    came (the batch says ``folded``), the calls as sent."""
    calls = _fsdp(45, start=5)
    (batch,) = _batches(calls, [], fold=True)
    cols = batch.calls
    assert batch.folded and list(cols.run) == [45] and list(cols.run_cycle) == [15]
    assert (list(cols.run_per_step), list(cols.run_lead)) == ([16], [5])
    made, events = _decoded([batch], fold=True)
    assert made == [_fields(c) for c in calls]
    (run,) = events
    assert isinstance(run, r.CallRun) and (run.per_step, run.lead, run.last_step) == (16, 5, 3)
    assert run.shape is not None and len(run.shape.templates) == 16


def _lead_of_a_whole_step(c: pb.CallColumns) -> None:
    c.run_lead[0] = 16  # as many before its first call as its step has


def _one_entry_too_many(c: pb.CallColumns) -> None:
    c.run_per_step.append(16)


def _stepping_call_alone(c: pb.CallColumns) -> None:
    c.run[0] = 1  # one call, not a run, said to cross steps
    c.run_cycle[0] = 0
    for column in (c.run_enter, c.run_exit, c.run_signature):
        del column[:]


def test_a_batch_whose_steps_do_not_line_up_is_refused_whole() -> None:
    """Steps that cannot be a run's (a lead not below the calls a step, a step of a call that is
    not a run, columns of other lengths) make the columns untrusted, as any misaligned ones."""
    (good,) = _batches(_fsdp(45, start=5), [], fold=True)
    assert CallDecoder(fold=True).decode(RANK, good)[1] == 0
    for mend in (_lead_of_a_whole_step, _one_entry_too_many, _stepping_call_alone):
        batch = pb.ReportBatch()
        batch.CopyFrom(good)
        mend(batch.calls)
        got, rejected, _ = CallDecoder(fold=True).decode(RANK, batch)
        assert rejected == 1 and not [ev for ev in got if isinstance(ev, (r.CallRecord, r.CallRun))], mend.__name__


def _stepping(n: int) -> list[r.RankEvent]:
    """FSDP's calls, each step's ``StepEvent`` before its first call (as a rank's ring has them)."""
    out: list[r.RankEvent] = []
    for c in _fsdp(n):
        if c.call_id == 1 or c.step != _fsdp(c.call_id - 1)[-1].step:
            out.append(r.StepEvent(RANK, c.step, c.enter_time - 0.25))
        out.append(c)
    return out


def _ingested(batches: list[pb.ReportBatch]) -> tuple[tuple[object, ...], int]:
    """What the job state keeps of a rank's steps, fed ``batches`` as the coordinator feeds them;
    and the events applied."""
    job = JobState()
    st = job.register(r.RankIdentity("j", RANK, 4, "h", 1, session="s"), 0.0)
    dec, applied = CallDecoder(fold=True), 0
    for batch in batches:
        events, rejected, _ = dec.decode(RANK, batch)
        assert rejected == 0
        result = job.ingest("s", RANK, events, now=200.0)
        assert result is not None and not result.failed
        applied += result.applied
    return (st.step, st.timed_step, list(st.step_times), st.last_call_id), applied


def test_a_node_agent_sends_a_batch_of_steps_and_calls_with_its_steps_in_columns() -> None:
    """Where a batch's events are all steps, a node agent sends them as columns, taken at once:
    the job state keeps of them what it kept of the events."""
    events = _stepping(80)
    sent = []
    for fold in (False, True):
        enc = CallEncoder()
        enc.send_runs = True
        enc.fold = SenderFold() if fold else None
        batches = []
        for lo, hi in ((0, 30), (30, len(events))):
            batch = pb.ReportBatch(rank=RANK)
            enc.encode(events[lo:hi], batch)
            batches.append(batch)
        sent.append(batches)
    plain, folded = sent
    assert all(len(b.events) >= 2 and not b.step_number for b in plain)
    assert all(not b.events for b in folded)
    assert [list(b.step_number) for b in folded] == [[0, 1], [2, 3, 4]]
    kept, applied = _ingested(folded)
    assert (kept, applied) == _ingested(plain)
    assert kept[0] == 4 and len(kept[2]) == 5  # every step timed


def test_steps_after_another_event_stay_events_in_their_order() -> None:
    """The steps before any other event go in columns (applied before the events); those after
    one stay events. The job state keeps the same of either form."""
    events = _stepping(40)
    events.insert(5, r.MarkerEvent(RANK, "trigger", 101.0))
    sent = []
    for fold in (False, True):
        enc = CallEncoder()
        enc.send_runs = True
        enc.fold = SenderFold() if fold else None
        batch = pb.ReportBatch(rank=RANK)
        enc.encode(events, batch)
        sent.append(batch)
    plain, folded = sent
    kinds = [e.WhichOneof("body") for e in plain.events]
    assert kinds[:3] == ["step", "marker", "step"] and not plain.step_number
    assert list(folded.step_number) == [0] and [e.WhichOneof("body") for e in folded.events] == kinds[1:]
    assert _ingested([folded]) == _ingested([plain])


def test_step_columns_that_do_not_line_up_are_refused() -> None:
    for numbers, times in (([1, 2], [5.0]), ([1], [float("nan")]), ([], [5.0])):
        batch = pb.ReportBatch(rank=RANK, step_number=numbers, step_time=times)
        got, rejected, _ = CallDecoder(fold=True).decode(RANK, batch)
        assert rejected and not got, (numbers, times)
    # a step without a time is refused alone, as the same step as an event is
    batch = pb.ReportBatch(rank=RANK, step_number=[1, 2, 3], step_time=[5.0, float("inf"), 7.0])
    got, rejected, _ = CallDecoder(fold=True).decode(RANK, batch)
    assert rejected == 1 and got == [r.Steps(RANK, (1, 3), (5.0, 7.0))]


def _refusing(nth: int) -> Callable[[int], bool]:
    """A budget that refuses the ``nth`` definition it is asked for, and nothing else."""
    asked = itertools.count(1)

    def charge(n: int) -> bool:
        return n <= 0 or next(asked) != nth

    return charge


def test_a_signature_the_coordinator_refused_costs_its_calls_alone_folded_or_not() -> None:
    """The coordinator may refuse a definition (its memory budget, a full table), which the sender
    does not learn. A run the sender folded over it loses that signature's calls alone, as where
    the coordinator folds, not the whole run, batch after batch. (Found by review.)"""
    calls = _fsdp(48)
    kept = []
    for fold in (False, True):
        dec = CallDecoder(fold=True, cost=lambda c: 100, charge=_refusing(5))
        got, rejected = [], 0
        for batch in _batches(calls, [20], fold=fold):
            events, bad, _ = dec.decode(RANK, batch)
            rejected += bad
            got += [_fields(c) for ev in events for c in (ev.calls() if isinstance(ev, r.CallRun) else [ev])]
        kept.append((got, rejected))
    (plain, plain_rejected), (folded, folded_rejected) = kept
    fifth = {c.call_site for c in calls[4::16]}
    assert plain == folded == [_fields(c) for c in calls if c.call_site not in fifth]
    assert plain_rejected == 1 + 3  # the definition, then each of its three calls
    assert folded_rejected == plain_rejected
