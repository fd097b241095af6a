"""Abort: SIGTERM, grace, SIGKILL, and never a process that is not the target."""

from __future__ import annotations

import signal
import time

from hangwatch.agent.abort import abort
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.records import Target

from .conftest import Spawn, target

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
STUBBORN = """\
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def test_abort_terminates_verified_targets_only(spawn: Spawn) -> None:
    polite, stubborn, bystander = spawn(SLEEPER), spawn(STUBBORN), spawn(SLEEPER)
    stale = Target(2, bystander.pid, target(bystander).start_time - 3600)
    began = time.monotonic()
    pids = abort([target(polite, 0), target(stubborn, 1), stale], grace_s=0.5, inspector=PsutilInspector())
    assert time.monotonic() - began < 2.0
    assert pids == [polite.pid, stubborn.pid]
    assert polite.wait(timeout=5) == -signal.SIGTERM
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    assert bystander.poll() is None  # a reused pid is never signalled
