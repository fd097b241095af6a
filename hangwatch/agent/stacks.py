"""Stacks of many ranks at once (their views for a report: ``hangwatch.stackviews``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Protocol

from hangwatch.agent.identity import verify
from hangwatch.agent.procinfo import ProcessInspector
from hangwatch.agent.pyspy import dump_stacks
from hangwatch.records import StackDump, Target


class Dumper(Protocol):
    """What dumps one process (``pyspy.dump_stacks`` or a fake)."""

    def __call__(self, pid: int, *, native: bool = ..., timeout_s: float = ...) -> StackDump: ...


#: Seconds ``dump_many`` waits beyond ``timeout_s`` for dumps to come back (process start-up).
SLACK_S = 1.0


def dump_many(
    targets: Sequence[Target],
    *,
    native: bool,
    timeout_s: float,
    inspector: ProcessInspector,
    dumper: Dumper = dump_stacks,
    max_workers: int = 8,
) -> dict[int, StackDump]:
    """Dump every target in parallel, keyed by rank; targets failing :func:`verify` are refused.

    Each dump gets at most ``timeout_s`` and none starts after the shared deadline, so the call
    returns within about ``timeout_s + SLACK_S`` however many targets there are.
    """
    deadline = time.monotonic() + timeout_s + SLACK_S

    def one(target: Target) -> StackDump:
        refused = verify(target, inspector)
        if refused:
            return StackDump(target.pid, time.time(), native=native, error=f"refused: {refused}")
        budget = min(timeout_s, deadline - SLACK_S / 2 - time.monotonic())
        if budget <= 0:
            return StackDump(target.pid, time.time(), native=native, error="no time left for this dump")
        return dumper(target.pid, native=native, timeout_s=budget)

    if not targets:
        return {}
    pool = ThreadPoolExecutor(max_workers=min(max_workers, len(targets)), thread_name_prefix="hw-dump")
    try:
        futures: dict[Future[StackDump], Target] = {pool.submit(one, t): t for t in targets}
        wait_all(futures, timeout=max(0.0, deadline - time.monotonic()))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    out: dict[int, StackDump] = {}
    for future, target in futures.items():
        if not future.done() or future.cancelled():
            error = f"dump did not finish within {timeout_s + SLACK_S:.1f} s"
            out[target.rank] = StackDump(target.pid, time.time(), native=native, error=error)
        elif (exc := future.exception()) is not None:
            error = f"dump failed: {type(exc).__name__}: {exc}"
            out[target.rank] = StackDump(target.pid, time.time(), native=native, error=error)
        else:
            out[target.rank] = future.result()
    return out
