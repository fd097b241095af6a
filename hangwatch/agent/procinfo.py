"""How a rank's process looks from outside: state, CPU, memory, threads, exit status (/proc, psutil)."""

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


def stat_fields(pid: int, proc_root: str = "/proc") -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (which may hold spaces and
    parentheses): ``[0]`` is field 3 of proc(5), the state letter. OSError where it cannot be
    read, ValueError where it is not a stat line."""
    with open(f"{proc_root}/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].decode("ascii").split()


#: Index in :func:`stat_fields` of the exit status word (field 52 of proc(5), Linux >= 3.5).
EXIT_FIELD = 49


def zombie_exit(pid: int) -> tuple[int | None, int | None]:
    """Exit code or signal of an unreaped process, from ``/proc/PID/stat`` (Linux >= 3.5).

    This works for any zombie we may read, not only our own children, and unlike
    ``waitpid`` it reaps nothing, so the real parent still gets the status.
    """
    try:
        return wait_status(int(stat_fields(pid)[EXIT_FIELD]))
    except (OSError, ValueError, IndexError):
        return None, None


#: ``/proc/<pid>/stat``'s state letters, as psutil names them
_LETTERS = {
    "R": ProcState.RUNNING,
    "W": ProcState.RUNNING,
    "S": ProcState.SLEEPING,
    "I": ProcState.SLEEPING,
    "P": ProcState.SLEEPING,
    "D": ProcState.DISK_SLEEP,
    "T": ProcState.STOPPED,
    "t": ProcState.STOPPED,
    "Z": ProcState.ZOMBIE,
    "X": ProcState.DEAD,
    "x": ProcState.DEAD,
}
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PsutilInspector:
    """:class:`ProcessInspector` from ``/proc/<pid>/stat`` (psutil where it cannot be parsed).

    ``cpu_percent`` is measured between two calls for the same process (0.0 on the first), as
    psutil's ``cpu_percent(interval=None)``, so a status never blocks. A process is known by
    (pid, start): its start time is psutil's ``create_time``, taken once per process; a zombie's
    exit status is remembered so a later DEAD status still carries it once the parent has
    reaped it.

    One read of one file, where psutil reads four (``stat`` twice, ``status``, ``statm``): the
    embedded agent asks for every rank twice a second.
    """

    def __init__(self, proc_root: str = "/proc") -> None:
        self._lock = threading.Lock()
        self.proc_root = proc_root
        #: pid -> (start in clock ticks since boot, create_time, (CPU ticks, monotonic) last seen)
        self._known: dict[int, tuple[int, float, tuple[int, float]]] = {}
        self._exits: dict[int, tuple[float, int | None, int | None]] = {}
        self._procs: dict[tuple[int, float], psutil.Process] = {}  # where /proc cannot be read

    def status(self, pid: int) -> ProcessStatus:
        now = time.time()
        try:
            fields = stat_fields(pid, self.proc_root)
            letter, ticks = fields[0], int(fields[19])
            cpu, threads, rss = int(fields[11]) + int(fields[12]), int(fields[17]), int(fields[21]) * _PAGE
        except (FileNotFoundError, ProcessLookupError):
            return self._dead(pid, now)
        except PermissionError:
            return ProcessStatus(pid, ProcState.UNKNOWN, now)
        except (OSError, ValueError, IndexError):
            return self._psutil_status(pid, now)
        mono = time.monotonic()
        with self._lock:
            known = self._known.get(pid)
        if known is None or known[0] != ticks:  # new to us, or the pid was reused
            try:
                start = float(psutil.Process(pid).create_time())
            except psutil.NoSuchProcess:
                return self._dead(pid, now)
            except psutil.AccessDenied:
                return ProcessStatus(pid, ProcState.UNKNOWN, now)
            with self._lock:
                if pid in self._exits and self._exits[pid][0] != start:
                    del self._exits[pid]
            percent = 0.0
        else:
            start = known[1]
            seen_cpu, seen_at = known[2]
            percent = 100.0 * (cpu - seen_cpu) / _TICKS / (mono - seen_at) if mono > seen_at else 0.0
        with self._lock:
            self._known[pid] = (ticks, start, (cpu, mono))
        state = _LETTERS.get(letter, ProcState.UNKNOWN)
        if state is ProcState.ZOMBIE:
            code, sig = wait_status(int(fields[EXIT_FIELD])) if len(fields) > EXIT_FIELD else (None, None)
            with self._lock:
                self._exits[pid] = (start, code, sig)
            return ProcessStatus(pid, state, now, start, exit_code=code, signal=sig)
        return ProcessStatus(pid, state, now, start, cpu_percent=round(percent, 1), rss_bytes=rss, num_threads=threads)

    def _psutil_status(self, pid: int, now: float) -> ProcessStatus:
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
            self._known.pop(pid, None)
            for key in [k for k in self._procs if k[0] == pid]:
                del self._procs[key]
            start, code, sig = self._exits.get(pid, (0.0, None, None))
        return ProcessStatus(pid, ProcState.DEAD, now, start, exit_code=code, signal=sig)


#: Index in :func:`stat_fields` of the flags word (field 9 of proc(5)), and its bit for a task
#: on its way out (``PF_EXITING``): set from the start of exit until the process is a zombie.
FLAGS_FIELD = 6
PF_EXITING = 0x4


def exit_when_gone(
    pid: int, wait_s: float = 0.02, exiting_s: float = 1.0, proc_root: str = "/proc"
) -> tuple[int | None, int | None]:
    """Exit code or signal of ``pid`` whose rank link just closed: the process is exiting, and
    becomes a zombie within moments, until its parent reaps it (torchrun polls every 0.1 s), so
    look at once and for a few milliseconds more, and for up to ``exiting_s`` while the kernel
    says it is still on its way out (a big process's exit frees its memory first: seconds under
    load). (None, None) when it could not be seen."""
    start = time.monotonic()
    while True:
        try:
            fields = stat_fields(pid, proc_root)
            if fields[0] == "Z":
                return wait_status(int(fields[EXIT_FIELD]))
            exiting = int(fields[FLAGS_FIELD]) & PF_EXITING
        except (OSError, ValueError, IndexError):
            return None, None  # reaped already (or never readable)
        waited = time.monotonic() - start
        if waited >= (exiting_s if exiting else wait_s):
            return None, None
        time.sleep(0.001)


def memory_events_path(pid: int, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> str | None:
    """The cgroup v2 ``memory.events`` file of ``pid``'s cgroup, where it can be read (pure v2
    at ``cgroup_root``, or a hybrid host's ``unified`` mount); None otherwise (cgroup v1, the
    root cgroup, another namespace's path, no permission)."""
    try:
        with open(f"{proc_root}/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = line[3:].rstrip("/")
            if not path:
                return None
            for base in (cgroup_root, f"{cgroup_root}/unified"):
                candidate = f"{base}{path}/memory.events"
                if oom_kills(candidate) is not None:
                    return candidate
    return None


def oom_kills(path: str | None) -> int | None:
    """The ``oom_kill`` counter of a cgroup v2 ``memory.events`` file (None: unreadable)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None
