"""Finding a rank's process, and its files, when the rank lives in a container.

A rank reports ``os.getpid()`` as seen inside its own pid namespace, plus that namespace's id
(``readlink /proc/self/ns/pid``). An agent that sees the node's processes (Kubernetes
``hostPID: true``) finds the same process by scanning ``/proc`` for that namespace and reading
the innermost pid of each candidate's ``NSpid`` line. A path the rank names (its worker server's
socket) is its own mount namespace's: the agent reaches it through ``/proc/<pid>/root``.
"""

from __future__ import annotations

import os
from dataclasses import replace

from hangwatch.records import Target


def own_namespace(proc: str = "/proc") -> str:
    try:
        return os.readlink(f"{proc}/self/ns/pid")
    except OSError:
        return ""


def path_of(pid: int, path: str, proc: str = "/proc") -> str:
    """``path`` as process ``pid`` names it, reachable from this agent: the path itself where
    both share a mount namespace (or where that cannot be told), else the same path under
    ``/proc/<pid>/root`` (the agent of a Kubernetes node, ``hostPID: true``, reading a socket in
    a training container's ``/tmp``)."""
    try:
        if os.readlink(f"{proc}/self/ns/mnt") == os.readlink(f"{proc}/{pid}/ns/mnt"):
            return path
    except OSError:
        return path
    return f"{proc}/{pid}/root/{path.lstrip('/')}"


class NotVisible(LookupError):
    """No process of the target's pid namespace is visible to this agent (no hostPID?)."""


def _innermost_pid(proc: str, pid: str) -> int | None:
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def local_pid(target: Target, proc: str = "/proc") -> int | None:
    """The target's pid as this agent sees it; None when its namespace is visible but it is gone.

    Raises ``NotVisible`` when no process of that namespace can be seen at all.
    """
    if not target.pid_namespace or target.pid_namespace == own_namespace(proc):
        return target.pid
    seen_namespace = False
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"{proc}/{entry.name}/ns/pid") != target.pid_namespace:
                continue
        except OSError:
            continue
        seen_namespace = True
        if _innermost_pid(proc, entry.name) == target.pid:
            return int(entry.name)
    if not seen_namespace:
        raise NotVisible(
            f"pid namespace {target.pid_namespace} of rank {target.rank} is not visible to this agent: in "
            "Kubernetes the agent needs hostPID: true"
        )
    return None


class PidMapper:
    """Caches each target's local pid (a container's processes keep their pids)."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._cache: dict[Target, int] = {}

    def localise(self, target: Target) -> Target:
        """``target`` with its pid as this agent sees it (unchanged when it cannot be found)."""
        cached = self._cache.get(target)
        if cached is not None and os.path.exists(f"{self.proc}/{cached}"):
            return replace(target, pid=cached)
        try:
            pid = local_pid(target, self.proc)
        except NotVisible:
            return target
        if pid is None:
            return target
        self._cache[target] = pid
        return replace(target, pid=pid)
