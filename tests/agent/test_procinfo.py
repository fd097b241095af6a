"""Process states, resources and exit status as psutil shows them; identity checks on top."""

from __future__ import annotations

import os
import signal
import time

from hangwatch.agent.identity import check, verify
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.records import ProcessStatus, ProcState, Target

from .conftest import Spawn, target, wait_until

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
SPINNER = "print('ready', flush=True)\nwhile True:\n    pass\n"


def test_sleeping_then_stopped(spawn: Spawn) -> None:
    proc = spawn(SLEEPER)
    inspector = PsutilInspector()
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.SLEEPING)
    s = inspector.status(proc.pid)
    assert s.start_time == target(proc).start_time
    assert s.rss_bytes > 1 << 20 and s.num_threads >= 1 and s.exit_code is None
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.STOPPED)
    os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.SLEEPING)


def test_cpu_percent_is_measured_between_calls(spawn: Spawn) -> None:
    proc = spawn(SPINNER)
    inspector = PsutilInspector()
    began = time.monotonic()
    assert inspector.status(proc.pid).cpu_percent == 0.0  # first call: no interval yet
    assert time.monotonic() - began < 0.1  # never blocks
    time.sleep(0.3)
    assert inspector.status(proc.pid).cpu_percent > 20.0


def test_exception_exit_code_as_zombie_then_dead(spawn: Spawn) -> None:
    proc = spawn("print('ready', flush=True)\nraise SystemExit(3)\n")
    inspector = PsutilInspector()
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.ZOMBIE)
    zombie = inspector.status(proc.pid)
    assert (zombie.exit_code, zombie.signal) == (3, None)
    assert verify(target(proc), inspector) == f"pid {proc.pid} has exited (exit code 3) and awaits its parent (zombie)"
    assert proc.wait(timeout=10) == 3  # the status was not reaped by the agent
    dead = inspector.status(proc.pid)
    assert dead.state is ProcState.DEAD and (dead.exit_code, dead.start_time) == (3, zombie.start_time)


def test_killed_by_signal(spawn: Spawn) -> None:
    proc = spawn(SLEEPER)
    inspector = PsutilInspector()
    proc.send_signal(signal.SIGSEGV)
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.ZOMBIE)
    assert (inspector.status(proc.pid).signal, inspector.status(proc.pid).exit_code) == (signal.SIGSEGV, None)
    proc.wait(timeout=10)
    assert inspector.status(proc.pid).signal == signal.SIGSEGV


def test_verify_live_gone_and_reused(spawn: Spawn) -> None:
    proc = spawn(SLEEPER)
    inspector = PsutilInspector()
    t = target(proc)
    assert verify(t, inspector) is None
    assert verify(Target(0, proc.pid, t.start_time + 0.5), inspector) is None  # clock granularity
    reused = verify(Target(0, proc.pid, t.start_time - 3600), inspector)
    assert reused is not None and reused.startswith(f"pid {proc.pid} was reused by another process (started at ")
    proc.kill()
    proc.wait(timeout=10)
    assert verify(Target(0, proc.pid, t.start_time), PsutilInspector()) == f"pid {proc.pid} is gone"


def test_check_cannot_inspect() -> None:
    assert check(Target(1, 42, 100.0), ProcessStatus(42, ProcState.UNKNOWN, 0.0)) == (
        "pid 42 cannot be inspected (access denied)"
    )
