"""Coordinator memory over a long simulated job, in-process: RSS, traced heap, and what grew.

    .venv/bin/python bench/soak_memory.py --ranks 128 --steps 2400          # about 2-3 minutes here
    .venv/bin/python bench/soak_memory.py --ranks 1024 --steps 200000 --no-trace   # hours

Drives the same ``Flood`` as ``tests/diagnosis/test_bounded_memory.py`` into a real ``JobState``
(through ``JobState.ingest``, the daemon's entry point, with ``Engine.tick`` every ``TICK_S`` of
simulated time, like the daemon): per rank and step a
step event, two world all_reduces, one on its tensor-parallel and one on its data-parallel
group, a send/recv pair in a pipeline ring, a marker every 4 steps; some calls arrive already
complete, some exits are lost, ranks re-register with new sessions and batches are resent.
``--lossy N`` adds N calls per step on rank 0 whose exits never come (open calls at the cap).
No gRPC and a simulated clock, so hours of training run in minutes; what it measures is the
job state itself, not the servicer's buffers.

Prints markdown for BENCHMARKS.md: a table of checkpoints (RSS, traced heap, container sizes)
and the allocation sites whose live size changed most between the first and the last checkpoint
(``tracemalloc`` snapshot diff). Tracing starts before the flood exists (a late start reads as
growth: free lists keep untraced blocks in circulation) and costs about 5x in speed; RSS then
includes tracemalloc's own bookkeeping (printed separately). ``--no-trace`` for RSS alone.
"""

from __future__ import annotations

import argparse
import gc
import linecache
import os
import sys
import time
import tracemalloc
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.diagnosis.test_bounded_memory import sizes
from tests.flood import Flood

MiB = 2**20
#: Container sizes shown per checkpoint (keys of ``sizes()``), with short column names.
COLUMNS = {
    "slot.calls(all slots)": "calls in slots",
    "job.slots[sum]": "slots",
    "rank.history(all ranks)": "calls in histories",
    "rank.open_calls(all ranks)": "open calls",
    "job.p2p_open": "p2p_open",
    "job.groups": "groups",
    "job.sessions": "sessions",
}


def _site(traceback: tracemalloc.Traceback) -> str:
    frame = traceback[0]
    path = Path(frame.filename)
    parts = path.parts
    for anchor in ("hangwatch", "tests", "bench"):
        if anchor in parts:
            path = Path(*parts[parts.index(anchor) :])
            break
    else:
        path = Path(path.name)
    code = linecache.getline(frame.filename, frame.lineno).strip()
    code = code if len(code) <= 60 else code[:57] + "..."
    return f"`{path}:{frame.lineno}` `{code}`" if code else f"`{path}:{frame.lineno}`"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=128)
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel group size (divides --ranks)")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--step-s", type=float, default=0.25, help="simulated seconds per training step")
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--lossy", type=int, default=0, help="calls per step on rank 0 whose exits are lost")
    parser.add_argument("--top", type=int, default=10, help="allocation sites listed")
    parser.add_argument("--no-trace", action="store_true", help="RSS only (about 5x faster)")
    args = parser.parse_args()
    trace = not args.no_trace

    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    if trace:
        tracemalloc.start()
    wall0 = time.perf_counter()
    flood = Flood(args.ranks, tp=args.tp, step_s=args.step_s, lossy_marker_calls=args.lossy)
    period = flood.period
    every = max(period, args.steps // args.checkpoints // period * period)
    points = list(range(every, args.steps + 1, every))
    rows: list[str] = []
    first_snap: tracemalloc.Snapshot | None = None
    last_snap: tracemalloc.Snapshot | None = None
    first_traced = last_traced = 0
    for i, point in enumerate(points):
        flood.run_to(point)
        gc.collect()
        rss = proc.memory_info().rss
        traced = tracemalloc.get_traced_memory()[0] if trace else 0
        overhead = tracemalloc.get_tracemalloc_memory() if trace else 0
        if trace and i == 0:
            first_snap, first_traced = tracemalloc.take_snapshot(), traced
        if trace and i == len(points) - 1:
            last_snap, last_traced = tracemalloc.take_snapshot(), traced
        s = sizes(flood.job, flood.engine)
        sim_min = point * args.step_s / 60
        cols = " | ".join(f"{s.get(key, 0):,}" for key in COLUMNS)
        traced_col = f"{traced / MiB:.2f} | {overhead / MiB:.1f}" if trace else "- | -"
        rows.append(
            f"| {point:,} | {sim_min:,.1f} | {flood.job.records_received:,} | {(rss - rss0) / MiB:.1f} | "
            f"{traced_col} | {cols} | {time.perf_counter() - wall0:.0f} |"
        )
        print(f"  ... step {point:,} of {args.steps:,}", file=sys.stderr, flush=True)
    if trace:
        tracemalloc.stop()

    print(
        f"soak_memory: {args.ranks} ranks (tp {args.tp}), {points[-1]:,} steps of {args.step_s:g} s "
        f"({points[-1] * args.step_s / 3600:.2f} h simulated), lossy {args.lossy}/step, "
        f"{len(flood.opened)} incidents; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n"
    )
    print(
        "| step | simulated min | records applied | RSS Δ (MiB) | traced (MiB) | tracemalloc own (MiB) | "
        + " | ".join(COLUMNS.values())
        + " | wall (s) |"
    )
    print("|" + " --- |" * (7 + len(COLUMNS)))
    print("\n".join(rows))
    if first_snap is None or last_snap is None:
        return
    print(
        f"\nTraced heap from step {points[0]:,} to {points[-1]:,}: {first_traced / MiB:.3f} -> "
        f"{last_traced / MiB:.3f} MiB ({(last_traced - first_traced) / 1024:+.1f} KiB). "
        f"Top {args.top} allocation sites by change in live size:\n"
    )
    print("| site | live size Δ | live blocks Δ | live size at the end |")
    print("| --- | --- | --- | --- |")
    diffs = last_snap.compare_to(first_snap, "lineno")
    diffs.sort(key=lambda d: abs(d.size_diff), reverse=True)
    for d in diffs[: args.top]:
        print(
            f"| {_site(d.traceback)} | {d.size_diff / 1024:+.1f} KiB | {d.count_diff:+,} | {d.size / 1024:,.1f} KiB |"
        )
    print(
        "\nLargest live allocation sites at the end (what the state is made of; records are built by the "
        "flood, where the coordinator's would come from `hangwatch/wire.py`):\n"
    )
    print("| site | live size | live blocks |")
    print("| --- | --- | --- |")
    for st in last_snap.statistics("lineno")[: args.top]:
        print(f"| {_site(st.traceback)} | {st.size / MiB:.2f} MiB | {st.count:,} |")


if __name__ == "__main__":
    main()
