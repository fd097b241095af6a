"""The ring's publication protocol (a seqlock per slot, ``hangwatch/ring.py``): whatever the order
in which a writer's stores and a reader's loads meet, the reader takes a slot whole or not at all.

By hand first: a slot of one lap is overwritten by the next lap's record in the writer's three
steps (front stamp, body, end stamp), played into every gap between the reader's three steps
(end stamp, body, front stamp) of the C scan and of the Python reader, on a real ring. Then for
real: a writer thread and a reader process, for a few seconds, with the writer lapping the reader.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hangwatch import native, ring
from hangwatch.ring import HEADER_SIZE, SLOT, SLOT_SIZE, Kind, RingReader, RingSlot, RingWriter

EXT = native.module()
CAPACITY = 4
OLD, NEW = 100, 999  # the call ids of the slot's record before and after it is overwritten
WANT = 1 + CAPACITY  # the position the reader wants: the slot of position 1, next lap
AT = HEADER_SIZE + (WANT % CAPACITY) * SLOT_SIZE

#: where each of the writer's steps falls: before the reader's first step (0), after its first
#: (1), second (2) or third (3); the writer's steps keep their order
INTERLEAVINGS = [g for g in itertools.product(range(4), repeat=3) if g[0] <= g[1] <= g[2]]
#: the interleaving the review played: the writer's front stamp, the reader's first two loads,
#: the rest of the writer's record, the reader's last load
REVIEWED = (0, 2, 2)


def _ring() -> tuple[RingWriter, RingReader]:
    w = RingWriter(capacity=CAPACITY, blob_bytes=64)
    for p in range(CAPACITY):
        w.write(Kind.EXIT, 0, 1, 0, OLD if p == WANT % CAPACITY else p, 0, 0, 0, float(p))
    reader = RingReader(w.fd)
    reader.position = WANT  # it read everything before
    return w, reader


def _writer_steps(w: RingWriter) -> list[Callable[[], None]]:
    """The next lap's record at WANT, stored as the writers store it: front stamp, body, end stamp."""
    record = SLOT.pack(WANT + 1, Kind.EXIT, 0, 1, 0, NEW, 0, 0, 0, float(NEW), WANT + 1)

    def store(lo: int, hi: int) -> Callable[[], None]:
        def step() -> None:
            w.mm[AT + lo : AT + hi] = record[lo:hi]

        return step

    return [store(0, 8), store(8, SLOT_SIZE - 8), store(SLOT_SIZE - 8, SLOT_SIZE)]


def _play(gaps: tuple[int, ...], w: RingWriter) -> Iterator[None]:
    """Runs the writer's steps due in each gap, one gap per ``next``."""
    steps = _writer_steps(w)
    for gap in range(4):
        for i, g in enumerate(gaps):
            if g == gap:
                steps[i]()
        yield


def _take_c(w: RingWriter, reader: RingReader, gaps: tuple[int, ...]) -> RingSlot | None:
    assert EXT is not None
    play = _play(gaps, w)
    next(play)
    whole, data = EXT._take_steps(w.mm, CAPACITY, WANT, lambda step: next(play))
    next(play, None)
    return RingSlot._make(SLOT.unpack(data)) if whole else None


def _take_python(
    w: RingWriter, reader: RingReader, gaps: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> RingSlot | None:
    play = _play(gaps, w)
    next(play)
    monkeypatch.setattr(ring, "_fence_acquire", lambda: next(play))  # between the reader's copies
    reader.native = False
    slots = reader.poll(1).slots
    next(play, None)
    return slots[0] if slots else None


@pytest.mark.parametrize("side", ["C", "Python"])
def test_no_interleaving_hands_the_reader_a_torn_slot(side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if side == "C" and EXT is None:
        pytest.skip("the C extension is not built here")
    ring._bind()
    taken: dict[tuple[int, ...], int | None] = {}
    for gaps in INTERLEAVINGS:
        w, reader = _ring()
        try:
            with monkeypatch.context() as patch:
                slot = _take_c(w, reader, gaps) if side == "C" else _take_python(w, reader, gaps, patch)
        finally:
            reader.close()
            w.close()
        if slot is not None:
            # whole: the record its stamps say, never the lap before under the new stamps
            assert (slot.stamp, slot.stamp_end, slot.call_id, slot.time) == (WANT + 1, WANT + 1, NEW, float(NEW)), gaps
        taken[gaps] = None if slot is None else slot.call_id
    assert taken[REVIEWED] is None  # refused: the next poll takes it whole
    assert taken[(0, 0, 0)] == NEW  # published before the reader came: taken
    assert taken[(3, 3, 3)] is None  # not yet written when the reader came: left for later
    assert sum(1 for v in taken.values() if v is not None) == 1
    w, reader = _ring()  # and the reader's own poll, once the record is stored whole
    for step in _writer_steps(w):
        step()
    assert [s.call_id for s in reader.poll().slots] == [NEW]
    reader.close()
    w.close()


_READER = textwrap.dedent(
    """
    import json, os, sys, time
    from hangwatch.ring import RingReader
    reader = RingReader(int(sys.argv[1]))
    got = torn = disorder = 0
    last = -1
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        for s in reader.poll(4096).slots:
            p = s.position
            if (s.call_id, s.seq, s.step, s.arg, s.aux, s.time) != (
                p & 0xFFFFFFFF, (p * 7) & 0xFFFFFFFF, (p * 3) & 0xFFFFFFFF, (p * 5) & 0xFFFFFFFF, p & 0xFFFF, float(p)
            ):
                torn += 1
            if p <= last:
                disorder += 1
            last = p
            got += 1
    print(json.dumps({"got": got, "torn": torn, "disorder": disorder, "lost": reader.lost}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("native_reader", [True, False], ids=["C reader", "Python reader"])
def test_a_reader_process_never_gets_a_torn_slot_from_a_writer_thread(native_reader: bool) -> None:
    """A small ring, so that the writer laps the reader all the time: every slot read is whole."""
    w = RingWriter(capacity=64, blob_bytes=64)
    stop = threading.Event()
    written = 0

    def write() -> None:
        nonlocal written
        p = 0
        while not stop.is_set():
            w.write(Kind.ENTER, 0, p, 0, p, p * 7, p * 3, p * 5, float(p))
            p += 1
        written = p

    thread = threading.Thread(target=write)
    thread.start()
    env = {**os.environ, "HANGWATCH_NATIVE": "1" if native_reader else "0"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _READER, str(w.fd), "2.0"],
            pass_fds=(w.fd,),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop.set()
        thread.join(10)
        w.close()
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["torn"] == 0 and found["disorder"] == 0, found
    assert found["got"] > 100 and found["got"] + found["lost"] <= written


@pytest.mark.parametrize("side", ["C", "Python"])
def test_blobs_written_from_many_threads_each_get_an_id_of_their_own(
    side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if side == "C" and EXT is None:
        pytest.skip("the C extension is not built here")
    ring._bind()
    if side == "Python":
        monkeypatch.setattr(ring, "_put_blob", ring._put_blob_python)
    w = RingWriter(capacity=4, blob_bytes=1 << 20)
    reader = RingReader(w.fd)
    got: list[tuple[int, bytes]] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes they can

    def write(thread: int) -> None:
        for i in range(300):
            data = f"thread {thread} blob {i} ".encode() * (1 + i % 3)
            got.append((w.blob(data), data))

    try:
        threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    finally:
        sys.setswitchinterval(interval)
    ids = [blob_id for blob_id, _ in got]
    assert sorted(ids) == list(range(1, 8 * 300 + 1))  # one id each, none shared, none skipped
    assert reader.poll().blobs == dict(got)  # and each one's bytes under it
    reader.close()
    w.close()


@pytest.mark.parametrize("native_reader", [True, False], ids=["C reader", "Python reader"])
def test_a_slot_claimed_and_never_written_is_stepped_over_once_later_ones_are_published(
    native_reader: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the C extension a writer interrupted between its claim and its write leaves a
    hole: the reader steps over it (counted as lost) once a later slot is published and the hole
    stayed one for ``HOLE_WAIT_S``; a slot being written is waited for."""
    if native_reader and EXT is None:
        pytest.skip("the C extension is not built here")
    monkeypatch.setattr(ring, "HOLE_WAIT_S", 0.05)
    w = RingWriter(capacity=16, blob_bytes=64)
    reader = RingReader(w.fd)
    reader.native = native_reader
    for p in range(3):
        w.write(Kind.STEP, 0, 0, 0, 0, 0, p, 0, float(p))
    next(w.positions)  # claimed, never written
    for p in range(4, 7):
        w.write(Kind.STEP, 0, 0, 0, 0, 0, p, 0, float(p))
    assert [s.position for s in reader.poll().slots] == [0, 1, 2]
    assert len(reader.poll().slots) == 0  # not yet: it may be written still
    time.sleep(0.1)
    batch = reader.poll()
    assert [s.position for s in batch.slots] == [4, 5, 6]
    assert batch.lost == reader.lost == reader.holes == 1
    h = next(w.positions)  # a slot being written: its front stamp only
    w.pack_slot(w.mm, HEADER_SIZE + (h % 16) * SLOT_SIZE, h + 1, Kind.STEP, 0, 0, 0, 0, 0, 0, 0, 0.0, 0)
    w.write(Kind.STEP, 0, 0, 0, 0, 0, 8, 0, 8.0)
    assert len(reader.poll().slots) == 0
    time.sleep(0.1)
    assert len(reader.poll().slots) == 0 and reader.holes == 1  # waited for, never stepped over
    reader.close()
    w.close()
