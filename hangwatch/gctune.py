"""Python's cyclic garbage collector, set for a long-running hangwatch daemon.

A daemon that ingests batches allocates and frees containers by the million: a run of calls, its
lists of times, a slice of a rank's history. A young pass walks every young object still alive,
and a coordinator's are mostly each rank's newest run (at 16,384 ranks, 70,000 to 127,000 a pass,
none of them garbage: reference counting frees the rest). With the default first threshold (700
allocations net of frees) it runs often; with 100,000 it runs rarely (BENCHMARKS.md has the
figures). What start-up made (modules, the gRPC server, the store) is frozen out of the
collector's walks.

Only daemons call :func:`tune` (the process is theirs); the hook in a rank never does: the
training job's collector is the job's own.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 100_000


def tune() -> None:
    """Raise the young generation's threshold (never lower it) and freeze what exists now.
    Idempotent; a process that set a higher threshold keeps it."""
    young, middle, old = gc.get_threshold()
    if young and young < YOUNG_THRESHOLD:  # 0: the collector is off, and stays off
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    gc.freeze()
