"""Dumping many ranks at once, grouping identical stacks, one-line summaries."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest

from hangwatch import wire
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.pyspy import find_pyspy
from hangwatch.agent.stacks import children_of, dump_many
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.records import Frame, StackDump, Target, ThreadStack
from hangwatch.stackviews import child_where, group_identical, summarize, waited_children

from .conftest import Spawn, target

SLEEPER = """\
import threading, time

def main():
    print("ready", flush=True)
    time.sleep(60)

main()
"""
SITE = "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _dump(pid: int, *frames: Frame, gil: bool = False, error: str | None = None) -> StackDump:
    return StackDump(pid, 0.0, (ThreadStack(pid, "MainThread", frames, owns_gil=gil),), error=error)


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy not installed")
def test_four_processes_in_parallel(spawn: Spawn) -> None:
    targets = [target(spawn(SLEEPER, f"rank{r}"), rank=r) for r in range(4)]
    began = time.monotonic()
    dumps = dump_many(targets, native=True, timeout_s=5.0, inspector=PsutilInspector())
    assert time.monotonic() - began < 5.0
    assert sorted(dumps) == [0, 1, 2, 3] and all(d.ok for d in dumps.values())
    for rank, dump in dumps.items():
        assert dump.pid == targets[rank].pid
        assert summarize(dump) == f"time_sleep in rank{rank}.py:5 (main)"


def test_reused_pid_is_refused_without_dumping(spawn: Spawn) -> None:
    proc = spawn(SLEEPER)
    calls: list[int] = []

    def dumper(pid: int, *, native: bool = False, timeout_s: float = 10.0) -> StackDump:
        calls.append(pid)
        return StackDump(pid, 0.0)

    stale = Target(3, proc.pid, target(proc).start_time - 3600)
    dumps = dump_many([stale], native=False, timeout_s=1.0, inspector=PsutilInspector(), dumper=dumper)
    error = dumps[3].error
    assert error is not None and error.startswith(f"refused: pid {proc.pid} was reused by another process")
    assert calls == []


@pytest.fixture
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def test_total_wall_time_is_bounded(spawn: Spawn, release: threading.Event) -> None:
    proc = spawn(SLEEPER)
    budgets: list[float] = []

    def stuck(pid: int, *, native: bool = False, timeout_s: float = 10.0) -> StackDump:
        budgets.append(timeout_s)
        release.wait(10.0)  # a dumper ignoring its own timeout
        return StackDump(pid, 0.0)

    targets = [Target(r, proc.pid, target(proc).start_time) for r in range(3)]
    began = time.monotonic()
    dumps = dump_many(targets, native=False, timeout_s=0.2, inspector=PsutilInspector(), dumper=stuck, max_workers=2)
    assert time.monotonic() - began < 2.0
    assert {d.error for d in dumps.values()} == {"dump did not finish within 1.2 s"}
    assert budgets and all(b <= 0.2 for b in budgets)


def test_group_identical_ignores_native_frames_and_groups_errors() -> None:
    def stack(pid: int, line: int, address: str) -> StackDump:
        return _dump(
            pid,
            Frame(address, "/lib/libc.so.6", 0, native=True),
            Frame("all_reduce", SITE, 2800),
            Frame("main", "/job/train.py", line),
        )

    dumps = {
        0: stack(100, 42, "0x1"),
        1: stack(101, 42, "0x2"),
        2: stack(102, 40, "0x1"),
        3: _dump(103, error="pid 103 is gone"),
        4: stack(104, 42, "0x3"),
    }
    assert group_identical(dumps) == [
        ([0, 1, 4], "all_reduce (torch/distributed/distributed_c10d.py:2800)\nmain (train.py:42)"),
        ([2], "all_reduce (torch/distributed/distributed_c10d.py:2800)\nmain (train.py:40)"),
        ([3], "no stacks: pid 103 is gone"),
    ]


def test_summarize_names_the_user_frame() -> None:
    libc = Frame("__futex_abstimed_wait", "/lib/libc.so.6", 0, native=True)
    wrapper = Frame("wrapper", "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81)
    user = Frame("main", "/job/train.py", 42)
    assert summarize(_dump(1, libc, Frame("all_reduce", SITE, 2800), wrapper, user)) == (
        "all_reduce in train.py:42 (main)"
    )
    assert summarize(_dump(1, libc, user, gil=True)) == "__futex_abstimed_wait in train.py:42 (main), holding the GIL"
    assert summarize(_dump(1, Frame("_bootstrap", "/usr/lib/python3.11/threading.py", 1002))) == (
        "threading.py:1002 (_bootstrap)"
    )
    assert summarize(_dump(1, libc)) == "in native code: __futex_abstimed_wait (libc.so.6)"
    assert summarize(_dump(1, error="timed out")) == "no stacks: timed out"


PARENT_OF_A_WORKER = """\
import subprocess, sys, time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
child.wait()
"""


def test_a_ranks_own_processes_are_dumped_with_it(spawn: Spawn) -> None:
    """The kernel's parent links say which processes are the rank's: each is dumped with it, in
    the time left, and never one that is not its child."""
    proc = spawn(PARENT_OF_A_WORKER)
    stranger = spawn(SLEEPER)
    calls: list[int] = []

    def dumper(pid: int, *, native: bool = False, timeout_s: float = 10.0) -> StackDump:
        calls.append(pid)
        return StackDump(pid, 0.0, text=f"stacks of {pid}")

    time.sleep(0.3)  # its child started
    (child,) = children_of(proc.pid)
    dumps = dump_many([target(proc, rank=1)], native=True, timeout_s=2.0, inspector=PsutilInspector(), dumper=dumper)
    assert calls == [proc.pid, child]
    assert [c.pid for c in dumps[1].children] == [child]
    assert stranger.pid not in calls


def test_what_a_rank_waits_for_of_its_own_is_a_worker_in_the_programs_code() -> None:
    """A rank in its DataLoader's wait, one worker stalled in the dataset's code and one idle
    (its frames below the worker loop are its parent's, copied at fork): only the stalled one."""
    lib = "/venv/lib/python3.11/site-packages/torch/utils/data/"
    forked = (
        Frame("_bootstrap", "/usr/lib/python3.11/multiprocessing/process.py", 314),
        Frame("_launch", "/usr/lib/python3.11/multiprocessing/popen_fork.py", 71),
        Frame("<module>", "/job/train.py", 25),
    )
    loop = Frame("_worker_loop", lib + "_utils/worker.py", 349)
    stalled = _dump(
        11,
        Frame("time_sleep", "/lib/libc.so.6", 0, native=True),
        Frame("read_shard", "/job/train.py", 15),
        Frame("__getitem__", "/job/train.py", 9),
        Frame("fetch", lib + "_utils/fetch.py", 52),
        loop,
        *forked,
    )
    idle = _dump(12, Frame("get", "/usr/lib/python3.11/multiprocessing/queues.py", 113), loop, *forked)
    rank = _dump(
        10,
        Frame("select", "/usr/lib/python3.11/selectors.py", 415),
        Frame("_try_get_data", lib + "dataloader.py", 1291),
        Frame("<module>", "/job/train.py", 25),
    )
    rank = dataclasses.replace(rank, children=(idle, stalled))
    assert child_where(stalled) == ("DataLoader worker", "read_shard at train.py:15")
    assert child_where(idle) == ("DataLoader worker", "")
    assert waited_children(rank) == [(11, "DataLoader worker", "read_shard at train.py:15")]
    # a rank busy in its own code does not wait for its workers, whatever they do
    busy = dataclasses.replace(_dump(10, Frame("train_step", "/job/train.py", 40)), children=(stalled,))
    assert waited_children(busy) == []


def test_a_ranks_own_stacks_cross_the_wire_one_level_deep() -> None:
    child = _dump(11, Frame("read_shard", "/job/train.py", 15))
    rank = dataclasses.replace(_dump(10, Frame("main", "/job/train.py", 25)), children=(child,))
    msg = pb.StackDumpMsg()
    wire.stack_dump_to_pb(rank, 1, msg)
    back = wire.stack_dump_from_pb(msg)
    assert back.children == (child,) and back.threads == rank.threads
    nested = pb.StackDumpMsg()  # a dump whose children claim children of their own: not taken
    wire.stack_dump_to_pb(dataclasses.replace(rank, children=(rank,)), 1, nested)
    assert wire.stack_dump_from_pb(nested).children == ()
