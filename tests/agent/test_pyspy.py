"""py-spy against real processes: sleeping, stopped, holding the GIL, gone; and its failures."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import psutil
import pytest

from hangwatch.agent.pyspy import dump_stacks, find_pyspy, ptrace_diagnosis
from hangwatch.records import StackDump
from hangwatch.stackviews import main_thread

from .conftest import Spawn, wait_until

SLEEPER = """\
import threading, time
print("ready", flush=True)
time.sleep(60)
"""
GIL_HOLDER = """\
import ctypes
libc = ctypes.PyDLL("libc.so.6")  # PyDLL keeps the GIL during the call
print("ready", flush=True)
libc.sleep(60)
"""

pytestmark = pytest.mark.skipif(find_pyspy() is None, reason="py-spy not installed")


def _fake_pyspy(tmp_path: Path, script: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _dump_until(pid: int, native: bool, want: str) -> StackDump:
    """Dump until the main thread shows ``want`` (the child may not be there yet)."""
    dumps: list[StackDump] = []

    def reached() -> bool:
        dumps.append(dump_stacks(pid, native=native, timeout_s=5.0))
        thread = main_thread(dumps[-1])
        return thread is not None and any(f.function == want for f in thread.frames)

    wait_until(reached, timeout=5.0, every=0.05)
    return dumps[-1]


def test_sleeping_process_shows_file_and_line(spawn: Spawn) -> None:
    proc = spawn(SLEEPER, "sleeper")
    dump = _dump_until(proc.pid, native=False, want="<module>")
    assert dump.ok and not dump.native
    main = main_thread(dump)
    assert main is not None and main.name == "MainThread" and main.thread_id == proc.pid
    frame = main.frames[0]
    assert frame.filename.endswith("sleeper.py") and frame.line == 3 and not frame.native
    assert dump.text.splitlines()[:2] == [
        f'Thread {proc.pid} (idle): "MainThread"',
        "    <module> (sleeper.py:3)",
    ]


def test_native_dump_shows_time_sleep(spawn: Spawn) -> None:
    proc = spawn(SLEEPER, "sleeper")
    dump = _dump_until(proc.pid, native=True, want="time_sleep")
    main = main_thread(dump)
    assert dump.native and main is not None
    names = [f.function for f in main.frames]
    assert names.index("time_sleep") < names.index("<module>")  # innermost first
    assert next(f for f in main.frames if f.function == "time_sleep").native


def test_gil_holder_in_native_code(spawn: Spawn) -> None:
    proc = spawn(GIL_HOLDER, "holder")
    dump = _dump_until(proc.pid, native=True, want="sleep")
    main = main_thread(dump)
    assert main is not None and main.owns_gil
    sleep = next(f for f in main.frames if f.function == "sleep")
    assert sleep.native and "libc" in sleep.filename
    assert any(f.filename.endswith("holder.py") and f.line == 4 for f in main.frames)
    # without ``threading`` imported py-spy knows no thread names
    assert dump.text.startswith(f"Thread {proc.pid} (idle+gil)\n")


def test_stopped_process_falls_back_to_nonblocking(spawn: Spawn) -> None:
    proc = spawn(SLEEPER, "sleeper")
    _dump_until(proc.pid, native=False, want="<module>")
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED)
    dump = dump_stacks(proc.pid, native=True, timeout_s=5.0)
    assert dump.ok, dump.error
    assert not dump.native  # py-spy cannot combine --nonblocking with --native
    assert dump.text.startswith("(nonblocking dump, Python frames only: the process is stopped")
    main = main_thread(dump)
    assert main is not None and main.frames[0].line == 3
    assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED  # left as it was


def test_gone_process(spawn: Spawn) -> None:
    proc = spawn("print('ready', flush=True)\n")
    proc.wait(timeout=10)
    dump = dump_stacks(proc.pid, timeout_s=5.0)
    assert dump.error is not None and f"pid {proc.pid} is gone" in dump.error


def test_pyspy_missing() -> None:
    dump = dump_stacks(os.getpid(), pyspy="/nonexistent")
    assert dump.error == "py-spy not found at /nonexistent: pip install py-spy"


def test_permission_refused_explains_ptrace(tmp_path: Path) -> None:
    fake = _fake_pyspy(
        tmp_path,
        "echo 'Error: Failed to get process executable name.' >&2\n"
        "echo 'Caused by:' >&2\necho '    0: Permission denied (os error 13)' >&2\nexit 1\n",
    )
    dump = dump_stacks(os.getpid(), pyspy=fake)
    assert dump.error is not None and dump.error.startswith(f"permission denied attaching to pid {os.getpid()}")
    for hint in ("ptrace_scope", "SYS_PTRACE", "hostPID: true", "root or the same user"):
        assert hint in dump.error


def test_timeout_kills_pyspy(tmp_path: Path) -> None:
    fake = _fake_pyspy(tmp_path, "sleep 30\n")  # not exec'd: a child of the shell, killed too
    dump = dump_stacks(os.getpid(), timeout_s=0.5, pyspy=fake)
    assert dump.error is not None
    assert dump.error.startswith("py-spy timed out after 0.3 s; nonblocking retry: py-spy timed out")


def test_ptrace_diagnosis_as_root() -> None:
    can, note = ptrace_diagnosis()
    if os.geteuid() == 0:
        assert can and "CAP_SYS_PTRACE" in note
    assert note
