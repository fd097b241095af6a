"""The hook's fast path and ring write, in C and in Python, on whatever Python runs this; no torch.

    .venv/bin/python bench/fastpath_micro.py            # one line of JSON
    .venv/bin/python scripts/check_native.py --bench    # on every Python the machine has: a table

A repeated ``all_reduce`` call site through the real wrapper (``capture._wrap_op``) and the real
recorder and ring, against the stand-in process group and tensors of the hook's own tests
(``tests/client/fakes.py``), with a backend that only advances the group's counter; the same
loop with the backend alone is subtracted, so each figure is what the hook adds per call on the
calling thread, warm. Then one ring record written by ``RingWriter.put_slot`` (C) and by its
Python fallback. Medians of ``--repeats`` runs of ``--calls`` calls, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # ``tests`` (after an installed or copied ``hangwatch``)


def _per_call(loop: Callable[[int], None], calls: int, repeats: int) -> float:
    """Median seconds per call of ``loop(calls)`` over ``repeats`` runs, after one warm-up."""
    loop(calls // 10)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop(calls)
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def _wrapper_us(native_env: str, calls: int, repeats: int) -> tuple[float, int | None]:
    """What the wrapper adds per call, and how many calls the C path served (None: Python's)."""
    os.environ["HANGWATCH_NATIVE"] = native_env
    from hangwatch.client import capture
    from hangwatch.client.ops import OPS_BY_NAME
    from tests.client.fakes import FakeC10d, make_session, ones

    session = make_session(c10d=FakeC10d(0, world_size=2), ring=1 << 16)
    session.recorder.covers = False  # a linked rank: Flight Recorder read from outside
    capture.set_session(session)
    pg = session.recorder.default_pg

    def backend(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        pg.seq += 1

    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], backend)
    t = ones(4)

    def hooked(n: int) -> None:
        for _ in range(n):
            wrapped(t)

    def bare(n: int) -> None:
        for _ in range(n):
            backend(t)

    try:
        cost = _per_call(hooked, calls, repeats) - _per_call(bare, calls, repeats)
    finally:
        capture.set_session(None)
    return cost * 1e6, getattr(wrapped, "served", None)


def _ring_us(native_write: bool, calls: int, repeats: int) -> float:
    from hangwatch import ring
    from hangwatch.ring import Kind, RingWriter

    w = RingWriter(capacity=1 << 12, blob_bytes=64)
    put = w.put_slot if native_write else ring._put_python
    mm, positions, capacity = w.mm, w.positions, w.capacity

    def loop(n: int) -> None:
        for i in range(n):
            put(mm, positions, capacity, Kind.ENTER, 0, 0, 5, i, i, 0, 0, 0.0)

    try:
        return _per_call(loop, calls, repeats) * 1e6
    finally:
        w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from hangwatch import native

    built = native.module() is not None
    os.environ.pop("HANGWATCH_NATIVE", None)
    hook = native.describe()
    python_us, _ = _wrapper_us("0", args.calls, args.repeats)
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "hook": hook,
        "python_fast_path_us": round(python_us, 3),
        "ring_write_python_us": round(_ring_us(False, args.calls, args.repeats), 3),
    }
    if built:
        c_us, served = _wrapper_us("1", args.calls, args.repeats)
        assert served, "the C fast path is built, yet it served no call"
        out["c_fast_path_us"] = round(c_us, 3)
        out["ring_write_c_us"] = round(_ring_us(True, args.calls, args.repeats), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
