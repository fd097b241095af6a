"""Where a rank's records go: its shared-memory ring (:mod:`hangwatch.ring`), written in place.

Every record is in the ring before the call it describes is issued, so whatever happens to the
rank afterwards, whoever holds the ring's descriptor (the node agent, over the rank's link) reads
it. The calling thread's hot path (``Recorder.enter``/``exit``) packs its slots itself; this
module is the rest: interning call signatures as blobs (once per signature), and the typed
events that are rare (steps, group changes, markers, the rank's end, Flight Recorder records,
async completions), written from any thread.

Slots are claimed with ``next()`` on the writer's ``itertools.count`` and written in the same
step (``RingWriter.put_slot``), so threads that issue collectives concurrently never share a slot, and
nothing that interrupts a thread leaves one claimed and unwritten.
"""

from __future__ import annotations

from collections.abc import Hashable

from hangwatch import records as r
from hangwatch.columns import _key as call_key
from hangwatch.ring import MAX_CAPACITY, Kind, RingWriter
from hangwatch.ringwire import call_blob, event_blob, text_blob

#: Signatures a rank interns; past this a new signature's calls travel with an empty reference
#: (counted as unnamed where they are read), as the blob area would soon be full anyway.
MAX_SIGNATURES = 16384


class RingSink:
    """A rank's ring and the tables that go with it. ``capacity`` slots, ``blob_bytes`` of blobs."""

    def __init__(self, capacity: int, blob_bytes: int = 4 << 20, rank: int = -1) -> None:
        capacity = min(max(2, capacity), MAX_CAPACITY)  # a configured 0 must not break the hook
        self.writer = RingWriter(capacity=capacity, blob_bytes=blob_bytes, rank=rank)
        self.capacity = capacity
        self.mm = self.writer.mm
        #: claims a slot and publishes a record there in one step (``RingWriter.put_slot``): the
        #: hot path calls it directly, with ``mm``, ``positions`` and ``capacity``
        self.put_slot = self.writer.put_slot
        self.positions = self.writer.positions
        self.signatures: dict[Hashable, int] = {}  # signature key -> blob id (0: could not store)

    @property
    def fd(self) -> int:
        return self.writer.fd

    def slot(self, kind: int, flags: int, aux: int, ref: int, call_id: int, seq: int, step: int, t: float) -> None:
        self.writer.write(kind, flags, aux, ref, call_id, seq, step, 0, t)

    def intern(self, key: Hashable, call: r.CallRecord | None) -> int:
        """The blob id of a signature, storing ``call``'s fixed part the first time ``key`` is seen."""
        ref = self.signatures.get(key)
        if ref is not None:
            return ref
        if call is None or len(self.signatures) >= MAX_SIGNATURES:
            return 0
        ref = self.writer.blob(call_blob(call))
        self.signatures[key] = ref
        return ref

    def text(self, text: str) -> int:
        """An error text's blob id: from the area's reserve, which signatures never fill."""
        return self.writer.blob(text_blob(text[:2000]), reserved=True)

    def put(self, event: r.RankEvent) -> None:
        """Write a typed event (not the hot path: steps, groups, markers, ends, records read
        from Flight Recorder, completions seen by the sender thread)."""
        if isinstance(event, r.CallRecord):
            ref = self.intern(call_key(event), event)
            flags = 1 if event.async_op else 0
            self.slot(Kind.ENTER, flags, 0, ref, event.call_id, event.seq, event.step, event.enter_time)
            if event.exit_time is not None:
                err = self.text(event.error) if event.error else 0
                self.slot(Kind.EXIT, 0, event.seq_count, err, event.call_id, 0, 0, event.exit_time)
        elif isinstance(event, r.CallExit):
            err = self.text(event.error) if event.error else 0
            self.slot(Kind.EXIT, 0, event.seq_count, err, event.call_id, 0, 0, event.exit_time)
        elif isinstance(event, r.StepEvent):
            self.slot(Kind.STEP, 0, 0, 0, 0, 0, event.step, event.time)
        elif isinstance(event, (r.GroupEvent, r.MarkerEvent, r.RankEnd)):
            # the rank's end and the hook's own say-so from the reserve, as error texts
            reserved = isinstance(event, r.RankEnd) or getattr(event, "name", "") == r.CAPTURE_OFF
            ref = self.writer.blob(event_blob(event), reserved=reserved)
            self.slot(Kind.EVENT, 0, 0, ref, 0, 0, 0, event.time)

    def set_status(self, text: str, t: float) -> None:
        self.writer.set_status(text, t)

    def close(self) -> None:
        self.writer.close()
