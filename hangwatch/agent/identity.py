"""Is the process at a target's pid still that target, and was it proven a rank? Every dump and
abort asks first."""

from __future__ import annotations

import collections
import datetime
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from hangwatch.agent.procinfo import ProcessInspector
from hangwatch.records import ProcessStatus, ProcState, Target

#: Seconds two start times may differ and still name the same process. psutil derives
#: ``create_time`` from the boot time in ``/proc/stat``, an integer that can move by one second
#: when the clock is stepped, so a rank and the agent may read values up to ~1 s apart. Reusing a
#: pid within a second of its previous owner's start would take a wrap of the whole pid space.
START_TIME_TOLERANCE_S = 1.0


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="milliseconds")


def check(target: Target, status: ProcessStatus) -> str | None:
    """None when ``status`` is the live process of ``target``, else why it is not."""
    pid = target.pid
    if status.state is ProcState.DEAD:
        return f"pid {pid} is gone"
    if status.state is ProcState.UNKNOWN and not status.start_time:
        return f"pid {pid} cannot be inspected (access denied)"
    if abs(status.start_time - target.start_time) > START_TIME_TOLERANCE_S:
        return (
            f"pid {pid} was reused by another process (started at {_when(status.start_time)},"
            f" expected {_when(target.start_time)})"
        )
    if status.state is ProcState.ZOMBIE:
        how = "exit status unknown"
        if status.signal is not None:
            how = f"signal {status.signal}"
        elif status.exit_code is not None:
            how = f"exit code {status.exit_code}"
        return f"pid {pid} has exited ({how}) and awaits its parent (zombie)"
    return None


def verify(target: Target, inspector: ProcessInspector) -> str | None:
    """None if ``target.pid`` is still the process that started at ``target.start_time``."""
    return check(target, inspector.status(target.pid))


def process_uid(pid: int) -> int | None:
    """The owner of ``/proc/<pid>`` (the process's effective uid; None when gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


@dataclass(frozen=True)
class Proof:
    """A process the kernel proved to be a rank: it linked to this agent's socket, and
    ``SO_PEERCRED`` gave its pid and uid (its start time read at that moment)."""

    pid: int
    uid: int
    start_time: float
    #: the process that started it, as it was when it linked (pid, start time): the job's
    #: launcher (torchrun's agent, srun's step daemon); None when unknown or init
    launcher: tuple[int, float] | None = None
    #: ``records.link_tag`` of each session it linked with (one per process group it made):
    #: only a registration of one of them may have it dumped or signalled
    links: tuple[str, ...] = ()


def parent_of(pid: int) -> tuple[int, float] | None:
    """``pid``'s parent and the parent's start time (None: gone, unreadable, or init)."""
    try:
        parent = psutil.Process(pid).parent()
        if parent is None or parent.pid <= 1:
            return None
        return parent.pid, float(parent.create_time())
    except Exception:
        return None


def start_time_of(pid: int) -> float | None:
    """``pid``'s start time while it runs (None: gone, or a zombie: a launcher that died and
    waits for its parent to reap it launches nothing, and its children are elsewhere now)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(process.create_time())
    except Exception:
        return None


#: How far up the process tree a launcher is looked for.
MAX_LINEAGE = 64


#: Proofs kept (one per rank process that ever linked; the oldest go first).
PROOFS_KEPT = 16384
#: Sessions kept per proof (a process links once per process group it makes).
LINKS_KEPT = 64


class Proofs:
    """The rank processes this node's agent may touch. A registration over the network is a
    claim: anyone can read a pid and its start time from ``/proc`` and claim them. The agent
    dumps the stacks of, or signals, only a process that linked to it itself (``hangwatch.link``),
    still with the start time and the uid it had then. Thread-safe."""

    def __init__(
        self,
        uid_of: Callable[[int], int | None] = process_uid,
        parent: Callable[[int], tuple[int, float] | None] = parent_of,
        started: Callable[[int], float | None] = start_time_of,
    ) -> None:
        # seams for tests: a process's uid now, its parent (pid, start time), its start time
        self._uid_of = uid_of
        self._parent = parent
        self._started = started
        self._lock = threading.Lock()
        self._by_pid: collections.OrderedDict[int, Proof] = collections.OrderedDict()

    def add(self, pid: int, uid: int, start_time: float, link: str) -> None:
        """Record that ``pid`` (started at ``start_time``, running as ``uid``) linked with the
        session whose tag is ``link``."""
        launcher = self._parent(pid)
        with self._lock:
            old = self._by_pid.pop(pid, None)
            links: tuple[str, ...] = (link,)
            if old is not None and abs(old.start_time - start_time) <= START_TIME_TOLERANCE_S:
                links = (*old.links, link)[-LINKS_KEPT:]  # the same process linking again
            self._by_pid[pid] = Proof(pid, uid, start_time, launcher, links)
            while len(self._by_pid) > PROOFS_KEPT:
                self._by_pid.popitem(last=False)

    def check(self, target: Target) -> str | None:
        """None when ``target`` (its pid in this agent's pid namespace) is a proven rank process
        that still runs as the uid it linked with; else why it may not be touched."""
        with self._lock:
            proof = self._by_pid.get(target.pid)
        if proof is None:
            return (
                f"pid {target.pid} never linked to this node's agent, so that it is rank {target.rank} is only "
                f"its own claim; hangwatch reads and signals only processes the kernel proved to be ranks"
            )
        if abs(proof.start_time - target.start_time) > START_TIME_TOLERANCE_S:
            return f"pid {target.pid} is not the process that linked as a rank (started at another time)"
        if not target.link or target.link not in proof.links:
            return (
                f"pid {target.pid} linked to this node's agent as another registration than rank {target.rank}'s, "
                f"so that it is this rank is only a claim"
            )
        uid = self._uid_of(target.pid)
        if uid is not None and uid != proof.uid:
            return f"pid {target.pid} now runs as uid {uid}, not uid {proof.uid} it linked with"
        return self._lineage(proof)

    def _lineage(self, proof: Proof) -> str | None:
        """Why ``proof``'s process is no longer its launcher's descendant while that launcher
        still runs (None: it is, or the launcher is gone and the link's proof stands alone)."""
        if proof.launcher is None:
            return None
        launcher, launched = proof.launcher
        now = self._started(launcher)
        if now is None or abs(now - launched) > START_TIME_TOLERANCE_S:
            return None  # the launcher is gone (its pid free or reused): nothing to check against
        pid = proof.pid
        for _ in range(MAX_LINEAGE):
            parent = self._parent(pid)
            if parent is None:
                break
            if parent[0] == launcher and abs(parent[1] - launched) <= START_TIME_TOLERANCE_S:
                return None
            pid = parent[0]
        return (
            f"pid {proof.pid} is no longer a descendant of pid {launcher}, the process that launched it "
            f"(which still runs)"
        )


def proven_start_time(pid: int) -> float | None:
    """A just-linked process's start time, as ``verify`` will compare it (None: unreadable)."""
    try:
        return float(psutil.Process(pid).create_time())
    except Exception:
        return None
