"""Terminate a hung job's ranks: SIGTERM, a grace period, then SIGKILL; never a reused pid."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence

from hangwatch.agent.identity import verify
from hangwatch.agent.procinfo import ProcessInspector
from hangwatch.records import Target

log = logging.getLogger(__name__)
_POLL_S = 0.05


def _signal(target: Target, sig: signal.Signals, inspector: ProcessInspector) -> bool:
    """Send ``sig`` if ``target`` is still its own live process; True when sent."""
    refused = verify(target, inspector)
    if refused:
        log.info("not sending %s to rank %d: %s", sig.name, target.rank, refused)
        return False
    try:
        os.kill(target.pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as e:
        log.warning("cannot send %s to rank %d (pid %d): %s", sig.name, target.rank, target.pid, e)
        return False
    return True


def abort(targets: Sequence[Target], *, grace_s: float, inspector: ProcessInspector) -> list[int]:
    """SIGTERM the verified targets, SIGKILL those still alive after ``grace_s``; pids signalled."""
    signalled = [t for t in targets if _signal(t, signal.SIGTERM, inspector)]
    deadline = time.monotonic() + grace_s
    alive = list(signalled)
    while alive:
        alive = [t for t in alive if verify(t, inspector) is None]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
    for t in alive:
        log.info("rank %d (pid %d) survived SIGTERM for %.1f s: SIGKILL", t.rank, t.pid, grace_s)
        _signal(t, signal.SIGKILL, inspector)
    return [t.pid for t in signalled]
