"""Records written into a ring come out of the coordinator's decoder as the same records.

The round trip is the contract of the evidence path: rank → ring slots and blobs → the shipper's
:class:`RingEncoder` → ``ReportBatch`` → the coordinator's ``CallDecoder``. Hypothesis drives
random sequences of calls (some failing, some never finishing), steps and group changes through
it, with rings small enough to wrap, id tables small enough to evict, and polls at random points.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch import records as r
from hangwatch import ringwire
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import SLOT, Batch, Kind, PackedSlots, RingReader, RingSlot, RingWriter
from hangwatch.ringwire import RingEncoder, _extend, call_blob, event_blob, text_blob
from hangwatch.sendfold import SenderFold
from hangwatch.signatures import CallDecoder

RANK = 2
_GROUPS = ("0", "1")
_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor")


def _template(op: str, group: str, width: int) -> r.CallRecord:
    meta = (r.TensorMeta((width,), "float32"),)
    return r.CallRecord(RANK, 0, op, group, 0, meta, meta, "sum" if op == "all_reduce" else None,
                        0 if op == "broadcast" else None, None, False, 0, f"train.py:{width} in step")  # fmt: skip


class RankSide:
    """What the hook will do: intern signatures as blobs, write slots."""

    def __init__(self, w: RingWriter) -> None:
        self.w = w
        self.blob_of: dict[tuple[str, str, int], int] = {}
        self.call_id = 0
        self.seq = dict.fromkeys(_GROUPS, 0)
        self.step = 0
        self.expected: list[r.RankEvent] = []

    def call(self, op: str, group: str, width: int, outcome: str, t: float) -> None:
        key = (op, group, width)
        if key not in self.blob_of:
            self.blob_of[key] = self.w.blob(call_blob(_template(op, group, width)))
        self.call_id += 1
        self.seq[group] += 1
        tpl = _template(op, group, width)
        rec = r.CallRecord(RANK, self.call_id, op, group, self.seq[group], tpl.inputs, tpl.outputs, tpl.reduce_op,
                           tpl.root, None, False, self.step, tpl.call_site, t)  # fmt: skip
        self.w.write(Kind.ENTER, 0, 0, self.blob_of[key], self.call_id, self.seq[group], self.step, 0, t)
        self.expected.append(rec)
        if outcome == "ok":
            self.w.write(Kind.EXIT, 0, 1, 0, self.call_id, 0, 0, 0, t + 0.5)
            self.expected.append(r.CallExit(RANK, self.call_id, t + 0.5, None, 1))
        elif outcome == "error":
            ref = self.w.blob(text_blob("RuntimeError: Connection closed by peer"))
            self.w.write(Kind.EXIT, 0, 1, ref, self.call_id, 0, 0, 0, t + 0.5)
            self.expected.append(r.CallExit(RANK, self.call_id, t + 0.5, "RuntimeError: Connection closed by peer"))

    def next_step(self, t: float) -> None:
        self.step += 1
        self.w.write(Kind.STEP, 0, 0, 0, 0, 0, self.step, 0, t)
        self.expected.append(r.StepEvent(RANK, self.step, t))

    def group_created(self, name: str, t: float) -> None:
        ev = r.GroupEvent(RANK, r.GroupEventKind.CREATED, r.GroupInfo(name, (0, 1, 2), "gloo", 1), t, "train.py:3")
        self.w.write(Kind.EVENT, 0, 0, self.w.blob(event_blob(ev)), 0, 0, 0, 0, t)
        self.expected.append(ev)


def _merge(events: list[r.RankEvent]) -> list[r.RankEvent]:
    """Fold each successful exit into its call, as the decoder does for exits in one batch."""
    out: list[r.RankEvent] = []
    open_calls: dict[int, r.CallRecord] = {}
    for ev in events:
        if isinstance(ev, r.CallRecord):
            open_calls[ev.call_id] = ev
            out.append(ev)
        elif isinstance(ev, r.CallExit) and ev.error is None and ev.call_id in open_calls:
            call = open_calls.pop(ev.call_id)
            call.exit_time, call.seq_count = ev.exit_time, ev.seq_count
        else:
            out.append(ev)
    return out


_ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("call"),
            st.sampled_from(_OPS),
            st.sampled_from(_GROUPS),
            st.integers(1, 6),
            st.sampled_from(["ok", "ok", "ok", "error", "open"]),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("poll")),
    ),
    max_size=60,
)


#: A training loop's calls: a pattern of one to four signatures of one group, repeated (cycles
#: of signatures form where the pattern has two or more), amid any other actions.
_PATTERN = st.tuples(
    st.lists(
        st.tuples(st.just("call"), st.sampled_from(_OPS[:2]), st.just("0"), st.integers(1, 3), st.just("ok")),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 8),
).map(lambda pattern: [*(pattern[0] * pattern[1]), ("poll",)])  # read before the ring laps
_CYCLIC = st.lists(st.one_of(_PATTERN, _ACTIONS.map(lambda actions: actions[:3])), min_size=1, max_size=8).map(
    lambda parts: [action for part in parts for action in part]
)


def _flat(events: list[r.RankEvent]) -> list[r.RankEvent]:
    """Runs of alike calls (``records.CallRun``) as the calls they stand for, a batch's steps
    (``records.Steps``) as its step events."""
    out: list[r.RankEvent] = []
    for event in events:
        if isinstance(event, r.CallRun):
            out.extend(event.calls())
        elif isinstance(event, r.Steps):
            out.extend(r.StepEvent(event.rank, s, t) for s, t in zip(event.steps, event.times, strict=True))
        else:
            out.append(event)
    return out


@settings(max_examples=120, deadline=None)
@given(
    actions=st.one_of(_ACTIONS, _CYCLIC),
    capacity=st.integers(2, 8),
    runs=st.booleans(),
    cycles=st.booleans(),
    poll=st.sampled_from([7, 64, 1 << 20]),
    fold=st.booleans(),
)
def test_round_trip_through_the_ring_and_the_wire(
    actions: list[tuple[object, ...]], capacity: int, runs: bool, cycles: bool, poll: int, fold: bool
) -> None:
    """Also with runs of alike calls (``CallColumns.run``), of cycles of signatures
    (``CallColumns.run_cycle``), and folded across steps by a node agent (``sendfold``), as a
    coordinator that takes them gets them: the calls they stand for are the rank's, one for one."""
    w = RingWriter(capacity=256, blob_bytes=1 << 16)
    rank = RankSide(w)
    reader = RingReader(w.fd)
    encoder = RingEncoder(capacity=capacity)  # a small id table: signatures get evicted and redefined
    encoder.send_runs = runs
    encoder.send_cycles = runs and cycles
    encoder.fold = SenderFold() if runs and fold else None
    decoder = CallDecoder(capacity=capacity, fold=fold)
    got: list[r.RankEvent] = []
    t = 1000.0

    def ship() -> None:
        while True:  # batches of at most ``poll`` slots, until the ring is read to its end
            batch = pb.ReportBatch()
            ring = reader.poll(poll)
            encoder.encode(ring, batch)
            assert runs or not batch.calls.run
            assert (runs and (cycles or fold)) or not batch.calls.run_cycle
            assert batch.folded == (runs and fold)
            events, rejected, _folded = decoder.decode(RANK, batch)
            assert rejected == 0
            got.extend(_flat(events))
            if len(ring.slots) < poll:
                break

    rank.group_created("1", t)
    for action in actions:
        t += 1.0
        if action[0] == "call":
            rank.call(str(action[1]), str(action[2]), int(str(action[3])), str(action[4]), t)
        elif action[0] == "step":
            rank.next_step(t)
        else:
            ship()
    ship()
    assert reader.lost == 0 and encoder.unnamed == 0

    # the wire orders a batch by kind (group creations, columns, then the rest, a call sent whole
    # included: see the proto), so compare each kind's records in the rank's order
    def order(e: r.RankEvent) -> int:
        return e.call_id if isinstance(e, (r.CallRecord, r.CallExit)) else 0

    for kind in (r.CallRecord, r.CallExit, r.StepEvent, r.GroupEvent):
        mine = sorted((e for e in _merge(got) if type(e) is kind), key=order)
        assert mine == sorted((e for e in _merge(rank.expected) if type(e) is kind), key=order)
    assert len(_merge(got)) == len(_merge(rank.expected))
    w.close()
    reader.close()


@settings(max_examples=120, deadline=None)
@given(actions=st.one_of(_ACTIONS, _CYCLIC), cycles=st.booleans())
def test_typed_decode_gives_the_records_in_the_ranks_order(actions: list[tuple[object, ...]], cycles: bool) -> None:
    """The coordinator's embedded agent skips the wire (``RingEncoder.decode``): the same
    records, in the very order the rank wrote them, an exit in the same batch folded in; runs
    and cycles of signatures stand for their calls one for one."""
    w = RingWriter(capacity=256, blob_bytes=1 << 16)
    rank = RankSide(w)
    reader = RingReader(w.fd)
    encoder = RingEncoder()
    encoder.send_cycles = cycles
    got: list[r.RankEvent] = []
    t = 1000.0
    rank.group_created("1", t)
    for action in actions:
        t += 1.0
        if action[0] == "call":
            rank.call(str(action[1]), str(action[2]), int(str(action[3])), str(action[4]), t)
        elif action[0] == "step":
            rank.next_step(t)
        else:
            got.extend(_flat(encoder.decode(reader.poll(), RANK)))
    got.extend(_flat(encoder.decode(reader.poll(), RANK)))
    assert reader.lost == 0 and encoder.unnamed == 0
    # folded only within one batch: compare with the rank's own records, exits folded where the
    # decode folded them (a call it returned complete)
    expected: list[r.RankEvent] = []
    done = {e.call_id for e in got if isinstance(e, r.CallRecord) and e.exit_time is not None}
    calls: dict[int, r.CallRecord] = {}
    for ev in rank.expected:
        if isinstance(ev, r.CallExit) and ev.error is None and ev.call_id in done:
            calls[ev.call_id].exit_time, calls[ev.call_id].seq_count = ev.exit_time, ev.seq_count
            continue
        if isinstance(ev, r.CallRecord):
            calls[ev.call_id] = ev
        expected.append(ev)
    assert got == expected
    w.close()
    reader.close()


def test_wrapped_32_bit_values_extend_back() -> None:
    assert _extend(5, 0) == 5
    assert _extend(2, (1 << 32) - 3) == (1 << 32) + 2  # wrapped forward
    assert _extend((1 << 32) - 1, (1 << 32) + 2) == (1 << 32) - 1  # a late record from before the wrap
    assert _extend(7, 7) == 7


def test_a_lost_signature_blob_is_counted_not_guessed() -> None:
    w = RingWriter(capacity=16, blob_bytes=8)  # too small for any signature
    ref = w.blob(call_blob(_template("all_reduce", "0", 4)))
    assert ref == 0
    w.write(Kind.ENTER, 0, 0, ref, 1, 1, 0, 0, 1.0)
    w.write(Kind.EXIT, 0, 1, 0, 1, 0, 0, 0, 2.0)
    encoder = RingEncoder()
    batch = pb.ReportBatch()
    encoder.encode(RingReader(w.fd).poll(), batch)
    assert encoder.unnamed == 1 and len(batch.calls.call_id) == 0
    assert [e.done.call_id for e in batch.events] == [1]  # its exit still travels


def _run_batch(**change: object) -> pb.ReportBatch:
    """A batch of one signature and one entry standing for a run of three calls."""
    batch = pb.ReportBatch()
    sig = batch.signatures.add(id=1)
    sig.call.op, sig.call.group = "all_reduce", "0"
    cols = batch.calls
    cols.signature.append(1)
    cols.call_id.append(5)
    cols.seq.append(7)
    cols.step.append(0)
    cols.enter_time.append(10.0)
    cols.exit_time.append(10.5)
    cols.seq_count.append(1)
    cols.run.append(3)
    cols.run_enter.extend([11.0, 12.0])
    cols.run_exit.extend([11.5, 12.5])
    _set_columns(cols, change)
    return batch


def _set_columns(cols: pb.CallColumns, change: dict[str, object]) -> None:
    """Replace each named column of ``cols`` by the values ``change`` gives it."""
    for name, value in change.items():
        field = getattr(cols, name)
        del field[:]
        field.extend(value)


def test_a_run_on_the_wire_is_the_calls_it_stands_for() -> None:
    events, rejected, folded = CallDecoder().decode(RANK, _run_batch())
    assert rejected == 0 and folded == 3
    (run,) = events
    assert isinstance(run, r.CallRun)
    calls = run.calls()
    assert [(c.call_id, c.seq, c.enter_time, c.exit_time) for c in calls] == [
        (5, 7, 10.0, 10.5),
        (6, 8, 11.0, 11.5),
        (7, 9, 12.0, 12.5),
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"run_enter": [11.0]},  # times that do not line up with the runs
        {"run_exit": [11.5, 12.5, 13.5]},
        {"run": [3, 1]},  # more run counts than entries
    ],
)
def test_runs_that_do_not_line_up_refuse_the_whole_columns(change: dict[str, object]) -> None:
    events, rejected, _ = CallDecoder().decode(RANK, _run_batch(**change))
    assert events == [] and rejected == 1


@pytest.mark.parametrize(
    "change",
    [
        {"run_enter": [11.0, float("inf")]},  # a time no clock gives
        {"run_exit": [float("nan"), 12.5]},  # a call of a run still under way
        {"exit_time": [float("nan")]},
        {"seq_count": [2]},  # a run's calls issue one collective each
    ],
)
def test_a_run_that_is_not_whole_is_refused_with_its_calls(change: dict[str, object]) -> None:
    events, rejected, _ = CallDecoder().decode(RANK, _run_batch(**change))
    assert events == [] and rejected == 3


def _cycle_batch(group: str = "0", **change: object) -> pb.ReportBatch:
    """``_run_batch``'s run of three calls, as a cycle of two signatures: all_reduce, broadcast,
    all_reduce (the second signature on ``group``)."""
    batch = _run_batch()
    sig = batch.signatures.add(id=2)
    sig.call.op, sig.call.group = "broadcast", group
    batch.calls.run_cycle.append(1)
    batch.calls.run_signature.append(2)
    _set_columns(batch.calls, change)
    return batch


def test_a_cycle_on_the_wire_is_the_calls_it_stands_for() -> None:
    events, rejected, folded = CallDecoder().decode(RANK, _cycle_batch())
    assert rejected == 0 and folded == 3
    (run,) = events
    assert isinstance(run, r.CallRun) and len(run.templates) == 2
    assert [(c.op, c.call_id, c.seq, c.enter_time) for c in run.calls()] == [
        ("all_reduce", 5, 7, 10.0),
        ("broadcast", 6, 8, 11.0),
        ("all_reduce", 7, 9, 12.0),
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"run_signature": []},  # a cycle without its signatures
        {"run_signature": [2, 2]},  # more than its cycle has
        {"run_cycle": [1, 0]},  # more cycle counts than entries
        {"run_cycle": [64], "run_signature": [2] * 64},  # a period over MAX_WIRE_CYCLE
        {"run": [1], "run_enter": [], "run_exit": []},  # a cycle on an entry that is not a run
    ],
)
def test_cycles_that_do_not_line_up_refuse_the_whole_columns(change: dict[str, object]) -> None:
    events, rejected, _ = CallDecoder().decode(RANK, _cycle_batch(**change))
    assert events == [] and rejected == 1


def test_a_cycle_of_two_groups_is_refused_with_its_calls() -> None:
    events, rejected, _ = CallDecoder().decode(RANK, _cycle_batch(group="1"))
    assert events == [] and rejected == 3


def test_a_cycle_of_a_signature_not_known_gives_the_others_calls_alone() -> None:
    """A signature the coordinator does not hold (refused for its budget, a table full): its calls
    are refused, the others' come one by one, as they would unfolded."""
    events, rejected, _ = CallDecoder().decode(RANK, _cycle_batch(run_signature=[3]))
    assert rejected == 1
    assert [(type(c).__name__, c.op, c.call_id, c.seq, c.enter_time) for c in events] == [  # type: ignore[union-attr]
        ("CallRecord", "all_reduce", 5, 7, 10.0),
        ("CallRecord", "all_reduce", 7, 9, 12.0),
    ]


def test_a_node_agent_holds_a_trailing_call_under_way_back_once() -> None:
    """``RingEncoder.hold`` (a node agent's, while the rank's link is open): a batch's last
    record, the entry of a call still under way in a steady loop, waits for the next read, which
    most likely brings its exit; a read that brings nothing new sends it (a hang is told one read
    later), and without ``hold`` (the last read of a closed link) nothing waits."""
    w = RingWriter(capacity=256, blob_bytes=1 << 16)
    rank = RankSide(w)
    reader = RingReader(w.fd)
    encoder = RingEncoder()
    encoder.hold = True
    t = 1000.0
    rank.call("all_reduce", "0", 1, "ok", t)
    assert len(encoder.decode(reader.poll(), RANK)) == 1  # a signature's first call: never held
    for _ in range(4):
        t += 1.0
        rank.call("all_reduce", "0", 1, "ok", t)
    rank.call("all_reduce", "0", 1, "open", t + 1.0)
    first = _flat(encoder.decode(reader.poll(), RANK))
    assert [c.seq for c in first if isinstance(c, r.CallRecord)] == [2, 3, 4, 5]  # the sixth waits
    # held back, it is the Python call under way all the same: the Flight Recorder's reader, which
    # reads once the ring is read past its read, must not take its entry for one issued from C++
    # (a story told "rank 0 entered all_reduce at issued from C++" on a loaded CI machine)
    assert encoder.python.covers("0", 6) and encoder.python.busy_on("0")
    then = _flat(encoder.decode(reader.poll(), RANK))  # nothing new: it is under way still
    assert [(c.seq, c.exit_time) for c in then if isinstance(c, r.CallRecord)] == [(6, None)]
    rank.call("all_reduce", "0", 1, "open", t + 2.0)  # seq 7, under way
    encoder.hold = False  # the link closed: everything goes
    last = _flat(encoder.decode(reader.poll(), RANK))
    assert [c.seq for c in last if isinstance(c, r.CallRecord)] == [7]
    w.close()
    reader.close()


# ---- the gatherer in C against the Python one --------------------------------------------------

_SIGNATURES = {
    1: call_blob(_template("all_reduce", "0", 4)),  # runs may form
    2: call_blob(_template("broadcast", "1", 8)),  # runs may form, on another group
    3: call_blob(r.CallRecord(RANK, 0, "send", "0", 0, (), (), None, peer=1, call_site="pp.py:3 in step")),  # never
    4: text_blob("RuntimeError: Connection closed by peer"),  # an exit's error
    5: call_blob(_template("all_reduce", "0", 8)),  # with 1, cycles may form (one group, two lines)
}

_SLOT = st.tuples(
    st.sampled_from([Kind.ENTER, Kind.ENTER, Kind.ENTER, Kind.EXIT, Kind.EXIT, Kind.STEP, Kind.EVENT]),
    st.sampled_from([0, 0, 0, 1]),  # flags: async now and then
    st.sampled_from([0, 1, 1, 2]),  # aux: collectives an exit issued
    st.sampled_from([1, 1, 5, 5, 2, 3, 0, 4]),  # ref
    st.sampled_from([0, 1, 1, 1, 2]),  # call id step from the last
    st.sampled_from([0, 1, 1, 1, 3]),  # seq step
    st.sampled_from([0, 0, 0, 1]),  # step step
)

#: a steady loop's stretch: a pattern of call sites (one line, two, three) over and over, between
#: arbitrary slots (runs and cycles form only in such stretches: arbitrary slots alone made 8
#: runs in 300 examples)
_STRETCH = st.tuples(st.sampled_from([(1,), (1,), (5,), (1, 5), (5, 1, 5), (2,)]), st.integers(1, 12)).map(
    lambda pk: [(Kind.ENTER, 0, 1, ref, 1, 1, 0) for ref in pk[0]] * pk[1]
)
_SPEC = st.lists(st.one_of(_SLOT.map(lambda s: [s]), _STRETCH), max_size=10).map(
    lambda blocks: [s for block in blocks for s in block]
)


def _slots(spec: list[tuple[int, ...]], start: int) -> list[RingSlot]:
    """Slots the way a steady loop writes them, with every kind of break in it: an exit for each
    enter, mostly, with call ids and seqs mostly one apart."""
    out: list[RingSlot] = []
    call, seq, step, t = start, start, start // 7, float(start)
    for kind, flags, aux, ref, dcall, dseq, dstep in spec:
        t += 0.001
        if kind == Kind.ENTER:
            call, seq, step = (call + dcall) & 0xFFFFFFFF, (seq + dseq) & 0xFFFFFFFF, step + dstep
            out.append(RingSlot(0, kind, flags, 0, ref if ref in (1, 2, 3, 5) else 1, call, seq, step, 0, t, 0))
            if dcall and ref != 0:  # its exit, right after it, mostly
                out.append(RingSlot(0, Kind.EXIT, 0, aux, 4 if ref == 4 else 0, call, 0, 0, 0, t + 0.0005, 0))
        elif kind == Kind.EXIT:
            out.append(RingSlot(0, kind, 0, aux, 4 if ref == 4 else 0, (call - dcall) & 0xFFFFFFFF, 0, 0, 0, t, 0))
        elif kind == Kind.STEP:
            step += 1
            out.append(RingSlot(0, kind, 0, 0, 0, 0, 0, step, 0, t, 0))
        else:
            out.append(RingSlot(0, kind, 0, 0, 0, 0, 0, 0, 0, t, 0))
    return out


def _fields(event: object) -> object:
    """An event as comparable values (a ``CallRun`` compares by identity)."""
    if isinstance(event, r.CallRun):
        return ("run", event.templates, event.first_call_id, event.first_seq, event.step, event.enters, event.exits)
    return event


@pytest.mark.skipif(ringwire._native_gather is None, reason="the C extension is not built here")
@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.one_of(st.lists(_SLOT, max_size=40), _SPEC), min_size=1, max_size=6),
    start=st.sampled_from([1, 1000, 0xFFFFFFF0]),
    hold=st.booleans(),
)
def test_the_gatherer_in_c_is_the_python_one(batches: list[list[tuple[int, ...]]], start: int, hold: bool) -> None:
    """Batch after batch through three encoders, one gathering in C from slot tuples (handed to
    ``gather_packed`` as its head), one in C from the scan's packed bytes and one in Python: the
    same events, the same steadiness, the same signatures learnt, the same entry held back,
    whatever the slots."""
    native, packed, python = RingEncoder(), RingEncoder(), RingEncoder()
    python.native = False
    for enc in (native, packed, python):
        enc.hold = hold
        enc.send_cycles = True  # cycles are gathered from either's output alike
    at = start
    for i, spec in enumerate(batches):
        slots = _slots(spec, at)
        at += len(spec) + 1
        blobs = _SIGNATURES if i == 0 else {}
        got = native.decode(Batch(list(slots), dict(blobs), 0), RANK)
        data = b"".join(SLOT.pack(*s) for s in slots)
        from_bytes = packed.decode(Batch(PackedSlots(data), dict(blobs), 0), RANK)
        want = python.decode(Batch(list(slots), dict(blobs), 0), RANK)
        assert [_fields(e) for e in got] == [_fields(e) for e in want]
        assert [_fields(e) for e in from_bytes] == [_fields(e) for e in want]
        assert native.steady == python.steady == packed.steady
        assert (native._whole, native._run_ok) == (python._whole, python._run_ok) == (packed._whole, packed._run_ok)
        assert native.holding == python.holding == packed.holding
        assert native.held_mark() == python.held_mark() == packed.held_mark()


def test_packed_slots_read_as_the_list_of_their_slots() -> None:
    """``PackedSlots`` is the sequence of the slots it packs, after its head, with its tail cut."""
    slots = _slots([(Kind.ENTER, 0, 1, 1, 1, 1, 0)] * 4 + [(Kind.STEP, 0, 0, 0, 0, 0, 0)], 7)
    held = RingSlot(0, Kind.ENTER, 0, 0, 1, 6, 6, 1, 0, 6.5, 0)
    packed = PackedSlots(b"".join(SLOT.pack(*s) for s in slots))
    assert list(packed) == slots and len(packed) == len(slots) and bool(packed)
    assert packed[-1] == slots[-1] and packed[2] == slots[2] and packed[1:4] == slots[1:4]
    both = packed.after([held])
    assert list(both) == [held, *slots] and both[0] is held and both[-2] == slots[-2]
    assert list(both.but_last()) == [held, *slots[:-1]]
    assert list(PackedSlots(b"", (held,)).but_last()) == [] and not PackedSlots(b"")
    with pytest.raises(IndexError):
        packed[len(slots)]


@pytest.mark.skipif(ringwire._native_gather is None, reason="the C extension is not built here")
def test_cycles_gathered_in_c_are_the_python_ones() -> None:
    """A loop of two lines (refs 1 and 5 on one group), with a break in its ids, one in its seqs,
    a step, an async call and an error among them: both find the same cycles, and some."""
    spec = [(Kind.ENTER, 0, 1, 1 if i % 2 else 5, 1, 1, 0) for i in range(40)]
    spec[9] = (Kind.ENTER, 0, 1, 1, 2, 1, 0)  # a call id skipped
    spec[17] = (Kind.ENTER, 0, 1, 1, 1, 3, 0)  # a seq skipped (C++ issued one)
    spec[25] = (Kind.STEP, 0, 0, 0, 0, 0, 0)
    spec[31] = (Kind.ENTER, 1, 1, 1, 1, 1, 0)  # async
    spec[35] = (Kind.ENTER, 0, 1, 4, 1, 1, 0)  # an error
    native, python = RingEncoder(), RingEncoder()
    python.native = False
    outs = []
    for enc in (native, python):
        enc.send_cycles = True
        enc.decode(Batch(_slots([(Kind.ENTER, 0, 1, r_, 1, 1, 0) for r_ in (1, 5)], 1), dict(_SIGNATURES), 0), RANK)
        outs.append([_fields(e) for e in enc.decode(Batch(_slots(spec, 3), {}, 0), RANK)])
    assert outs[0] == outs[1]
    cycles = [e for e in outs[0] if isinstance(e, tuple) and len(e[1]) == 2]
    assert len(cycles) >= 3, outs[0]
    # the two lines' first calls in the same batch as their cycle: each goes alone, then the cycle
    firsts = []
    for enc in (RingEncoder(), RingEncoder()):
        enc.native = not firsts
        enc.send_cycles = True
        firsts.append([_fields(e) for e in enc.decode(Batch(_slots(spec[:8], 1), dict(_SIGNATURES), 0), RANK)])
    assert firsts[0] == firsts[1]
    assert [type(e) for e in firsts[0]][:2] == [r.CallRecord, r.CallRecord] and isinstance(firsts[0][2], tuple)


@pytest.mark.skipif(ringwire._native_gather is None, reason="the C extension is not built here")
def test_the_c_gatherer_works_on_the_batch_as_it_was_whatever_known_does_to_it() -> None:
    """``known`` runs Python code: found by a review, a callback that replaced or cleared the
    list under the C gatherer made it read freed slots. It gathers the batch as it was passed."""
    assert ringwire._native_gather is not None
    slots = _slots([(Kind.ENTER, 0, 1, 1, 1, 1, 0)] * 6, 1)
    want, _ = ringwire._native_gather(list(slots), b"", 0, set(), {1: True}, lambda ref: None, 2, RingSlot, None)

    def vandal(ref: int) -> None:
        batch[:] = [RingSlot(0, Kind.STEP, 0, 0, 0, 0, 0, 0, 0, 0.0, 0)] * 3

    batch = list(slots)
    got, _ = ringwire._native_gather(batch, b"", 0, set(), {1: True}, vandal, 2, RingSlot, None)
    assert [x if isinstance(x, RingSlot) else (x[0], x[1], x[2], x[3]) for x in got] == [
        x if isinstance(x, RingSlot) else (x[0], x[1], x[2], x[3]) for x in want
    ]
