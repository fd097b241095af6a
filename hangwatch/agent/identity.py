"""Is the process at a target's pid still that target? Every dump and abort asks first."""

from __future__ import annotations

import datetime

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
