"""What it costs a rank to put one call's records outside itself, side by side in one run.

    python bench/ring_micro.py [--calls 200000] [--repeats 7]

Per call (an enter and an exit record, as the hook writes them), on the calling thread:

- ``deque``: the hook's queue before the ring (a raw tuple appended per record; the sender
  thread later turns it into objects and protobuf, a cost not counted here);
- ``ring``: two slots packed into the shared-memory ring (:mod:`hangwatch.ring`), as the hook's
  hot path writes them (``pack_into`` directly);
- ``dgram``: a slot-sized Unix datagram per record to a reader that drains it (what a
  socket-per-record design would pay).

Also the garbage collector: collections run while a million-record backlog builds up in each
(a coordinator that is down leaves the deque full; the ring holds no Python object per record).
Medians of ``--repeats`` runs, and the ratio to ``deque``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatch.ring import SLOT, Kind, RingReader, RingWriter


def time_deque(calls: int) -> float:
    q: collections.deque[tuple[object, ...]] = collections.deque(maxlen=65536)
    put = q.append
    now = time.time
    spec, name, ins = object(), "0", ((4,), "float32", False)
    t0 = time.perf_counter()
    for i in range(calls):
        put((i, spec, name, i, ins, ins, "sum", None, None, False, 0, "train.py:1", now(), None))
        put((i, now(), None, 1))
    return (time.perf_counter() - t0) / calls


def time_ring(calls: int) -> float:
    w = RingWriter(capacity=16384, blob_bytes=4096)
    put, mm, positions, cap = w.put_slot, w.mm, w.positions, w.capacity
    now = time.time
    t0 = time.perf_counter()
    for i in range(calls):  # as the hook writes: a slot claimed and published in one call
        put(mm, positions, cap, Kind.ENTER, 0, 0, 1, i, i, 0, 0, now())
        put(mm, positions, cap, Kind.EXIT, 0, 1, 0, i, 0, 0, 0, now())
    elapsed = (time.perf_counter() - t0) / calls
    w.close()
    return elapsed


def time_dgram(calls: int) -> float:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    stop = threading.Event()

    def drain() -> None:
        b.settimeout(0.2)
        while not stop.is_set():
            try:
                b.recv(64)
            except OSError:
                pass

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    a.setblocking(False)
    send, pack, now = a.send, SLOT.pack, time.time
    t0 = time.perf_counter()
    for i in range(calls):
        try:
            send(pack(i, Kind.ENTER, 0, 0, 1, i, i, 0, 0, now(), i))
            send(pack(i, Kind.EXIT, 0, 1, 0, i, 0, 0, 0, now(), i))
        except BlockingIOError:
            pass  # a full socket drops, as the hook would
    elapsed = (time.perf_counter() - t0) / calls
    stop.set()
    t.join()
    a.close()
    b.close()
    return elapsed


def gc_during_backlog(records: int, kind: str) -> int:
    """Generation-0..2 collections while ``records`` accumulate unread."""
    gc.collect()
    before = sum(s["collections"] for s in gc.get_stats())
    if kind == "deque":
        q: collections.deque[tuple[object, ...]] = collections.deque(maxlen=records)
        for i in range(records):
            q.append((i, "0", i, ((4,), "float32"), time.time(), [i]))  # a list inside, as shapes are
    else:
        w = RingWriter(capacity=records, blob_bytes=64)
        for i in range(records):
            w.write(Kind.ENTER, 0, 0, 1, i, i, 0, 0, time.time())
        w.close()
    return sum(s["collections"] for s in gc.get_stats()) - before


def reader_cost(calls: int, native: bool = True) -> float:
    """The node agent's side: reading one call's two slots back (``native``: the slot loop in C,
    where the extension is built; else the Python loop)."""
    w = RingWriter(capacity=2 * calls, blob_bytes=64)
    for i in range(calls):
        w.write(Kind.ENTER, 0, 0, 1, i, i, 0, 0, 0.0)
        w.write(Kind.EXIT, 0, 1, 0, i, 0, 0, 0, 0.0)
    r = RingReader(w.fd)
    r.native = native
    t0 = time.perf_counter()
    batch = r.poll(limit=2 * calls)
    elapsed = (time.perf_counter() - t0) / calls
    assert len(batch.slots) == 2 * calls
    r.close()
    w.close()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, pid {os.getpid()}, {args.calls} calls x {args.repeats} repeats")
    runs: dict[str, Callable[[int], float]] = {"deque": time_deque, "ring": time_ring, "dgram": time_dgram}
    results: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        for name, fn in runs.items():
            results[name].append(fn(args.calls) * 1e6)
    base = statistics.median(results["deque"])
    print(f"{'per call (enter + exit)':<28}{'median us':>10}{'min':>8}{'max':>8}{'vs deque':>10}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<28}{med:>10.3f}{min(values):>8.3f}{max(values):>8.3f}{med / base:>10.2f}")
    python_read = statistics.median(reader_cost(args.calls, native=False) * 1e6 for _ in range(3))
    read = statistics.median(reader_cost(args.calls) * 1e6 for _ in range(3))
    print(f"{'ring, reader side, Python':<28}{python_read:>10.3f}")
    print(f"{'ring, reader side, C scan':<28}{read:>10.3f}{'':>16}{python_read / read:>10.2f}x")
    for kind in ("deque", "ring"):
        print(f"gc collections while 1,000,000 records pile up ({kind}): {gc_during_backlog(1_000_000, kind)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
