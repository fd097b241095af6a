"""Stacks of many ranks at once (their views for a report: ``hangwatch.stackviews``)."""

from __future__ import annotations

import dataclasses
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
#: A rank's own processes dumped with it at most (its DataLoader workers, a subprocess).
MAX_CHILDREN = 4


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (the kernel's parent links: a process
    cannot claim to be another's child)."""
    try:
        import psutil

        return sorted(c.pid for c in psutil.Process(pid).children(recursive=False))
    except Exception:  # gone, or not readable: no children to tell of
        return []


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
        dump = dumper(target.pid, native=native, timeout_s=budget)
        if dump.error is not None:
            return dump
        # its own processes, which it may be waiting for: their stacks, Python only, in the time left
        children = []
        for pid in children_of(target.pid)[:MAX_CHILDREN]:
            left = min(timeout_s, deadline - SLACK_S / 2 - time.monotonic())
            if left <= 0:
                break
            children.append(dumper(pid, native=False, timeout_s=left))
        return dataclasses.replace(dump, children=tuple(children)) if children else dump

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
