"""The agent's shipper, with a real rank process, a real ring, a real link and the coordinator's
real decoder behind a recording intake: the identity it registers is the kernel's, the records
arrive whole, a refused batch is sent again after registering, and a rank killed mid-call is
reported gone at the moment its link closed, with every record it wrote before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import Shipper
from hangwatch.client.ringsink import RingSink
from hangwatch.coordinator.servicer import IntakeError
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.signatures import CallDecoder
from hangwatch.testing import wait_for

_RANK = textwrap.dedent(
    """
    import sys, time
    from hangwatch import link, records as r
    from hangwatch.client.ringsink import RingSink
    rank = int(sys.argv[2])
    sink = RingSink(4096, rank=rank)
    hello = {"job_id": "j", "rank": rank, "world_size": 2, "session": "s%d" % rank, "pid": 1, "local_rank": rank}
    assert link.connect(sys.argv[1], hello, [sink.fd]) is not None
    meta = (r.TensorMeta((4,), "float32"),)
    for i in range(1, 51):
        sink.put(r.CallRecord(rank, i, "all_reduce", "0", i, meta, meta, "sum", enter_time=time.time(),
                              exit_time=time.time(), call_site="train.py:9 in step"))
    sink.put(r.CallRecord(rank, 51, "all_reduce", "0", 51, meta, meta, "sum", enter_time=time.time(),
                          call_site="train.py:9 in step"))  # the call it is in when killed
    sink.set_status("train.py:9 in step\\ntrain.py:9 in step", time.time())
    print("ready", flush=True)
    time.sleep(60)
    """
)


class Intake:
    """The coordinator's side, recorded: registrations, and batches decoded by the real decoder."""

    def __init__(self) -> None:
        self.identities: list[r.RankIdentity] = []
        self.events: dict[int, list[r.RankEvent]] = {}
        self.decoders: dict[str, CallDecoder] = {}
        self.statuses: list[r.ProcessStatus] = []
        self.refuse_next_report = False
        self.wheres: list[str] = []

    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> pb.RegisterReply:
        assert via == "agent"
        if identity.rank < 0:
            raise IntakeError(f"invalid rank {identity.rank}")
        self.identities.append(identity)
        self.decoders[identity.session] = CallDecoder()
        return pb.RegisterReply(coordinator_id="c")

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        if self.refuse_next_report:  # as a restarted coordinator answers a session it does not know
            self.refuse_next_report = False
            self.decoders.clear()
            return pb.ReportReply(reregister=True)
        events, rejected, _ = self.decoders[request.session].decode(request.rank, request)
        assert rejected == 0
        self.events.setdefault(request.rank, []).extend(events)
        if request.where_user:
            self.wheres.append(request.where_user)
        return pb.ReportReply(accepted=len(events))

    def apply_process_statuses(self, host: str, statuses: list[r.ProcessStatus]) -> None:
        assert host == "node-1"
        self.statuses.extend(statuses)


def shipping(tmp_path: Path, intake: Intake) -> Iterator[tuple[RingServer, Shipper, Intake]]:
    """A ring server, and a shipper of its links' rings to ``intake``; the server stopped after."""
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    yield server, Shipper(server, intake, "node-1", PsutilInspector()), intake
    server.stop()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[RingServer, Shipper, Intake]]:
    yield from shipping(tmp_path, Intake())


def _rank(path: str, rank: int) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", _RANK, path, str(rank)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.timeout(60)
def test_records_identity_and_death_of_a_linked_rank(agent: tuple[RingServer, Shipper, Intake]) -> None:
    server, shipper, intake = agent
    child = _rank(server.path, 1)
    try:
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        intake.refuse_next_report = True
        for _ in range(3):
            shipper.tick()
        (ident,) = intake.identities[-1:]
        assert ident.pid == child.pid and ident.host == "node-1"  # the kernel's pid, not the hello's 1
        assert ident.start_time > 0 and (ident.rank, ident.session, ident.world_size) == (1, "s1", 2)
        assert len(intake.identities) == 2  # registered again after the refusal, nothing lost:
        calls = [e for e in intake.events[1] if isinstance(e, r.CallRecord)]
        assert [c.call_id for c in calls] == list(range(1, 52))
        assert calls[-1].exit_time is None and calls[0].exit_time is not None
        assert intake.wheres[-1] == "train.py:9 in step"
        killed = time.time()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: (shipper.tick(), intake.statuses)[1], 5, 0.02, "the rank reported gone")
        (gone,) = intake.statuses
        assert gone.pid == child.pid and gone.state in (r.ProcState.DEAD, r.ProcState.ZOMBIE)
        assert gone.time - killed < 1.0
        assert server.links() == []  # read to the end and forgotten
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


@pytest.mark.timeout(60)
def test_a_link_the_coordinator_refuses_is_dropped(agent: tuple[RingServer, Shipper, Intake]) -> None:
    server, shipper, intake = agent
    child = _rank(server.path, -3)
    try:
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        shipper.tick()
        assert shipper.refused == 1 and server.links() == [] and intake.identities == []
    finally:
        child.kill()
        child.wait(10)


def test_records_written_after_an_idle_tick_are_shipped(agent: tuple[RingServer, Shipper, Intake]) -> None:
    """A tick that finds nothing new must not keep that empty read: the next one reads afresh
    (it once did, and a short job's records never left the ring)."""
    server, shipper, intake = agent
    sink = RingSink(64, rank=0)
    sock = link.connect(server.path, {"job_id": "j", "rank": 0, "world_size": 2, "session": "s0"}, [sink.fd])
    assert sock is not None
    try:
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        for _ in range(3):
            shipper.tick()  # registered; nothing written yet, and no status: no heartbeat either
        meta = (r.TensorMeta((4,), "float32"),)
        sink.put(r.CallRecord(0, 1, "all_reduce", "0", 1, meta, meta, "sum", enter_time=1.0, call_site="t.py:1"))
        shipper.tick()
        assert [e.call_id for e in intake.events[0] if isinstance(e, r.CallRecord)] == [1]
    finally:
        sock.close()
        sink.close()


_RANK_IN_PHASES = textwrap.dedent(
    """
    import os, signal, sys, time
    from hangwatch import link, records as r
    from hangwatch.client.ringsink import RingSink
    sink = RingSink(4096, rank=0)
    hello = {"job_id": "j", "rank": 0, "world_size": 2, "session": "s0", "pid": 1, "local_rank": 0}
    linked = link.connect(sys.argv[1], hello, [sink.fd])  # kept: the link closes when the rank dies
    assert linked is not None
    meta = (r.TensorMeta((4,), "float32"),)
    sink.set_status("train.py:9 in step\\ntrain.py:9 in step", time.time())
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "status":
            sink.set_status("train.py:9 in step\\ntrain.py:9 in step", time.time())
        elif line.strip() == "die":
            sink.put(r.CallRecord(0, 7, "broadcast", "0", 7, meta, meta, root=0, enter_time=time.time(),
                                  call_site="train.py:9 in step"))  # written, then killed at once
            os.kill(os.getpid(), signal.SIGKILL)
        print("done", flush=True)
    """
)


@pytest.mark.timeout(60)
def test_records_written_after_an_idle_poll_and_just_before_death_arrive(
    agent: tuple[RingServer, Shipper, Intake],
) -> None:
    """An empty poll kept back until the next heartbeat must not stop the shipper from looking
    again: the rank writes its last record and is killed within one heartbeat; the record and
    the death arrive together, the death with its signal read before the parent reaps it."""
    server, shipper, intake = agent
    shipper.heartbeat_s = 60.0  # no heartbeat in this test: only records make batches
    child = subprocess.Popen(
        [sys.executable, "-c", _RANK_IN_PHASES, server.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        for _ in range(3):
            shipper.tick()  # registered, a first batch, then an idle poll
        child.stdin.write("die\n")
        child.stdin.flush()
        wait_for(lambda: server.links()[0].closed_at if server.links() else True, 5, 0.02, "the link closed")
        shipper.tick()
        calls = [e for e in intake.events.get(0, []) if isinstance(e, r.CallRecord)]
        assert [(c.op, c.seq, c.exit_time) for c in calls] == [("broadcast", 7, None)]
        (gone,) = intake.statuses
        assert gone.signal == signal.SIGKILL and gone.exit_code is None
        assert not gone.oom_killed
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)


@pytest.mark.timeout(60)
def test_no_heartbeat_for_a_rank_whose_own_status_stands_still(agent: tuple[RingServer, Shipper, Intake]) -> None:
    """A frozen rank (its GIL held) writes neither records nor status: the agent, which could
    read its ring all the same, must not heartbeat for it, or it would never look frozen."""
    server, shipper, intake = agent
    shipper.heartbeat_s = 0.0
    batches: list[pb.ReportBatch] = []
    accept = intake.accept_report

    def counting(request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        batches.append(request)
        return accept(request, relay)

    intake.accept_report = counting  # type: ignore[method-assign]
    child = subprocess.Popen(
        [sys.executable, "-c", _RANK_IN_PHASES, server.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        for _ in range(5):
            shipper.tick()
        assert len(batches) == 1 and batches[0].alive_time > 0  # the first, then nothing new from the rank
        child.stdin.write("status\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        for _ in range(5):
            shipper.tick()
        assert len(batches) == 2 and batches[1].alive_time > batches[0].alive_time
    finally:
        child.kill()
        child.wait(10)
