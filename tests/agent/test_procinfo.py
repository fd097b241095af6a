"""Process states, resources and exit status as psutil shows them; identity checks on top."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from hangwatch.agent.identity import check, verify
from hangwatch.agent.procinfo import PF_EXITING, PsutilInspector, exit_when_gone, memory_events_path, oom_kills
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


def _stat(state: str, wait_status: int, flags: int = 0) -> str:
    # pid (comm) state, then fields 4..52 of proc(5); flags are field 9, the exit code field 52
    rest = ["0"] * 49
    rest[5] = str(flags)
    rest[-1] = str(wait_status)
    return f"42 (python3 x) {state} " + " ".join(rest) + "\n"


def test_exit_of_a_zombie_is_read_once_it_is_one(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(_stat("Z", signal.SIGKILL))
    assert exit_when_gone(42, proc_root=str(tmp_path)) == (None, signal.SIGKILL)
    (tmp_path / "42" / "stat").write_text(_stat("Z", 3 << 8))
    assert exit_when_gone(42, proc_root=str(tmp_path)) == (3, None)
    (tmp_path / "42" / "stat").write_text(_stat("S", 0))  # not exiting after all: say nothing
    assert exit_when_gone(42, wait_s=0.01, proc_root=str(tmp_path)) == (None, None)
    assert exit_when_gone(43, proc_root=str(tmp_path)) == (None, None)  # reaped already


def test_oom_kills_of_the_ranks_cgroup_v2(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text("0::/job.slice/rank-0.scope\n")
    events = cgroup / "unified" / "job.slice" / "rank-0.scope"  # a hybrid host's v2 mount
    events.mkdir(parents=True)
    (events / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    path = memory_events_path(42, proc_root=str(proc), cgroup_root=str(cgroup))
    assert path == str(events / "memory.events")
    assert oom_kills(path) == 1
    # cgroup v1 only, the root cgroup, or a file that cannot be read: nothing is said about OOM
    (proc / "42" / "cgroup").write_text("4:memory:/job\n0::/\n")
    assert memory_events_path(42, proc_root=str(proc), cgroup_root=str(cgroup)) is None
    assert memory_events_path(43, proc_root=str(proc), cgroup_root=str(cgroup)) is None
    assert oom_kills(None) is None and oom_kills(str(tmp_path / "missing")) is None


def test_status_from_proc_agrees_with_psutil(spawn: Spawn) -> None:
    """The status read from ``/proc/<pid>/stat`` says what psutil says of the same process."""
    import psutil

    proc = spawn(SLEEPER)
    inspector = PsutilInspector()
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.SLEEPING)
    s, p = inspector.status(proc.pid), psutil.Process(proc.pid)
    assert s.start_time == p.create_time()
    assert s.num_threads == p.num_threads()
    assert abs(s.rss_bytes - p.memory_info().rss) < 1 << 20


def test_an_unparsable_stat_falls_back_to_psutil(tmp_path: Path, spawn: Spawn) -> None:
    """Where ``/proc/<pid>/stat`` cannot be parsed, psutil answers (it reads the real ``/proc``)."""
    proc = spawn(SLEEPER)
    (tmp_path / str(proc.pid)).mkdir()
    (tmp_path / str(proc.pid) / "stat").write_bytes(b"not a stat line")
    inspector = PsutilInspector(proc_root=str(tmp_path))
    wait_until(lambda: inspector.status(proc.pid).state is ProcState.SLEEPING)
    s = inspector.status(proc.pid)
    assert s.start_time == target(proc).start_time and s.num_threads >= 1
    assert PsutilInspector(proc_root=str(tmp_path)).status(proc.pid + 10_000_000).state is ProcState.DEAD


def test_a_process_on_its_way_out_is_waited_for_until_it_is_a_zombie(tmp_path: Path) -> None:
    """Seen under load: the link closed, and the process freed its memory for longer than the
    first look waits; while the kernel flags it exiting, its exit status is still to come."""
    (tmp_path / "42").mkdir()
    stat = tmp_path / "42" / "stat"
    stat.write_text(_stat("R", 0, flags=PF_EXITING))
    zombie = tmp_path / "42" / "stat.new"
    zombie.write_text(_stat("Z", signal.SIGKILL))
    # as the kernel does, the file is never seen half-written (a truncated one reads as gone)
    timer = threading.Timer(0.1, lambda: os.replace(zombie, stat))
    timer.start()
    try:
        assert exit_when_gone(42, wait_s=0.01, proc_root=str(tmp_path)) == (None, signal.SIGKILL)
    finally:
        timer.cancel()
    stat.write_text(_stat("R", 0, flags=PF_EXITING))  # never becomes one: bounded
    assert exit_when_gone(42, wait_s=0.01, exiting_s=0.05, proc_root=str(tmp_path)) == (None, None)
