"""A rank's records in shared memory: written by the rank, read from outside it.

The evidence a rank leaves must outlive the rank: a record that waits in a Python queue dies with
a process that gloo aborts, the OOM killer SIGKILLs or a native call freezes with the GIL held.
So the hook writes each record into a memory region the node agent maps too, before the call it
describes is issued; whatever happens to the rank afterwards, the agent reads it.

The region is a ``memfd`` (anonymous, never on disk, private to whoever holds its descriptor),
handed to the node agent over a Unix socket; the agent reads it with :class:`RingReader`. Where no
agent runs on the node the rank's own sender thread reads it with the same reader: one format,
one fallback.

Layout (little endian)::

    header   HEADER_SIZE bytes: magic, version, geometry, the blob counters (see _HEADER), then
             the status: a short text the rank rewrites now and then (where its main thread
             is), guarded by a sequence counter (odd while being written)
    slots    capacity x SLOT_SIZE bytes: fixed-size records, a ring (the newest overwrite the
             oldest: what matters about a rank is what it did last)
    blobs    blob_bytes: append-only variable-size entries (a call signature's fixed part, an
             error text, a group) that slots refer to by id; when full, new blobs are counted
             as dropped and the slots that need them carry id 0. The last ``blob_reserve`` bytes
             are kept for error texts and the rank's end, which signatures never fill

Ordering: each slot carries its own position (plus one, so an empty slot reads as 0) at both
ends, and is published as a seqlock: the writer stores the front stamp, then a release fence,
then the body, then the end stamp by a store-release; the reader loads the end stamp by a
load-acquire, copies the body, then an acquire fence, then loads the front stamp, and takes the
slot at position ``p`` only when both stamps it loaded say ``p + 1``. Why that is safe: an end
stamp of ``p + 1`` seen first means the whole body of lap ``p`` was stored before it (release,
acquire); a writer that began the next lap of that slot before the copy ended stored its front
stamp before any of its body (release fence), so a copy that saw any of that body sees the new
front stamp after it (acquire fence) and is refused. Both stamps new around an old body cannot
be seen, as they could when both sides went front to end in one copy. So a slot being written
(stamps differ), not yet written (an older stamp) or overwritten during the copy is left for the
next poll, and a newer stamp means the writer lapped the reader: the skipped slots are counted
as lost, never returned torn. There is no shared head counter to update per record. Writers
claim a slot and publish it in one step (``RingWriter.put_slot``): the claim is ``next()`` on an
``itertools.count`` and, where the C extension is built, nothing runs between the claim and the
write, so threads that write at once never share a slot and no signal handler leaves a claimed
slot unwritten; any number of readers. Without the extension a slot claimed and never written
(an exception between the two) is skipped once later slots are published and it stayed a hole
for ``HOLE_WAIT_S`` (counted as lost). Blobs: a blob's bytes are in place before a store-release
of ``blob_used`` covers them, and before any slot names it; readers load ``blob_used`` by a
load-acquire, after the slots. The status is a seqlock too. The fences and atomic accesses are
C11's, in ``client/_fastpath.c``, wherever the extension is loaded (``hangwatch.native``);
without it the writes and reads are the interpreter's own copies, in the same order, which
x86-64 keeps in order and weakly ordered CPUs do not: there, build the extension
(``HANGWATCH_REQUIRE_NATIVE=1``).

Measured here (CPython 3.11, ``bench/ring_micro.py``): writing one record costs about as much as
appending a tuple to the deque the hook used before, and leaves no object for the garbage
collector; the figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

from hangwatch import config, native

MAGIC = b"HWRING01"
VERSION = 1

#: magic, version, header size, slot size, capacity, blob bytes, pid, rank, then the blob
#: counters (blob_used, blobs_dropped, blob_count) and a spare word.
_HEADER = struct.Struct("<8sIIIIQiiQQQQ")
HEADER_SIZE = 1024
_STATUS_OFFSET = 128
_STATUS = struct.Struct("<QdI")  # sequence (odd: being written), time, length; then the text
STATUS_MAX = HEADER_SIZE - _STATUS_OFFSET - _STATUS.size
_BLOB_USED_OFFSET = struct.calcsize("<8sIIIIQii")  # the counters, one u64 each, after the geometry
_BLOBS_DROPPED_OFFSET = _BLOB_USED_OFFSET + 8
_BLOB_COUNT_OFFSET = _BLOB_USED_OFFSET + 16
_U64 = struct.Struct("<Q")
_MASK = 0xFFFFFFFF
_CHUNK = 512  # slots a reader copies at once

#: One slot: stamp, kind, flags, aux (16 bits), ref (blob id), call id, seq, step, arg, time, stamp.
#: The stamps are the slot's position + 1 (see the module docstring). Ids, seq and step are kept
#: modulo 2**32; readers extend them.
SLOT = struct.Struct("<QBBHIIIIIdQ")
SLOT_SIZE = SLOT.size
_BLOB_HEAD = struct.Struct("<II")  # an entry's id and length, then its bytes

assert _HEADER.size <= HEADER_SIZE and _HEADER.size == _BLOB_COUNT_OFFSET + 16 and SLOT_SIZE == 48
_STATUS_BODY = struct.Struct("<dI")  # the status's time and length, after its sequence

#: A slot claimed and never written (possible only without the C extension: an exception between
#: the claim and the write) is skipped, and counted as lost, once one of the next
#: ``_HOLE_LOOKAHEAD`` slots is published and it has stayed unwritten this long (a thread
#: preempted between the two writes it within a few milliseconds).
HOLE_WAIT_S = 1.0
_HOLE_LOOKAHEAD = 2
_BLOB_RESERVE_MAX = 64 << 10


def blob_reserve(blob_bytes: int) -> int:
    """Bytes at the end of a blob area that only reserved blobs (error texts, the rank's end) use."""
    return min(_BLOB_RESERVE_MAX, blob_bytes // 8)


#: ``put(mm, positions, capacity, kind, flags, aux, ref, call_id, seq, step, arg, time)``: claims
#: the next slot and publishes a record there, in one step; returns its position.
PutSlot = Callable[[mmap.mmap, Iterator[int], int, int, int, int, int, int, int, int, int, float], int]


# ---- the publication protocol: C where the extension is loaded (``_bind``), Python otherwise ----


def _put_python(
    mm: mmap.mmap,
    positions: Iterator[int],
    capacity: int,
    kind: int,
    flags: int,
    aux: int,
    ref: int,
    call_id: int,
    seq: int,
    step: int,
    arg: int,
    t: float,
) -> int:
    h = next(positions)
    SLOT.pack_into(mm, HEADER_SIZE + (h % capacity) * SLOT_SIZE, h + 1, kind & 0xFF, flags & 0xFF, aux & 0xFFFF,
                   ref & _MASK, call_id & _MASK, seq & _MASK, step & _MASK, arg & _MASK, t, h + 1)  # fmt: skip
    return h


def _store_python(mm: mmap.mmap, offset: int, value: int) -> None:
    _U64.pack_into(mm, offset, value & 0xFFFFFFFFFFFFFFFF)


def _load_python(mm: mmap.mmap, offset: int) -> int:
    value: int = _U64.unpack_from(mm, offset)[0]
    return value


def _fence_python() -> None:
    return None


_blob_lock = threading.RLock()
_blob_busy = False


def _put_blob_python(mm: mmap.mmap, blobs_at: int, limit: int, data: bytes) -> int:
    """A blob appended and published (``blob_used`` last); its id, or 0 where there is no room
    (counted). Under a lock: any thread may write one. A blob asked for while another is half
    written in the same thread (by a signal handler that ran in between) is dropped, counted."""
    global _blob_busy
    with _blob_lock:
        if _blob_busy:
            _store_python(mm, _BLOBS_DROPPED_OFFSET, _load_python(mm, _BLOBS_DROPPED_OFFSET) + 1)
            return 0
        _blob_busy = True
        try:
            used, count = _load_python(mm, _BLOB_USED_OFFSET), _load_python(mm, _BLOB_COUNT_OFFSET)
            need = _BLOB_HEAD.size + len(data)
            if used + need > limit:
                _store_python(mm, _BLOBS_DROPPED_OFFSET, _load_python(mm, _BLOBS_DROPPED_OFFSET) + 1)
                return 0
            at = blobs_at + used
            _BLOB_HEAD.pack_into(mm, at, count + 1, len(data))
            mm[at + _BLOB_HEAD.size : at + need] = data
            _store_python(mm, _BLOB_COUNT_OFFSET, count + 1)
            _store_python(mm, _BLOB_USED_OFFSET, used + need)  # published last
            return count + 1
        finally:
            _blob_busy = False


_put: PutSlot = _put_python
#: a word stored after what it publishes (a blob's ``blob_used``, a status's even sequence)
_store_release: Callable[[mmap.mmap, int, int], None] = _store_python
#: a word stored before what it guards is written (a status's odd sequence)
_store_begin: Callable[[mmap.mmap, int, int], None] = _store_python
#: a word loaded before what it covers is read (``blob_used``, a status's sequence)
_load_acquire: Callable[[mmap.mmap, int], int] = _load_python
#: a word loaded again after what it guards was read (a status's sequence)
_load_after: Callable[[mmap.mmap, int], int] = _load_python
_fence_acquire: Callable[[], None] = _fence_python
_put_blob: Callable[[mmap.mmap, int, int, bytes], int] = _put_blob_python
_native_scan: Callable[..., tuple[bytes, int, tuple[int, int] | None]] | None = None
_bound = False


def _bind() -> None:
    """The protocol's C functions in place of the Python ones, where the extension is loaded
    (once; never at import: the extension's package imports this module)."""
    global _bound, _put, _store_release, _store_begin, _load_acquire, _load_after, _fence_acquire, _put_blob
    global _native_scan
    if _bound:
        return
    _bound = True
    ext = native.module()
    if ext is None:
        return
    if (ext.HEADER_SIZE, ext.SLOT_SIZE, ext.BLOB_USED_OFFSET) != (HEADER_SIZE, SLOT_SIZE, _BLOB_USED_OFFSET):
        raise RuntimeError("hangwatch: the C extension was built for another ring layout")
    _put, _store_release, _store_begin, _put_blob = ext.put_slot, ext.store_release, ext.store_begin, ext.put_blob
    _load_acquire, _load_after, _fence_acquire = ext.load_acquire, ext.load_after, ext.fence_acquire
    _native_scan = ext.scan_packed


class Kind:
    """What a slot records (its kind byte). Blobs are described in :mod:`hangwatch.ringwire`."""

    ENTER = 1  # a call about to be issued: ref = its signature blob, arg = flags of the call
    EXIT = 2  # a call returned: aux = collectives it issued, ref = error text blob (0: none)
    STEP = 3  # the training step advanced to ``step``
    EVENT = 4  # anything rare (a group created or destroyed, a marker, the rank's end): ref = its blob


class RingSlot(NamedTuple):
    """One record as read back: the struct's fields in order (a tuple: reading is the agent's
    hot path, thousands of records per second per rank)."""

    stamp: int  # position + 1
    kind: int
    flags: int
    aux: int
    ref: int
    call_id: int
    seq: int
    step: int
    arg: int
    time: float
    stamp_end: int

    @property
    def position(self) -> int:
        """From 0, in the order the writer wrote."""
        return self.stamp - 1


class PackedSlots(Sequence[RingSlot]):
    """Slots as the ring lays them out, in one bytes object (``data``: the C scan's copy), after
    the slots of ``head`` (an entry held back from the batch before): a :class:`RingSlot` is made
    only for a slot asked for. The C gatherer (``client/_fastpath.c`` ``gather_packed``) reads
    ``data`` itself and makes a tuple only for a slot that travels alone or opens a run; most of
    a steady rank's slots never become one. Indexing by a slice gives a list."""

    __slots__ = ("data", "head", "n")

    def __init__(self, data: bytes, head: Sequence[RingSlot] = (), n: int | None = None) -> None:
        self.data = data
        self.head: tuple[RingSlot, ...] = tuple(head)
        #: slots of ``data`` taken (its first ``n``)
        self.n = len(data) // SLOT_SIZE if n is None else n

    def __len__(self) -> int:
        return len(self.head) + self.n

    def _at(self, i: int) -> RingSlot:
        h = len(self.head)
        return self.head[i] if i < h else RingSlot._make(SLOT.unpack_from(self.data, (i - h) * SLOT_SIZE))

    @overload
    def __getitem__(self, i: int) -> RingSlot: ...
    @overload
    def __getitem__(self, i: slice) -> list[RingSlot]: ...
    def __getitem__(self, i: int | slice) -> RingSlot | list[RingSlot]:
        if isinstance(i, slice):
            return [self._at(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("slot index out of range")
        return self._at(i)

    def __iter__(self) -> Iterator[RingSlot]:
        yield from self.head
        if self.n:
            yield from map(RingSlot._make, SLOT.iter_unpack(memoryview(self.data)[: self.n * SLOT_SIZE]))

    def after(self, held: Sequence[RingSlot]) -> PackedSlots:
        """These slots after ``held``."""
        return PackedSlots(self.data, (*held, *self.head), self.n)

    def but_last(self) -> PackedSlots:
        """These slots but the last (there is one)."""
        if self.n:
            return PackedSlots(self.data, self.head, self.n - 1)
        return PackedSlots(self.data, self.head[:-1], 0)


@dataclass
class Batch:
    """What one :meth:`RingReader.poll` found: new slots and blobs, and what was lost. ``slots``
    is a list, or the C scan's :class:`PackedSlots`."""

    slots: Sequence[RingSlot]
    blobs: dict[int, bytes]
    lost: int  # slots overwritten before this reader got to them


#: The largest ring a hook makes and a reader takes (slots, then blob bytes): a descriptor
#: whose header says more is refused, so no header makes a reader map or scan without bound.
MAX_CAPACITY = 1 << 20
MAX_BLOB_BYTES = 64 << 20
#: The highest stamp a writer can reach (2^48 slots: a year at ten million a second); a slot
#: stamped higher is no writer's and is never taken, nor counted as a lap.
MAX_POSITION = 1 << 48
#: Seals a ring's memfd carries from its creation: it can never shrink under a reader's mapping
#: (an ``ftruncate`` would make the reader's next access a SIGBUS) or grow.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _map(fd: int, size: int, writable: bool) -> mmap.mmap:
    access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
    return mmap.mmap(fd, size, access=access)


class RingWriter:
    """The rank's side. Creates the region (a ``memfd``) and writes records into it.

    ``fd`` is what to hand the node agent (it keeps the region alive after the rank is gone)."""

    def __init__(self, capacity: int = 16384, blob_bytes: int = 1 << 20, rank: int = -1) -> None:
        if not 0 < capacity <= MAX_CAPACITY or not _BLOB_HEAD.size <= blob_bytes <= MAX_BLOB_BYTES:
            raise ValueError(f"ring capacity 1 to {MAX_CAPACITY} slots, blob area up to {MAX_BLOB_BYTES} bytes")
        self.capacity = capacity
        self.blob_bytes = blob_bytes
        self.size = HEADER_SIZE + capacity * SLOT_SIZE + blob_bytes
        self.fd = os.memfd_create("hangwatch-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)  # its size is fixed for every reader from now on
        self.mm = _map(self.fd, self.size, writable=True)
        self._blobs = HEADER_SIZE + capacity * SLOT_SIZE
        #: ``next(positions)`` claims the slot a record takes: atomic under the GIL, so threads
        #: that write at once never share one (the hook's hot path uses it directly too)
        self.positions = itertools.count()
        self.blob_used = 0
        self.blob_count = 0
        self.blobs_dropped = 0
        self._status_seq = 0
        _HEADER.pack_into(
            self.mm, 0, MAGIC, VERSION, HEADER_SIZE, SLOT_SIZE, capacity, blob_bytes, os.getpid(), rank, 0, 0, 0, 0
        )
        self.pack_slot = SLOT.pack_into  # the hook's hot path calls these directly
        self.slots_base = HEADER_SIZE
        self._pack_u64 = _U64.pack_into

    @property
    def put_slot(self) -> PutSlot:
        """``put(mm, positions, capacity, kind, flags, aux, ref, call_id, seq, step, arg, time)``:
        claims the next slot of a ring from ``positions`` and publishes a record there in one
        step (no slot claimed and left unwritten, whatever interrupts the writer); returns its
        position. The hook's hot paths call it directly, with this writer's ``mm``, ``positions``
        and ``capacity``."""
        _bind()
        return _put

    def write(
        self, kind: int, flags: int, aux: int, ref: int, call_id: int, seq: int, step: int, arg: int, t: float
    ) -> None:
        """Append one slot. Never blocks, never fails for lack of room (the oldest is overwritten)."""
        self.put_slot(self.mm, self.positions, self.capacity, kind, flags, aux, ref, call_id, seq, step, arg, t)

    def set_status(self, text: str, t: float) -> None:
        """Publish ``text`` (cut to :data:`STATUS_MAX` bytes) as the rank's current status."""
        _bind()
        data = text.encode("utf-8", "replace")[:STATUS_MAX]
        seq = self._status_seq
        _store_begin(self.mm, _STATUS_OFFSET, seq + 1)  # odd: readers retry
        _STATUS_BODY.pack_into(self.mm, _STATUS_OFFSET + 8, t, len(data))
        start = _STATUS_OFFSET + _STATUS.size
        self.mm[start : start + len(data)] = data
        self._status_seq = seq + 2
        _store_release(self.mm, _STATUS_OFFSET, seq + 2)

    @property
    def blob_reserve(self) -> int:
        return blob_reserve(self.blob_bytes)

    def blob(self, data: bytes, reserved: bool = False) -> int:
        """Store ``data``; returns its id (from 1), or 0 when the blob area is full (counted).
        Only a ``reserved`` blob (an error text, the rank's end) may use the area's last
        :attr:`blob_reserve` bytes. Safe from any thread."""
        _bind()
        limit = self.blob_bytes - (0 if reserved else self.blob_reserve)
        blob_id = _put_blob(self.mm, self._blobs, limit, data)
        self.blob_used, self.blob_count, self.blobs_dropped = (
            _load_python(self.mm, _BLOB_USED_OFFSET),
            _load_python(self.mm, _BLOB_COUNT_OFFSET),
            _load_python(self.mm, _BLOBS_DROPPED_OFFSET),
        )
        return blob_id

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)


@dataclass(frozen=True)
class Geometry:
    capacity: int
    blob_bytes: int
    pid: int
    rank: int

    @property
    def size(self) -> int:
        return HEADER_SIZE + self.capacity * SLOT_SIZE + self.blob_bytes


class RingError(ValueError):
    """The descriptor is not a hangwatch ring (or one of another version)."""


def read_geometry(buf: bytes | mmap.mmap) -> Geometry:
    if len(buf) < HEADER_SIZE:
        raise RingError(f"too small for a ring header ({len(buf)} bytes)")
    magic, version, header_size, slot_size, capacity, blob_bytes, pid, rank, *_ = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RingError("not a hangwatch ring (bad magic)")
    if version != VERSION or header_size != HEADER_SIZE or slot_size != SLOT_SIZE:
        raise RingError(f"ring version {version} (header {header_size}, slot {slot_size}) is not {VERSION}")
    if not 0 < capacity <= MAX_CAPACITY:
        raise RingError(f"ring capacity {capacity} is not 1 to {MAX_CAPACITY}")
    if not _BLOB_HEAD.size <= blob_bytes <= MAX_BLOB_BYTES:
        raise RingError(f"ring blob area of {blob_bytes} bytes is not {_BLOB_HEAD.size} to {MAX_BLOB_BYTES}")
    return Geometry(capacity, blob_bytes, pid, rank)


def _load_scan() -> None:
    """The slot scan in C, where the extension is loaded (see ``_bind``)."""
    _bind()


class RingReader:
    """The node agent's side (or the rank's own sender thread, where no agent runs).

    Reads a ring from its descriptor without ever writing to it; safe against a writer that
    keeps writing, and against one that died mid-record (a slot is only read once published)."""

    def __init__(self, fd: int) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RingError("not a ring: not a memory file")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # a file that cannot be sealed (not a memfd)
        if seals & fcntl.F_SEAL_SHRINK == 0:
            raise RingError("not a ring: its memfd is not sealed against shrinking")
        size = st.st_size
        if size < HEADER_SIZE:
            raise RingError(f"too small for a ring header ({size} bytes)")
        head_map = _map(fd, HEADER_SIZE, writable=False)
        try:
            self.geometry = read_geometry(head_map)
        finally:
            head_map.close()
        if size < self.geometry.size:
            raise RingError(f"ring is {size} bytes, its header says {self.geometry.size}")
        self.mm = _map(fd, self.geometry.size, writable=False)
        self.capacity = self.geometry.capacity
        self._blobs = HEADER_SIZE + self.capacity * SLOT_SIZE
        self.position = 0  # the next slot this reader wants
        #: read slots in C (``client/_fastpath.c``) where built; ``poll``'s Python loop is the
        #: reference and the fallback (``HANGWATCH_NATIVE=0``)
        self.native = config.env_flag(config.ENV_NATIVE, True)
        if self.native:
            _load_scan()
        self.blob_position = 0  # bytes of the blob area already read
        self.lost = 0

    def _u64(self, offset: int) -> int:
        value: int = _U64.unpack_from(self.mm, offset)[0]
        return value

    @property
    def blobs_dropped(self) -> int:
        return self._u64(_BLOBS_DROPPED_OFFSET)

    def blobs_waiting(self) -> bool:
        """Whether the writer published a blob this reader has not read yet (a call of a new
        kind, an error, a group): a look's cue to read now. One load, nothing consumed."""
        return min(_load_acquire(self.mm, _BLOB_USED_OFFSET), self.geometry.blob_bytes) > self.blob_position

    def status(self) -> tuple[float, str] | None:
        """The rank's latest status and when it was written; None if none (or it is mid-write)."""
        _bind()
        for _ in range(3):
            seq = _load_acquire(self.mm, _STATUS_OFFSET)
            if seq == 0:
                return None
            t, length = _STATUS_BODY.unpack_from(self.mm, _STATUS_OFFSET + 8)
            start = _STATUS_OFFSET + _STATUS.size
            data = bytes(self.mm[start : start + min(length, STATUS_MAX)])
            if seq % 2 == 0 and _load_after(self.mm, _STATUS_OFFSET) == seq:
                return t, data.decode("utf-8", "replace")
        return None

    def _new_blobs(self) -> dict[int, bytes]:
        used = min(_load_acquire(self.mm, _BLOB_USED_OFFSET), self.geometry.blob_bytes)
        out: dict[int, bytes] = {}
        at = self.blob_position
        while at + _BLOB_HEAD.size <= used:
            blob_id, length = _BLOB_HEAD.unpack_from(self.mm, self._blobs + at)
            end = at + _BLOB_HEAD.size + length
            if end > used:
                break  # cannot happen with a sane writer: blob_used covers whole entries
            out[blob_id] = bytes(self.mm[self._blobs + at + _BLOB_HEAD.size : self._blobs + end])
            at = end
        self.blob_position = at
        return out

    #: a hole (a slot claimed and never written) met at this position, and since when
    _hole_at = -1
    _hole_since = 0.0
    #: holes skipped so far (counted in ``lost`` too)
    holes = 0

    def _skip_hole(self, p: int, stopped: tuple[int, int]) -> bool:
        """Whether the slot at ``p``, which stopped a read unwritten, is a hole to step over: a
        slot after it is published, and it has been unwritten for ``HOLE_WAIT_S``."""
        if max(stopped) >= p + 1 or not any(self._published(q) for q in range(p + 1, p + 1 + _HOLE_LOOKAHEAD)):
            return False
        now = time.monotonic()
        if self._hole_at != p:
            self._hole_at, self._hole_since = p, now
            return False
        if now - self._hole_since < HOLE_WAIT_S:
            return False
        self.holes += 1
        return True

    def _read(self, position: int) -> RingSlot:
        return RingSlot._make(SLOT.unpack_from(self.mm, HEADER_SIZE + (position % self.capacity) * SLOT_SIZE))

    def head(self) -> int:
        """Slots written so far, found from the stamps (a scan of the ring, a chunk at a time in
        place: for rare questions)."""
        newest = 0
        end = HEADER_SIZE + self.capacity * SLOT_SIZE
        with memoryview(self.mm) as view:
            for at in range(HEADER_SIZE, end, _CHUNK * SLOT_SIZE):
                chunk = view[at : min(end, at + _CHUNK * SLOT_SIZE)]
                stamps = (rec[0] for rec in SLOT.iter_unpack(chunk) if rec[0] == rec[10] <= MAX_POSITION)
                newest = max(newest, max(stamps, default=0))
                chunk.release()
        return newest

    def poll(self, limit: int | None = None) -> Batch:
        """Everything published since the last poll (at most ``limit`` slots, oldest first)."""
        _bind()
        budget = self.capacity if limit is None else limit
        if self.native and _native_scan is not None:
            return self._poll_native(budget)
        out: list[RingSlot] = []
        lost = 0
        p = self.position
        make = RingSlot._make
        end_at, mm, fence = SLOT_SIZE - 8, self.mm, _fence_acquire
        while len(out) < budget:
            # a contiguous run of slots at a time, up to the ring's end, read in the protocol's
            # order: every end stamp, then every body, then every front stamp, a copy each
            index = p % self.capacity
            n = min(self.capacity - index, budget - len(out), _CHUNK)
            at = HEADER_SIZE + index * SLOT_SIZE
            ends = mm[at : at + n * SLOT_SIZE]
            fence()
            bodies = mm[at : at + n * SLOT_SIZE]
            fence()
            fronts = mm[at : at + n * SLOT_SIZE]
            stopped: tuple[int, int] | None = None
            for i, rec in enumerate(SLOT.iter_unpack(bodies)):
                end = _U64.unpack_from(ends, i * SLOT_SIZE + end_at)[0]
                front = _U64.unpack_from(fronts, i * SLOT_SIZE)[0]
                if front == end == p + 1:
                    out.append(make((front, *rec[1:10], end)))
                    p += 1
                else:
                    stopped = (front, end)
                    break
            if stopped is None:
                continue
            if stopped[0] == stopped[1] and p + 1 < stopped[0] <= MAX_POSITION:
                # lapped: go to the oldest slot still there (if it is being overwritten right
                # now its stamps differ, and the next poll skips again)
                skip_to = max(p + 1, self.head() - self.capacity)
                lost += skip_to - p
                p = skip_to
                continue
            if self._skip_hole(p, stopped):
                lost += 1
                p += 1
                continue
            break  # not written yet, or being written right now: the next poll takes it
        self.lost += lost
        self.position = p
        # after the slots: the writer stores a blob before the slot naming it, so every slot read
        # names a blob this read finds (read before the slots, a blob written in between was
        # missed while its slot was taken, and the call went unnamed)
        blobs = self._new_blobs()
        return Batch(slots=out, blobs=blobs, lost=lost)

    def _poll_native(self, budget: int) -> Batch:
        """``poll`` with its loop over slots in C (``client/_fastpath.c`` ``scan_packed``): the
        same slots, as :class:`PackedSlots`."""
        assert _native_scan is not None
        data = b""
        lost = 0
        p = self.position
        while len(data) < budget * SLOT_SIZE:
            got, p, stopped = _native_scan(self.mm, HEADER_SIZE, self.capacity, p, budget - len(data) // SLOT_SIZE)
            data = data + got if data else got
            if stopped is None:
                break  # the budget is spent
            if stopped[0] == stopped[1] and p + 1 < stopped[0] <= MAX_POSITION:
                skip_to = max(p + 1, self.head() - self.capacity)  # lapped, as ``poll`` says
                lost += skip_to - p
                p = skip_to
                continue
            if self._skip_hole(p, stopped):
                lost += 1
                p += 1
                continue
            break
        self.lost += lost
        self.position = p
        blobs = self._new_blobs()  # after the slots, as ``poll`` says
        return Batch(slots=PackedSlots(data), blobs=blobs, lost=lost)

    def _published(self, p: int) -> bool:
        at = HEADER_SIZE + (p % self.capacity) * SLOT_SIZE
        return self._u64(at + SLOT_SIZE - 8) == p + 1 and self._u64(at) == p + 1  # end stamp first

    def peek(self, since: int = 0) -> int:
        """Where the published slots end now (the position after the newest), looked up from
        ``since`` (or this reader's position, if later) by a binary search of the stamps: a
        few slots' stamps read, nothing copied and nothing consumed. -1 where the writer has
        lapped the position it starts from. A guess while the writer writes (two threads'
        slots may be published out of order): for when to read, not for what was written."""
        lo = max(since, self.position)
        if not self._published(lo):
            return -1 if lo + 1 < self._u64(HEADER_SIZE + (lo % self.capacity) * SLOT_SIZE) <= MAX_POSITION else lo
        hi = lo + self.capacity  # the same slot as ``lo``'s: not published at ``hi``
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._published(mid):
                lo = mid
            else:
                hi = mid
        return lo + 1

    def slot_at(self, position: int) -> RingSlot:
        """The slot at ``position`` as it lies now, whatever its stamps say (see ``peek``)."""
        return self._read(position)

    def counts(self) -> tuple[int, int]:
        """(unread, lost): slots published and not read yet (at most the capacity), and slots
        lost so far, those overwritten before this reader got to them included. A scan."""
        unread = self.head() - self.position
        overwritten = max(0, unread - self.capacity)
        return unread - overwritten, self.lost + overwritten

    def backlog(self) -> int:
        """Published slots not read yet (a scan: call it when a poll came back full)."""
        n = 0
        p = self.position
        while n < self.capacity:
            slot = self._read(p + n)
            if not slot.stamp == slot.stamp_end == p + n + 1:
                break
            n += 1
        return n

    def last(self, n: int) -> list[RingSlot]:
        """The newest ``n`` whole slots (for a rank that is gone: what was it doing last?)."""
        newest = self.head()
        out = []
        for p in range(max(0, newest - min(n, self.capacity)), newest):
            slot = self._read(p)
            if slot.stamp == slot.stamp_end == p + 1:
                out.append(slot)
        return out

    def close(self) -> None:
        self.mm.close()
