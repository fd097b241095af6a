"""How a rank's process looks from outside: state, CPU, memory, threads, exit status (psutil)."""

from __future__ import annotations

import os
import threading
import time
from typing import Protocol

import psutil

from hangwatch.records import ProcessStatus, ProcState

_STATES = {
    psutil.STATUS_RUNNING: ProcState.RUNNING,
    psutil.STATUS_WAKING: ProcState.RUNNING,
    psutil.STATUS_SLEEPING: ProcState.SLEEPING,
    psutil.STATUS_IDLE: ProcState.SLEEPING,
    psutil.STATUS_PARKED: ProcState.SLEEPING,
    psutil.STATUS_DISK_SLEEP: ProcState.DISK_SLEEP,
    psutil.STATUS_STOPPED: ProcState.STOPPED,
    psutil.STATUS_TRACING_STOP: ProcState.STOPPED,
    psutil.STATUS_ZOMBIE: ProcState.ZOMBIE,
    psutil.STATUS_DEAD: ProcState.DEAD,
}


class ProcessInspector(Protocol):
    """The seam through which the agent looks at processes (fakes in tests)."""

    def status(self, pid: int) -> ProcessStatus: ...


def wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) from a ``waitpid``-style status word."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def zombie_exit(pid: int) -> tuple[int | None, int | None]:
    """Exit code or signal of an unreaped process, from ``/proc/PID/stat`` (Linux >= 3.5).

    This works for any zombie we may read, not only our own children, and unlike
    ``waitpid`` it reaps nothing, so the real parent still gets the status.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        return wait_status(int(fields[49]))  # field 52 of proc(5); fields start at field 3
    except (OSError, ValueError, IndexError):
        return None, None


class PsutilInspector:
    """:class:`ProcessInspector` backed by psutil.

    ``cpu_percent`` is measured between two calls for the same process (0.0 on the first), so
    a status never blocks. Processes are cached by (pid, create_time); a zombie's exit status is
    remembered so a later DEAD status still carries it once the parent has reaped it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self._exits: dict[int, tuple[float, int | None, int | None]] = {}

    def status(self, pid: int) -> ProcessStatus:
        now = time.time()
        try:
            fresh = psutil.Process(pid)
            start = fresh.create_time()
        except psutil.NoSuchProcess:
            return self._dead(pid, now)
        except psutil.AccessDenied:
            return ProcessStatus(pid, ProcState.UNKNOWN, now)
        with self._lock:
            proc = self._procs.setdefault((pid, start), fresh)
            for key in [k for k in self._procs if k[0] == pid and k[1] != start]:
                del self._procs[key]  # the pid was reused
            if pid in self._exits and self._exits[pid][0] != start:
                del self._exits[pid]
        try:
            with proc.oneshot():
                state = _STATES.get(proc.status(), ProcState.UNKNOWN)
                if state is ProcState.ZOMBIE:
                    code, sig = zombie_exit(pid)
                    with self._lock:
                        self._exits[pid] = (start, code, sig)
                    return ProcessStatus(pid, state, now, start, exit_code=code, signal=sig)
                return ProcessStatus(
                    pid,
                    state,
                    now,
                    start,
                    cpu_percent=proc.cpu_percent(interval=None),
                    rss_bytes=proc.memory_info().rss,
                    num_threads=proc.num_threads(),
                )
        except psutil.NoSuchProcess:
            return self._dead(pid, now)
        except psutil.AccessDenied:
            return ProcessStatus(pid, ProcState.UNKNOWN, now, start)

    def _dead(self, pid: int, now: float) -> ProcessStatus:
        with self._lock:
            for key in [k for k in self._procs if k[0] == pid]:
                del self._procs[key]
            start, code, sig = self._exits.get(pid, (0.0, None, None))
        return ProcessStatus(pid, ProcState.DEAD, now, start, exit_code=code, signal=sig)
