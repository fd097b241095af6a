"""From a rank's ring to the wire, and what the rank puts in the ring's blobs.

The rank writes fixed-size slots (:mod:`hangwatch.ring`) and, rarely, a blob: the fixed part of
a call signature it has not made before, a rare event, an error text. Whoever ships the ring's
records (the node agent; the rank's own sender where no agent runs) turns them into the
``ReportBatch`` the coordinator already takes, with :class:`RingEncoder`: a signature blob
becomes a ``Signature`` (under a bounded id table, as the rank's own encoder did), ENTER/EXIT
slots become ``CallColumns`` entries (an exit in the same batch folded into its call), the rest
become events. The coordinator sees no difference between the two paths.

Blobs start with a one-byte tag: ``C`` a ``Call`` with its per-call fields cleared (a
signature), ``V`` a whole ``Event`` (group changes, markers, ends: rare, so sent as they are),
``T`` UTF-8 text (an exception message).

Slots hold ids, seqs and steps modulo 2**32; the encoder extends them back (call ids and steps
per rank, seqs per group and peer), which is exact as long as a value does not move by 2**31
between two records of its kind.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hangwatch import catalogue, config, ringruns, wire
from hangwatch import records as r
from hangwatch.columns import MAX_CYCLE, MAX_SIGNATURES, Columns
from hangwatch.flight_entries import PythonSeqs
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch, Kind, PackedSlots, RingSlot
from hangwatch.ringruns import CYCLE_MIN, RUN_MIN, Run

if TYPE_CHECKING:
    from hangwatch.sendfold import SenderFold

_native_gather: Callable[..., tuple[list[Any], bool]] | None
try:  # the gatherer in C, where the extension was built at install (``client/_fastpath.c``)
    from hangwatch.client._fastpath import gather_packed as _native_gather
except ImportError:  # pragma: no cover - depends on the install
    _native_gather = None

TAG_CALL = b"C"
TAG_EVENT = b"V"
TAG_TEXT = b"T"
_PER_CALL_FIELDS = ("call_id", "seq", "step", "enter_time", "exit_time", "seq_count", "error")
_NAN = float("nan")
_WRAP = 1 << 32
_MASK32 = _WRAP - 1
_HALF = 1 << 31


# ---- the rank's side: blobs ---------------------------------------------------------------


def call_blob(call: r.CallRecord) -> bytes:
    """A signature blob: ``call`` without what changes from one call to the next."""
    msg = pb.Call()
    wire.call_to_pb(call, msg)
    for name in _PER_CALL_FIELDS:
        msg.ClearField(name)
    return TAG_CALL + msg.SerializeToString()


def event_blob(event: r.RankEvent) -> bytes:
    msg = pb.Event()
    if not wire.event_to_pb(event, msg):
        raise ValueError(f"not an event: {type(event).__name__}")
    return TAG_EVENT + msg.SerializeToString()


def text_blob(text: str) -> bytes:
    return TAG_TEXT + text.encode("utf-8", "replace")


# ---- the shipping side ---------------------------------------------------------------------


def _extend(value: int, last: int) -> int:
    """The full value whose low 32 bits are ``value``, nearest to ``last``."""
    full = (last & ~(_WRAP - 1)) | value
    if full < last - _HALF:
        full += _WRAP
    elif full > last + _HALF and full >= _WRAP:
        full -= _WRAP
    return full


class RingEncoder:
    """Turns one rank's ring batches into wire batches. Not thread-safe: one per rank link."""

    def __init__(self, capacity: int = MAX_SIGNATURES) -> None:
        self.capacity = capacity
        self.blobs: dict[int, bytes] = {}  # bounded by the ring's blob area
        self._lanes: dict[int, tuple[str, int]] = {}  # signature blob -> (group, peer), for seqs
        self._collective: dict[int, str] = {}  # signature blob of a collective -> its group
        #: the collective seqs the rank's Python calls covered (Flight Recorder's reader asks)
        self.python = PythonSeqs()
        self.last_step = 0
        #: calls up to this id are the coordinator's already (a ring taken over from another
        #: agent is read from its start): only their coverage and exits are read
        self.skip_through = 0
        self._past_skip = False
        self._ids: collections.OrderedDict[int, int] = collections.OrderedDict()  # blob -> wire id
        self._free: list[int] = []
        self._next = 1
        self._last_call = 0
        self._last_step = 0
        self._last_seq: dict[tuple[str, int], int] = {}
        self.unnamed = 0  # calls whose signature blob was lost (the rank's blob area was full)
        #: ``decode``'s: signature blob -> the call it describes (None: not a call signature);
        #: bounded, as ``blobs`` is, by the ring's blob area
        self._templates: dict[int, r.CallRecord | None] = {}
        #: signature blobs whose calls may travel as runs (``_runnable``), and those a call of
        #: which was handed over alone since the last ``reset`` (a run never starts with a
        #: signature the coordinator has not seen alone)
        self._run_ok: dict[int, bool] = {}
        self._whole: set[int] = set()
        #: ``encode`` sends runs (``CallColumns.run``): the coordinator said it takes them
        self.send_runs = False
        #: runs may be cycles of signatures (``CallColumns.run_cycle``): the coordinator said it
        #: takes them (``decode`` too: the embedded agent's coordinator says so at registration)
        self.send_cycles = False
        #: fold the calls that repeat a cycle before they go (a node agent's, where the coordinator
        #: said it takes runs that cross steps)
        self.fold: SenderFold | None = None
        #: hold back a batch's trailing call under way, once (``_hold``): a node agent's, while
        #: the rank's link is open (its last read sends everything)
        self.hold = False
        self._held: list[RingSlot] = []
        #: the last batch gathered (``_gather``) held nothing a detector waits for: only calls
        #: of signatures shown before, each returned without error in the batch (or held back),
        #: and steps; the node agent reads a steady rank's ring less often (``Shipper``)
        self.steady = False
        #: gather in C (``client/_fastpath.c``) where built: the Python ``_gather_python`` is the
        #: reference and the fallback
        self.native = config.env_flag(config.ENV_NATIVE, True)

    def reset(self) -> None:
        """Forget the wire ids (after a registration: the coordinator's table starts empty)."""
        self._ids.clear()
        self._free.clear()
        self._next = 1
        self._whole.clear()
        if self.fold is not None:
            self.fold.reset()

    def _signature(self, blob_id: int, used: set[int], batch: pb.ReportBatch) -> int | None:
        sid = self._ids.get(blob_id)
        if sid is not None:
            self._ids.move_to_end(blob_id)
            return sid
        blob = self.blobs.get(blob_id)
        if blob is None or not blob.startswith(TAG_CALL):
            return None
        if len(self._ids) >= self.capacity:
            victim_blob, victim = next(iter(self._ids.items()))
            if victim in used:
                return None  # evicting it would change a call already in this batch
            del self._ids[victim_blob]
            sid = victim
        else:
            sid = self._next
            self._next += 1
        sig = batch.signatures.add(id=sid)
        try:
            sig.call.MergeFromString(blob[1:])
        except Exception:
            del batch.signatures[-1]
            return None
        self._ids[blob_id] = sid
        self._learn(blob_id, sig.call)
        if self.fold is not None:
            try:
                self.fold.define(sid, wire.call_from_pb(0, sig.call))
            except (wire.WireError, ValueError, OverflowError):
                self.fold.define(sid, None)
        return sid

    def _known(self, blob_id: int) -> None:
        """Learn a signature's group and peer without sending it."""
        if blob_id in self._lanes:
            return
        blob = self.blobs.get(blob_id)
        if blob is None or not blob.startswith(TAG_CALL):
            return
        call = pb.Call()
        try:
            call.MergeFromString(blob[1:])
        except Exception:
            return
        self._learn(blob_id, call)

    def _learn(self, blob_id: int, call: pb.Call) -> None:
        if blob_id not in self._lanes:
            self._lanes[blob_id] = (call.group, call.peer if call.HasField("peer") else -1)
            if r.op_kind(call.op) is r.OpKind.COLLECTIVE:
                self._collective[blob_id] = call.group
                # calls that may travel as runs: Python-issued collectives every rank numbers alike
                self._run_ok[blob_id] = (
                    not catalogue.uneven_seqs(call.op)
                    and call.source in ("", "python")
                    and not call.HasField("peer")
                    and not call.async_op
                )

    def _whole_call(
        self, blob_id: int, call_id: int, seq: int, step: int, t: float, batch: pb.ReportBatch
    ) -> pb.Call | None:
        """A call whose signature cannot get a wire id now (the id table is full of this batch's
        signatures) travels whole, as an event (its exit folded in if it comes in this batch:
        the decoder applies exits of calls outside the columns before everything else)."""
        blob = self.blobs.get(blob_id)
        if blob is None or not blob.startswith(TAG_CALL):
            return None
        call = batch.events.add().call
        try:
            call.MergeFromString(blob[1:])
        except Exception:
            del batch.events[-1]
            return None
        self._learn(blob_id, call)
        call.call_id, call.seq, call.step, call.enter_time = call_id, seq, step, t
        return call

    def _told(self, event: pb.Event) -> None:
        """Keep what the rank said of its groups: ``PythonSeqs.told`` (Flight Recorder's reader asks)."""
        if event.WhichOneof("body") == "group":
            self.python.told(event.group.group.name, event.group.kind == r.GroupEventKind.CREATED.value)

    def _seq(self, blob_id: int, seq32: int) -> int:
        lane = self._lanes.get(blob_id, ("", -1))
        full = _extend(seq32, self._last_seq.get(lane, 0))
        self._last_seq[lane] = full
        return full

    def encode(self, ring: Batch, batch: pb.ReportBatch) -> int:
        """Add ``ring``'s records to ``batch``; returns how many records it carries."""
        self.blobs.update(ring.blobs)
        cols = Columns()
        position: dict[int, int] = {}
        wholes: dict[int, pb.Call] = {}
        used: set[int] = set()
        carried = 0
        slots = self._hold(ring.slots)
        for s in self._gather(slots) if self.send_runs else slots:
            if isinstance(s, Run):
                carried += self._encode_run(s, cols, used, batch)
                continue
            kind = s.kind
            if kind == Kind.ENTER:
                call_id = self._last_call = _extend(s.call_id, self._last_call)
                step = self._last_step = _extend(s.step, self._last_step)
                if call_id <= self.skip_through:
                    self._known(s.ref)
                    self._entered(s.ref, call_id, self._seq(s.ref, s.seq), bool(s.flags & 1))
                    continue
                self._past_skip = True
                sid = self._signature(s.ref, used, batch)
                if sid is None:
                    seq = self._seq(s.ref, s.seq)
                    whole = self._whole_call(s.ref, call_id, seq, step, s.time, batch)
                    if whole is None:
                        self.unnamed += 1
                        continue
                    self._entered(s.ref, call_id, seq, bool(s.flags & 1))
                    wholes[call_id] = whole
                    carried += 1
                    continue
                used.add(sid)
                seq = self._seq(s.ref, s.seq)
                self._entered(s.ref, call_id, seq, bool(s.flags & 1))
                self._whole.add(s.ref)
                position[call_id] = cols.add(sid, call_id, seq, step, s.time, _NAN, 1)
            elif kind == Kind.EXIT:
                call_id = _extend(s.call_id, self._last_call)
                self.python.exited(call_id, s.aux or 1)
                i = position.get(call_id)
                whole_call = wholes.pop(call_id, None)
                if i is not None and not s.ref and cols.fold_exit(i, s.time, s.aux or 1):
                    pass
                elif whole_call is not None and not s.ref:
                    whole_call.exit_time = s.time
                    whole_call.seq_count = s.aux or 1
                else:
                    done = batch.events.add().done
                    done.call_id = call_id
                    done.exit_time = s.time
                    done.seq_count = s.aux or 1
                    text = self.blobs.get(s.ref, b"") if s.ref else b""
                    if text.startswith(TAG_TEXT):
                        done.error = text[1:].decode("utf-8", "replace")
                    elif s.ref:
                        done.error = "error (its text was lost)"
            elif kind == Kind.STEP:
                self._last_step = _extend(s.step, self._last_step)
                if self.skip_through and not self._past_skip:
                    continue  # a step the coordinator had before this ring changed hands
                step_msg = batch.events.add().step
                step_msg.step = self._last_step
                step_msg.time = s.time
            elif kind == Kind.EVENT:
                blob = self.blobs.get(s.ref, b"")
                if not blob.startswith(TAG_EVENT):
                    continue
                try:
                    batch.events.add().MergeFromString(blob[1:])
                except Exception:
                    del batch.events[-1]
                    continue
                self._told(batch.events[-1])
            else:
                continue
            carried += 1
        self._cover_held()
        if self.fold is not None:
            self.fold.send(cols, batch)
        cols.write(batch)
        self.last_step = self._last_step
        return carried

    def _template(self, blob_id: int, rank: int) -> r.CallRecord | None:
        if blob_id in self._templates:
            return self._templates[blob_id]
        blob = self.blobs.get(blob_id)
        if blob is None:
            return None  # not read yet: not remembered as no signature
        template = None
        if blob.startswith(TAG_CALL):
            msg = pb.Call()
            try:
                msg.MergeFromString(blob[1:])
                self._learn(blob_id, msg)
                template = wire.call_from_pb(rank, msg)
            except Exception:
                template = None
        self._templates[blob_id] = template
        return template

    def decode(
        self, ring: Batch, rank: int, cost: Callable[[r.CallRecord], int] | None = None, runs: bool = True
    ) -> list[r.RankEvent]:
        """``ring``'s records as typed events, in the order the rank wrote them: what ``encode``
        and the coordinator's decoder make of them, without the wire in between (the
        coordinator's embedded agent hands them to its own state). An exit in the same batch is
        folded into its call. ``cost``: a signature's byte cost (the memory budget's), worked
        out once per signature and carried by each call made from it. With ``runs``, calls
        alike travel as one :class:`records.CallRun` (see ``_gather``)."""
        self.blobs.update(ring.blobs)
        out: list[r.RankEvent] = []
        position: dict[int, r.CallRecord] = {}
        record = r.CallRecord
        slots = self._hold(ring.slots)
        for s in self._gather(slots) if runs else slots:
            if isinstance(s, Run):
                self._decode_run(s, out, rank, cost)
                continue
            kind = s.kind
            if kind == Kind.ENTER:
                call_id = self._last_call = _extend(s.call_id, self._last_call)
                step = self._last_step = _extend(s.step, self._last_step)
                async_op = bool(s.flags & 1)
                t = self._template(s.ref, rank)
                if call_id <= self.skip_through:  # the coordinator's already: coverage only
                    self._entered(s.ref, call_id, self._seq(s.ref, s.seq), async_op)
                    continue
                self._past_skip = True
                if t is None:
                    self.unnamed += 1
                    continue
                seq = self._seq(s.ref, s.seq)
                self._entered(s.ref, call_id, seq, async_op)
                self._whole.add(s.ref)
                if cost is not None and not t.cost:
                    t.cost = cost(t)
                call = record(
                    rank, call_id, t.op, t.group, seq, t.inputs, t.outputs, t.reduce_op, t.root, t.peer, async_op,
                    step, t.call_site, s.time, None, t.source, None, 1, t.extra, None, t.cost,
                )  # fmt: skip
                position[call_id] = call
                out.append(call)
            elif kind == Kind.EXIT:
                call_id = _extend(s.call_id, self._last_call)
                count = s.aux or 1
                self.python.exited(call_id, count)
                entered = position.pop(call_id, None)
                if entered is not None and not s.ref:
                    entered.exit_time = s.time
                    entered.seq_count = count
                    continue
                error = None
                if s.ref:
                    text = self.blobs.get(s.ref, b"")
                    error = (
                        text[1:].decode("utf-8", "replace")
                        if text.startswith(TAG_TEXT)
                        else "error (its text was lost)"
                    )
                out.append(r.CallExit(rank, call_id, s.time, error, count))
            elif kind == Kind.STEP:
                self._last_step = _extend(s.step, self._last_step)
                if self.skip_through and not self._past_skip:
                    continue  # a step the coordinator had before this ring changed hands
                out.append(r.StepEvent(rank, self._last_step, s.time))
            elif kind == Kind.EVENT:
                blob = self.blobs.get(s.ref, b"")
                if not blob.startswith(TAG_EVENT):
                    continue
                msg = pb.Event()
                try:
                    msg.MergeFromString(blob[1:])
                    out.append(wire.event_from_pb(rank, msg))
                except Exception:
                    continue
                self._told(msg)
        self._cover_held()
        self.last_step = self._last_step
        return out

    @property
    def holding(self) -> bool:
        """Whether an entry is held back for the next batch (``_hold``)."""
        return bool(self._held)

    def held_mark(self) -> list[RingSlot]:
        """What is held back now: ``held_restore`` puts it back when a batch is sent again."""
        return list(self._held)

    def held_restore(self, mark: list[RingSlot]) -> None:
        self._held = list(mark)

    def _hold(self, slots: Sequence[RingSlot]) -> Sequence[RingSlot]:
        """``slots``, the entry held back from the last batch first, and this batch's last slot
        held back when it is the entry of a call that may join a run and has not returned: a
        steady loop's call in flight as the ring was read, whose exit the next read brings. Sent
        alone, it would be a call under way of its own, and at scale every seq would get a slot
        from some rank's such call, which every other rank's run must then be matched into
        (at 1,024 ranks, slower than no runs at all). Held once, and only while
        ``hold``: a read that brings nothing new sends it, so a call that never returns (a hang)
        is told one read later; the record itself is in the ring all along."""
        held = self._held
        if held:
            self._held = []
            if not slots:
                return held  # nothing since: it is under way still
            slots = slots.after(held) if type(slots) is PackedSlots else [*held, *slots]
        if self.hold and len(slots) > 1:
            last = slots[-1]
            if (
                last.kind == Kind.ENTER
                and not last.flags & 1
                and last.ref in self._whole
                and self._run_ok.get(last.ref)
            ):
                self._held = [last]
                return slots.but_last() if type(slots) is PackedSlots else slots[:-1]
        return slots

    def _cover_held(self) -> None:
        """The call held back (``_hold``) is the rank's latest: its seq is a Python call's from
        now, as its ENTER was read (``python``: what the Flight Recorder's reader asks, once the
        ring is read past its read; else that read ships the call's entry as one from C++). The
        next batch enters it again, as the same call."""
        for s in self._held:
            lane = self._lanes.get(s.ref, ("", -1))
            call_id = _extend(s.call_id, self._last_call)
            self._entered(s.ref, call_id, _extend(s.seq, self._last_seq.get(lane, 0)), bool(s.flags & 1))

    def _gather(self, slots: Sequence[RingSlot]) -> Sequence[RingSlot | Run]:
        """``slots`` with each stretch of calls alike (``Run``: two or more, each an ENTER and its
        EXIT right after it, of a signature that may travel as runs and that a call handed over
        alone has shown already, ids and seqs one apart, one step, returned without error having
        issued one collective) in place of their slots. A training loop's steady state is
        mostly such stretches; where the coordinator's records were taken over from another
        agent (``skip_through``), nothing is gathered until they are past."""
        self.steady = False
        if self.skip_through and not self._past_skip:
            return slots
        cycles = self.send_cycles and len(slots) >= 4 * CYCLE_MIN
        shown = set(self._whole) if cycles else set()  # before the gatherer adds this batch's firsts
        if _native_gather is not None and self.native:
            # from the scan's bytes: a tuple only for a slot that goes alone or opens a run
            # (slots already tuples go in as the head, with no bytes)
            head, data, n = (
                (list(slots.head), slots.data, slots.n) if type(slots) is PackedSlots else (list(slots), b"", 0)
            )
            items, self.steady = _native_gather(
                head, data, n, self._whole, self._run_ok, self._known, RUN_MIN, RingSlot,
                (shown, self._lanes, CYCLE_MIN, MAX_CYCLE) if cycles else None,
            )  # fmt: skip
            return [Run.of(*x) if type(x) is tuple else x for x in items]  # a RingSlot is a tuple's subclass
        gathered, self.steady = ringruns.gather(list(slots), self._run_ok, self._whole, self._known)
        return ringruns.cycled(gathered, shown, self._run_ok, self._lanes) if cycles else gathered

    def _open_run(self, run: Run) -> tuple[int, int, int, int]:
        """A gathered run's first call id, seq and step, extended, and its length; the counters
        set past its last call."""
        k = len(run.enters)
        call_id = _extend(run.call_id, self._last_call)
        step = self._last_step = _extend(run.step, self._last_step)
        seq = self._seq(run.ref, run.seq)
        self._last_call = call_id + k - 1
        self._last_seq[self._lanes.get(run.ref, ("", -1))] = seq + k - 1
        self._past_skip = True
        self.python.ran(self._collective.get(run.ref, ""), seq, seq + k - 1)
        return call_id, seq, step, k

    def _decode_run(
        self, run: Run, out: list[r.RankEvent], rank: int, cost: Callable[[r.CallRecord], int] | None
    ) -> None:
        if not run.refs:  # one signature (the most of them)
            t = self._template(run.ref, rank)
            call_id, seq, step, _ = self._open_run(run)
            if t is None:  # cannot be: gathered runs are of signatures read already
                self.unnamed += len(run.enters)
                return
            if cost is not None and not t.cost:
                t.cost = cost(t)
            out.append(r.CallRun(rank, t, call_id, seq, step, run.enters, run.exits))
            return
        templates = [self._template(ref, rank) for ref in run.refs]
        call_id, seq, step, _ = self._open_run(run)
        if any(t is None for t in templates):  # cannot be: gathered runs are of signatures read already
            self.unnamed += len(run.enters)
            return
        for t in templates:
            assert t is not None
            if cost is not None and not t.cost:
                t.cost = cost(t)
        first, *cycle = templates
        assert first is not None
        out.append(r.CallRun(rank, first, call_id, seq, step, run.enters, run.exits, cycle=tuple(cycle)))  # type: ignore[arg-type]

    def _encode_run(self, run: Run, cols: Columns, used: set[int], batch: pb.ReportBatch) -> int:
        """A gathered run into ``batch``: one column entry (``Columns.add_run``); call by call, as
        whole calls, where its signature cannot get a wire id now. The calls it carries."""
        call_id, seq, step, k = self._open_run(run)
        sids: list[int | None] = []
        for ref in run.refs or (run.ref,):
            sid = self._signature(ref, used, batch)
            sids.append(sid)
            if sid is not None:
                used.add(sid)  # not evicted for the cycle's next signature (a small table)
        if any(sid is None for sid in sids):
            for i in range(k):
                whole = self._whole_call(run.ref_at(i), call_id + i, seq + i, step, run.enters[i], batch)
                if whole is None:
                    self.unnamed += 1
                    continue
                whole.exit_time = run.exits[i]
                whole.seq_count = 1
            return k
        first, *cycle = sids
        assert first is not None
        cols.add_run(first, call_id, seq, step, run.enters, run.exits, cycle)  # type: ignore[arg-type]
        return k

    def _entered(self, blob_id: int, call_id: int, seq: int, async_op: bool) -> None:
        group = self._collective.get(blob_id)
        if group is not None:
            self.python.entered(call_id, group, seq, async_op)
