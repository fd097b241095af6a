"""Stacks of a live Python process from outside, with py-spy (works while the process holds the GIL).

``dump_stacks`` never raises: a failed dump is a :class:`StackDump` whose ``error`` says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from hangwatch.records import Frame, StackDump, ThreadStack

PTRACE_HELP = (
    "py-spy attaches with ptrace, which needs root or the same user as the target process; with"
    " Yama /proc/sys/kernel/yama/ptrace_scope=1 a non-root agent may trace only its own"
    " descendants (2: CAP_SYS_PTRACE only, 3: nobody); in a container add the SYS_PTRACE"
    " capability (docker run --cap-add SYS_PTRACE); on Kubernetes run the agent with"
    " hostPID: true and securityContext.capabilities.add: [SYS_PTRACE]"
)
#: Share of the timeout given to the (consistent) blocking dump; the rest is for the fallback.
BLOCKING_SHARE = 0.7
_CAP_SYS_PTRACE = 19
_PERMISSION = re.compile(r"permission denied|operation not permitted|os error (1|13)\)", re.I)
_NOT_PYTHON = re.compile(r"failed to find python version|failed to find a python interpreter", re.I)


def find_pyspy(explicit: str | None = None) -> str | None:
    """The py-spy executable: ``explicit``, else on PATH, else next to ``sys.executable``."""
    if explicit is not None:
        return shutil.which(explicit)
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def _ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def ptrace_diagnosis() -> tuple[bool, str]:
    """(whether this process can likely ptrace the ranks on its node, a note saying why)."""
    cap = bool(_effective_caps() >> _CAP_SYS_PTRACE & 1)
    scope = _ptrace_scope()
    yama = "no Yama LSM" if scope is None else f"Yama ptrace_scope={scope}"
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    if scope == 3:
        return False, f"{yama}: ptrace is disabled on this host until reboot"
    if cap:
        return True, f"{who} with CAP_SYS_PTRACE, {yama}"
    if scope == 2:
        return False, f"{yama} requires CAP_SYS_PTRACE, which this agent lacks; {PTRACE_HELP}"
    if scope == 1:
        return False, f"{yama}: without CAP_SYS_PTRACE only descendants can be traced; {PTRACE_HELP}"
    return True, f"{who} without CAP_SYS_PTRACE, {yama}: only processes of the same user"


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _run(argv: Sequence[str], timeout_s: float) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr); the child is killed on timeout."""
    with subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout kills whatever it started too
    ) as proc:
        try:
            out, err = proc.communicate(timeout=max(timeout_s, 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=1.0)
            return None, "", ""
        return proc.returncode, out, err


def _message(stderr: str) -> str:
    """py-spy's error and its causes on one line, without the Rust backtrace."""
    parts: list[str] = []
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith("Stack backtrace:"):
            break
        if line and line != "Caused by:":
            parts.append(re.sub(r"^(Error: |\d+: )", "", line))
    return ": ".join(dict.fromkeys(parts)) or "no message"


def _parse(pid: int, raw: list[dict[str, Any]]) -> tuple[tuple[ThreadStack, ...], str]:
    """Threads (main thread first, frames innermost first) and py-spy-like text."""
    raw = sorted(raw, key=lambda t: (t.get("os_thread_id") or t.get("thread_id")) != pid)
    threads: list[ThreadStack] = []
    lines: list[str] = []
    for t in raw:
        tid = int(t.get("os_thread_id") or t.get("thread_id") or 0)
        name = t.get("thread_name") or ""
        active, gil = bool(t.get("active")), bool(t.get("owns_gil"))
        frames: list[Frame] = []
        state = ("active" if active else "idle") + ("+gil" if gil else "")
        lines.append(f'Thread {tid} ({state}): "{name}"' if name else f"Thread {tid} ({state})")
        for f in t.get("frames") or ():
            frame = Frame(
                str(f.get("name")),
                str(f.get("filename")),
                int(f.get("line") or 0),
                f.get("module") is not None,
            )
            frames.append(frame)
            short = f.get("short_filename") or frame.filename
            where = f"{short}:{frame.line}" if frame.line else short
            lines.append(f"    {frame.function} ({where})")
        threads.append(ThreadStack(tid, name, tuple(frames), active, gil))
    return tuple(threads), "\n".join(lines)


def _attempt(exe: str, pid: int, native: bool, nonblocking: bool, timeout_s: float) -> tuple[StackDump | None, str]:
    """One py-spy run: a dump (maybe failed, with its error), or (None, why) when worth a retry
    without suspending the process (it timed out, or could not be suspended)."""
    argv = [exe, "dump", "--pid", str(pid), "--json"]
    argv += ["--native"] if native else []
    argv += ["--nonblocking"] if nonblocking else []
    now = time.time()
    try:
        rc, out, err = _run(argv, timeout_s)
    except OSError as e:
        return StackDump(pid, now, native=native, error=f"cannot run py-spy {exe}: {e}"), ""
    if rc is None:
        if not nonblocking and _stopped(pid):
            # Killed mid-attach, py-spy can leave its SIGSTOP behind: resume what we stopped.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return None, f"py-spy timed out after {timeout_s:.1f} s"
    if rc == 0:
        try:
            threads, text = _parse(pid, json.loads(out))
        except (ValueError, TypeError, AttributeError) as e:
            return StackDump(pid, now, native=native, error=f"unreadable py-spy output: {e}"), ""
        return StackDump(pid, now, threads, text, native), ""
    msg = _message(err)
    if not psutil.pid_exists(pid):
        return StackDump(pid, now, native=native, error=f"pid {pid} is gone (py-spy: {msg})"), ""
    if _PERMISSION.search(msg):
        error = f"permission denied attaching to pid {pid} ({msg}); {PTRACE_HELP}"
        return StackDump(pid, now, native=native, error=error), ""
    if _NOT_PYTHON.search(msg):
        return StackDump(pid, now, native=native, error=f"pid {pid} is not a Python process ({msg})"), ""
    if "failed to suspend" in msg.lower():
        return None, f"py-spy could not suspend the process ({msg})"
    return StackDump(pid, now, native=native, error=f"py-spy failed (exit {rc}): {msg}"), ""


def dump_stacks(pid: int, *, native: bool = False, timeout_s: float = 10.0, pyspy: str | None = None) -> StackDump:
    """Stacks of every thread of ``pid`` (with C/C++ frames if ``native``), within ``timeout_s``.

    The dump pauses the process for a consistent snapshot. When that is impossible (a stopped
    process cannot be suspended; one in uninterruptible sleep times out) it falls back to a
    nonblocking read of Python frames only, and the text's first line says so.
    """
    exe = find_pyspy(pyspy)
    if exe is None:
        where = f" at {pyspy}" if pyspy is not None else ""
        return StackDump(pid, time.time(), native=native, error=f"py-spy not found{where}: pip install py-spy")
    start = time.monotonic()
    if _stopped(pid):
        why = "the process is stopped, so py-spy cannot suspend it"
    else:
        dump, why = _attempt(exe, pid, native, False, timeout_s * BLOCKING_SHARE)
        if dump is not None:
            return dump
    left = timeout_s - (time.monotonic() - start)
    fallback, why2 = _attempt(exe, pid, False, True, left)
    if fallback is None or fallback.error:
        error = f"{why}; nonblocking retry: {fallback.error if fallback else why2}"
        return StackDump(pid, time.time(), native=native, error=error)
    note = f"(nonblocking dump, Python frames only: {why})"
    return StackDump(pid, fallback.time, fallback.threads, f"{note}\n{fallback.text}", False)
