"""A remote agent sends a tick's batches of all its ranks in one call (``outbox``), and loses
nothing when the coordinator refuses one rank's batch or the call fails: the rank registers
again and the same records go again, in order, none twice.

Real rings, real links, a real shipper and the coordinator's real decoder
(``tests.agent.test_shipper_hold.RunsIntake``) behind a recording ``accept_reports``; the
shipper's monotonic clock is driven."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent import shipper as shipper_module
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import STEADY_S, TICK_S, Shipper
from hangwatch.client.ringsink import RingSink
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.testing import wait_for
from tests.agent.test_shipper_hold import RunsIntake, _ids

META = (r.TensorMeta((4,), "float32"),)
RANKS = 4


class Many(RunsIntake):
    """``accept_reports``, recorded: the calls, and per call its batches' ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[int]] = []
        self.refuse_rank: int | None = None  # its next batch is answered "register again"
        self.down = 0  # calls that fail from now on

    def accept_reports(self, requests: list[pb.ReportBatch]) -> list[pb.ReportReply]:
        if self.down:
            self.down -= 1
            raise ConnectionError("coordinator unreachable")
        self.calls.append([q.rank for q in requests])
        replies = []
        for q in requests:
            if q.rank == self.refuse_rank:  # as a coordinator that forgot the rank answers
                self.refuse_rank = None
                self.decoders.pop(q.session)
            if q.session not in self.decoders:
                replies.append(pb.ReportReply(reregister=True))
                continue
            replies.append(super().accept_report(q))
        return replies

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        raise AssertionError("an open rank's batch went alone")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Shipper, Many, list[RingSink], Clock]]:
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, clock = Many(), Clock()
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), mono=clock, heartbeat_s=3600.0)
    sinks = [RingSink(4096, rank=rank) for rank in range(RANKS)]
    socks = [
        link.connect(server.path, {"job_id": "j", "rank": i, "world_size": RANKS, "session": f"s{i}"}, [s.fd])
        for i, s in enumerate(sinks)
    ]
    wait_for(lambda: len(server.links()) == RANKS, 5, 0.02, "the links")
    yield shipper, intake, sinks, clock
    for sock in socks:
        assert sock is not None
        sock.close()
    for sink in sinks:
        sink.close()
    server.stop()


def _write(sinks: list[RingSink], ids: Iterator[int], n: int) -> None:
    for _ in range(n):
        call_id = next(ids)
        t = time.time()
        for rank, sink in enumerate(sinks):
            sink.put(r.CallRecord(rank, call_id, "all_reduce", "0", call_id, META, META, "sum",
                                  enter_time=t, exit_time=t + 0.0005, call_site="t.py:1"))  # fmt: skip


def _ticks(shipper: Shipper, clock: Clock, n: int) -> None:
    for _ in range(n):
        clock.now += TICK_S
        shipper.tick()


def _settle(shipper: Shipper, clock: Clock) -> None:
    """Ticks until nothing is left to send (the last calls under way held back a read)."""
    _ticks(shipper, clock, round(4 * STEADY_S / TICK_S))


def _each_once_in_order(intake: Many, last: int) -> None:
    for rank in range(RANKS):
        assert _ids(intake.events.get(rank, [])) == list(range(1, last + 1)), f"rank {rank}"


def test_a_tick_s_batches_of_all_ranks_go_in_one_call(rig: Any) -> None:
    shipper, intake, sinks, clock = rig
    ids = iter(range(1, 10_000))
    ticks = 20
    for _ in range(ticks):
        _write(sinks, ids, 5)
        _ticks(shipper, clock, 1)
    _settle(shipper, clock)
    _each_once_in_order(intake, 5 * ticks)
    # one call a tick at most, each with the batches of every rank read in that tick
    assert len(intake.calls) <= ticks + round(4 * STEADY_S / TICK_S)
    assert sum(len(c) for c in intake.calls) >= RANKS * 3
    assert max(len(c) for c in intake.calls) == RANKS
    assert shipper.outbox is not None and shipper.outbox.calls == len(intake.calls)


def test_a_rank_whose_batch_is_refused_registers_and_sends_the_same_records(rig: Any) -> None:
    shipper, intake, sinks, clock = rig
    ids = iter(range(1, 10_000))
    _write(sinks, ids, 5)
    _ticks(shipper, clock, 2)
    intake.refuse_rank = 2
    _write(sinks, ids, 5)
    _ticks(shipper, clock, 1)
    assert shipper.outbox is not None and shipper.outbox.refused >= 1
    for _ in range(4):
        _write(sinks, ids, 5)
        _ticks(shipper, clock, 1)
    _settle(shipper, clock)
    _each_once_in_order(intake, 30)
    registered = [identity.rank for identity in intake.identities]
    assert registered.count(2) == 2 and all(registered.count(rank) == 1 for rank in (0, 1, 3))


def test_calls_that_fail_lose_nothing_and_send_nothing_twice(rig: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shipper, intake, sinks, clock = rig
    monkeypatch.setattr(shipper_module, "MAX_SLOTS", 4)  # several reads a rank a tick
    ids = iter(range(1, 10_000))
    _write(sinks, ids, 5)
    _ticks(shipper, clock, 2)
    intake.down = 3
    written = 5
    for _ in range(round(10 * STEADY_S / TICK_S)):  # steady ranks are read once a STEADY_S
        if not intake.down:
            break
        _write(sinks, ids, 7)  # more than a read: a tick's reads go back in order
        written += 7
        _ticks(shipper, clock, 1)
    assert shipper.failures == 3 and intake.down == 0
    _write(sinks, ids, 5)
    _settle(shipper, clock)
    _each_once_in_order(intake, written + 5)
    assert any(c.count(0) > 1 for c in intake.calls)  # a rank's reads of a tick, in one call
    registered = [identity.rank for identity in intake.identities]
    assert all(registered.count(rank) == 4 for rank in range(RANKS))  # after each failed call
