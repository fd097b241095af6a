"""NodeAgentCore: what poll reports, and dump/abort through identity checks."""

from __future__ import annotations

import os
import signal

import pytest

from hangwatch.agent import core as core_module
from hangwatch.agent.core import NodeAgentCore
from hangwatch.agent.identity import Proofs
from hangwatch.records import ProcessStatus, ProcState, StackDump, Target, link_tag

from .conftest import Spawn, target, wait_until

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"


class FakeInspector:
    """Statuses set by the test."""

    def __init__(self) -> None:
        self.states: dict[int, ProcessStatus] = {}

    def status(self, pid: int) -> ProcessStatus:
        return self.states.get(pid, ProcessStatus(pid, ProcState.DEAD, 0.0))


@pytest.fixture
def fake() -> FakeInspector:
    return FakeInspector()


def test_poll_reports_changes_then_death(spawn: Spawn) -> None:
    proc = spawn(SLEEPER)
    core = NodeAgentCore(host="node-a")
    core.set_targets([target(proc, rank=5)])
    wait_until(lambda: [s.state for s in core.poll(full=True)] == [ProcState.SLEEPING])
    assert core.poll() == []  # nothing changed
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    statuses: list[ProcessStatus] = []

    def reported() -> bool:
        statuses.extend(core.poll())
        return bool(statuses)

    wait_until(reported)
    assert [(s.pid, s.state) for s in statuses] == [(proc.pid, ProcState.DEAD)]
    assert core.poll() == []  # death is reported once
    assert [s.state for s in core.poll(full=True)] == [ProcState.DEAD]


def test_poll_refresh_and_reused_pid(fake: FakeInspector, monkeypatch: pytest.MonkeyPatch) -> None:
    core = NodeAgentCore(inspector=fake)
    fake.states[10] = ProcessStatus(10, ProcState.RUNNING, 1.0, start_time=500.0, cpu_percent=99.0)
    core.set_targets([Target(0, 10, 500.0, link="L")])
    assert len(core.poll()) == 1 and core.poll() == []
    monkeypatch.setattr(core_module, "REFRESH_S", 0.0)
    assert [s.cpu_percent for s in core.poll()] == [99.0]  # periodic refresh of a live process
    fake.states[10] = ProcessStatus(10, ProcState.RUNNING, 2.0, start_time=900.0)  # someone else now
    assert core.poll() == [ProcessStatus(10, ProcState.DEAD, 2.0, start_time=500.0)]
    assert core.poll() == []  # dead targets are not refreshed
    core.set_targets([])
    assert core.poll(full=True) == []


def test_dump_and_abort_refuse_unverified(fake: FakeInspector) -> None:
    dumped: list[int] = []

    def dumper(pid: int, *, native: bool = False, timeout_s: float = 10.0) -> StackDump:
        dumped.append(pid)
        return StackDump(pid, 0.0, native=native)

    core = NodeAgentCore(inspector=fake, dumper=dumper)
    core.proofs = Proofs(uid_of=lambda pid: 1000, parent=lambda pid: None)
    for pid in (10, 11):  # both linked as ranks, started at 500; pid 12 never linked
        core.proofs.add(pid, 1000, 500.0, "L")
    fake.states[10] = ProcessStatus(10, ProcState.SLEEPING, 1.0, start_time=500.0)
    fake.states[11] = ProcessStatus(11, ProcState.SLEEPING, 1.0, start_time=999.0)
    fake.states[12] = ProcessStatus(12, ProcState.SLEEPING, 1.0, start_time=500.0)
    dumps = core.dump(
        [Target(0, 10, 500.0, link="L"), Target(1, 11, 500.0, link="L"), Target(2, 12, 500.0, link="L")],
        native=True,
        timeout_s=1.0,
    )
    assert dumped == [10] and dumps[0].ok and dumps[0].native
    assert dumps[1].error is not None and "was reused" in dumps[1].error
    assert dumps[2].error is not None and "never linked" in dumps[2].error and "own claim" in dumps[2].error
    assert core.abort([Target(1, 11, 500.0, link="L"), Target(2, 12, 500.0, link="L")], grace_s=0.1) == []


def test_a_proven_process_is_touched_only_for_the_registration_it_linked_with(fake: FakeInspector) -> None:
    """A pid and start time are public: a registration that names a proven process is honoured
    only where that process's own link came with the registration's session."""
    core = NodeAgentCore(inspector=fake, dumper=lambda pid, **kw: StackDump(pid, 0.0))
    core.proofs = Proofs(uid_of=lambda pid: 1000, parent=lambda pid: None)
    core.proofs.add(10, 1000, 500.0, link_tag("its-own"))
    fake.states[10] = ProcessStatus(10, ProcState.SLEEPING, 1.0, start_time=500.0)
    assert core.dump([Target(0, 10, 500.0, link=link_tag("its-own"))], timeout_s=1.0)[0].ok
    for claim in (link_tag("someone-else"), ""):
        dump = core.dump([Target(0, 10, 500.0, link=claim)], timeout_s=1.0)[0]
        assert dump.error is not None and "another registration" in dump.error
        assert core.abort([Target(0, 10, 500.0, link=claim)], grace_s=0.1) == []
    core.proofs.add(10, 1000, 500.0, link_tag("its-second"))  # the same process makes its group again
    assert core.dump([Target(0, 10, 500.0, link=link_tag("its-own"))], timeout_s=1.0)[0].ok
    assert core.dump([Target(0, 10, 500.0, link=link_tag("its-second"))], timeout_s=1.0)[0].ok
    core.proofs.add(10, 1000, 900.0, link_tag("a-new-process"))  # the pid reused: the old links go
    fake.states[10] = ProcessStatus(10, ProcState.SLEEPING, 1.0, start_time=900.0)
    dump = core.dump([Target(0, 10, 900.0, link=link_tag("its-own"))], timeout_s=1.0)[0]
    assert dump.error is not None and "another registration" in dump.error


def test_a_proven_rank_running_as_another_user_now_is_refused(fake: FakeInspector) -> None:
    uids = {10: 1000}
    core = NodeAgentCore(inspector=fake, dumper=lambda pid, **kw: StackDump(pid, 0.0))
    core.proofs = Proofs(uid_of=uids.get, parent=lambda pid: None)
    core.proofs.add(10, 1000, 500.0, "L")
    fake.states[10] = ProcessStatus(10, ProcState.SLEEPING, 1.0, start_time=500.0)
    assert core.dump([Target(0, 10, 500.0, link="L")], timeout_s=1.0)[0].ok
    uids[10] = 0  # the process changed its uid since it linked (setuid)
    dump = core.dump([Target(0, 10, 500.0, link="L")], timeout_s=1.0)[0]
    assert dump.error is not None and "uid 0, not uid 1000" in dump.error
    assert core.abort([Target(0, 10, 500.0, link="L")], grace_s=0.1) == []


def test_a_proven_rank_no_longer_under_its_running_launcher_is_refused(fake: FakeInspector) -> None:
    """Where the job's launcher is known (the rank's parent when it linked) and still runs, a
    process that is no longer its descendant is not touched; once the launcher is gone the
    link's proof stands alone (an orphaned hung rank can still be stopped)."""
    parents = {10: (7, 300.0), 7: (3, 100.0)}
    started = {7: 300.0}
    core = NodeAgentCore(inspector=fake, dumper=lambda pid, **kw: StackDump(pid, 0.0))
    core.proofs = Proofs(uid_of=lambda pid: 1000, parent=parents.get, started=started.get)
    core.proofs.add(10, 1000, 500.0, "L")
    fake.states[10] = ProcessStatus(10, ProcState.SLEEPING, 1.0, start_time=500.0)
    assert core.dump([Target(0, 10, 500.0, link="L")], timeout_s=1.0)[0].ok
    parents[10] = (8, 400.0)  # now under another process, while its launcher (7) still runs
    dump = core.dump([Target(0, 10, 500.0, link="L")], timeout_s=1.0)[0]
    assert dump.error is not None and "no longer a descendant of pid 7" in dump.error
    assert core.abort([Target(0, 10, 500.0, link="L")], grace_s=0.1) == []
    parents[8] = (7, 300.0)  # a grandchild of the launcher is its descendant all the same
    assert core.dump([Target(0, 10, 500.0, link="L")], timeout_s=1.0)[0].ok
    del parents[8]
    started[7] = 900.0  # the launcher's pid now belongs to another process: the launcher is gone
    assert core.dump([Target(0, 10, 500.0, link="L")], timeout_s=1.0)[0].ok


def test_a_real_rank_under_its_real_launcher_passes() -> None:
    """The real process tree: this test is the launcher of a ``sleep`` that is proven."""
    import subprocess

    from hangwatch.agent.identity import proven_start_time

    child = subprocess.Popen(["sleep", "30"])
    try:
        started = proven_start_time(child.pid)
        assert started is not None
        proofs = Proofs()
        proofs.add(child.pid, os.getuid(), started, "L")
        assert proofs.check(Target(0, child.pid, started, link="L")) is None
    finally:
        child.kill()
        child.wait(5)


def test_a_rank_whose_launcher_died_unreaped_is_still_dumped() -> None:
    """Found in issue 38: under a launcher that is itself a rank (Lightning's, ``mp.spawn``-style),
    gloo aborted rank 0; it stayed a zombie awaiting its parent, and the other ranks' stacks were
    refused as "no longer a descendant of pid M, the process that launched it (which still runs)".
    Real processes: a launcher that starts a rank and dies unreaped by this test, its parent."""
    import subprocess
    import sys
    import time

    import psutil

    from hangwatch.agent.identity import proven_start_time

    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
         "print(p.pid, flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert launcher.stdout is not None and launcher.stdin is not None
    rank = int(launcher.stdout.readline())
    try:
        started = proven_start_time(rank)
        assert started is not None
        proofs = Proofs()
        proofs.add(rank, os.getuid(), started, "L")  # its launcher recorded while it runs
        target = Target(1, rank, started, link="L")
        assert proofs.check(target) is None
        launcher.stdin.close()  # the launcher exits; this test does not reap it: a zombie
        deadline = time.time() + 10
        while psutil.Process(launcher.pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
            time.sleep(0.05)
        assert psutil.Process(launcher.pid).status() == psutil.STATUS_ZOMBIE
        assert psutil.Process(rank).ppid() != launcher.pid  # the rank is under another process now
        assert proofs.check(target) is None
    finally:
        psutil.Process(rank).kill()
        launcher.wait(5)
