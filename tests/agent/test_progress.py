"""The agent reads where each NCCL group stands on the GPU and ships it as ``GroupProgress``.

``progress_of`` runs on NCCL Flight Recorder dumps captured on an H100 (``tests/fixtures/nccl``,
never hand-edited); the fetcher and the shipper run for real with the worker server's answers as
the seam (``read``), and the shipped batches go through the coordinator's real decoder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent.flightrecorder import RingFetcher
from hangwatch.agent.frquery import progress_of
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import READ_S, TICK_S, Shipper
from hangwatch.client.ringsink import RingSink
from hangwatch.testing import wait_for
from tests.agent.test_shipper import Intake

NCCL = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"


def _dump(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((NCCL / name).read_text())
    return data


def test_a_collective_enqueued_behind_a_sleeping_stream_is_not_completed() -> None:
    """H100: ``torch.cuda._sleep`` before an all_reduce, the host blocked in ``.item()``."""
    (p,) = progress_of(_dump("ws_blocked_item_dump_nccl_trace_json.json"))
    assert (p.group, p.enqueued, p.started, p.completed) == ("0", 2, -1, 1)
    assert p.timeout_ms == 600_000  # from the pending entry
    assert p.completed_time == 0.0  # seq 1's entry was retired and is not in this read


def test_with_start_events_the_started_seq_and_the_discovery_times_are_read() -> None:
    """H100, TORCH_NCCL_ENABLE_TIMING=1: 20 collectives on the world group, one on a subgroup."""
    progress = {p.group: p for p in progress_of(_dump("nccl_ring_timing1.json"))}
    world = progress["0"]
    assert (world.enqueued, world.started, world.completed) == (20, 20, 20)
    assert world.completed_time == pytest.approx(1795410394.829776050)
    assert world.started_time == pytest.approx(1795410394.829775619)
    assert progress["1"].completed == 1


def test_nothing_in_flight_reads_as_everything_enqueued_completed_and_timeouts_carry_over() -> None:
    """An ``onlyactive`` read with nothing active has no entries: nothing was in flight."""
    timeouts: dict[str, int] = {}
    progress_of(_dump("nccl_ring_timing0.json"), timeouts)
    assert timeouts["0"] == 600_000
    (p, _) = progress_of(_dump("nccl_ring_onlyactive_timing0.json"), timeouts)
    assert p.enqueued == p.completed and p.timeout_ms == 600_000


def test_p2p_traffic_in_the_counters_does_not_hide_a_completed_collective() -> None:
    """ProcessGroupNCCL moves ``last_completed`` with p2p works' own counter: after an isend
    finishing late, ``pg_status`` reads "enqueued 51, completed 1" while every collective
    completed. Progress comes from the collective entries instead."""
    ring = _dump("nccl_ring_timing1.json")
    ring["pg_status"]["0"] = {"last_enqueued_collective": "21", "last_started_collective": "21",
                              "last_completed_collective": "1"}  # fmt: skip
    p2p = dict(ring["entries"][0], is_p2p=True, collective_seq_id=20, p2p_seq_id=1, state="completed")
    ring["entries"].append(p2p)
    world = {p.group: p for p in progress_of(ring)}["0"]
    assert world.enqueued == world.completed == 20


def test_a_ring_without_pg_status_or_with_junk_gives_nothing_or_skips_it() -> None:
    assert progress_of({}) == []
    junk = {"pg_status": {"0": {"last_enqueued_collective": "x"}}, "entries": [{"process_group": None}, 7]}
    (p,) = progress_of(junk)
    assert (p.enqueued, p.completed, p.started) == (-2, -2, -1)


class Gpu:
    """A CUDA rank's worker server: one all_reduce (seq 1) on its NCCL ring, not completed
    until the test says so; an ``onlyactive`` read leaves completed entries out, as torch's."""

    def __init__(self) -> None:
        self.status = {"0": {"last_enqueued_collective": "1", "last_started_collective": "-1",
                             "last_completed_collective": "0"}}  # fmt: skip
        entry = _dump("ws_blocked_item_dump_nccl_trace_json.json")["entries"][0]
        self.entries = [dict(entry, collective_seq_id=1)]

    def complete(self) -> None:
        self.status["0"]["last_completed_collective"] = "1"
        self.entries[0]["state"] = "completed"

    def __call__(
        self, path: str, pid: int, *, names: Any = ("cpu", "nccl"), only_active: bool = False, **_: Any
    ) -> Any:
        if "nccl" not in names:
            return {}, {}
        entries = [e for e in self.entries if not (only_active and e["state"] == "completed")]
        return {
            "nccl": {"pg_status": json.loads(json.dumps(self.status)), "entries": json.loads(json.dumps(entries))}
        }, {}


def test_every_read_of_a_probed_ring_carries_its_progress() -> None:
    """The probe that spares reading entries still reads ``pg_status``: progress comes with it."""
    gpu = Gpu()
    fetcher = RingFetcher(interval_s=3600.0, read=gpu, clock=lambda: 50.0, background=False)
    fetcher.watch(1, "/run/w.sock", 4242, lambda since: False)  # Python accounts for every seq
    fetcher.poll_once()
    first = fetcher.take(1)
    assert first is not None and [(p.enqueued, p.completed, p.time) for p in first.progress] == [(1, 0, 50.0)]
    gpu.complete()
    fetcher.poll_once()
    assert fetcher.spared == 1
    second = fetcher.take(1)
    assert second is not None and [p.completed for p in second.progress] == [1]
    fetcher.stop()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[RingServer, Shipper, Intake, Gpu, RingSink]]:
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, gpu = Intake(), Gpu()
    fetcher = RingFetcher(interval_s=0.02, read=gpu)
    sink = RingSink(256, rank=3)
    yield server, Shipper(server, intake, "node-1", PsutilInspector(), flight_recorder=fetcher), intake, gpu, sink
    fetcher.stop()
    server.stop()
    sink.close()


def test_the_shipper_sends_the_rank_s_progress_to_the_coordinator(rig: Any) -> None:
    server, shipper, intake, gpu, sink = rig
    hello = {"job_id": "j", "rank": 3, "world_size": 4, "session": "s3", "worker_socket": "/run/w.sock"}
    sock = link.connect(server.path, hello, [sink.fd])
    assert sock is not None

    def progress() -> list[r.GroupProgress]:
        return [e for e in intake.events.get(3, []) if isinstance(e, r.GroupProgress)]

    def shipped(completed: int) -> bool:
        shipper.tick()
        return any(p.completed == completed for p in progress())

    try:
        wait_for(lambda: shipped(0), 5, 0.02, "progress shipped")
        first = progress()[0]
        assert (first.rank, first.group, first.enqueued, first.started) == (3, "0", 1, -1)
        gpu.complete()
        wait_for(lambda: shipped(1), 5, 0.02, "the completion shipped")
    finally:
        sock.close()


class Mono:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("read_less", [True, False], ids=["read less", "HANGWATCH_READ_LESS=0"])
def test_a_device_caught_up_rides_with_the_next_batch_and_one_with_work_pending_goes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_less: bool
) -> None:
    monkeypatch.setenv("HANGWATCH_READ_LESS", "1" if read_less else "0")
    server = RingServer(str(tmp_path / "agent.sock"))
    server.start()
    intake, gpu, mono = Intake(), Gpu(), Mono()
    fetcher = RingFetcher(interval_s=3600.0, read=gpu, background=False)  # read when the test says
    shipper = Shipper(server, intake, "node-1", PsutilInspector(), flight_recorder=fetcher, mono=mono)
    sink = RingSink(256, rank=3)
    hello = {"job_id": "j", "rank": 3, "world_size": 4, "session": "s3", "worker_socket": "/run/w.sock"}
    sock = link.connect(server.path, hello, [sink.fd])
    assert sock is not None

    def completed() -> list[int]:
        return [e.completed for e in intake.events.get(3, []) if isinstance(e, r.GroupProgress)]

    def read_and_tick() -> None:
        fetcher.poll_once()
        mono.now += TICK_S
        shipper.tick()

    try:
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        shipper.tick()  # registered, its Flight Recorder watched
        read_and_tick()  # seq 1 issued from C++ (its record goes at once), enqueued, not completed
        assert completed() == [0]  # with it
        read_and_tick()  # nothing completed since, work enqueued: the device stands
        assert completed() == [0, 0]
        gpu.complete()
        read_and_tick()  # it moved again
        assert completed() == [0, 0, 1]
        read_and_tick()  # caught up (all it enqueued completed): it rides
        assert completed() == ([0, 0, 1] if read_less else [0, 0, 1, 1])
        mono.now += READ_S
        shipper.tick()  # within READ_S, in a batch of its own where the rank sent none
        assert completed() == [0, 0, 1, 1]
        read_and_tick()
        assert completed() == ([0, 0, 1, 1] if read_less else [0, 0, 1, 1, 1])
        sink.put(r.CallRecord(3, 1, "all_reduce", "0", 2, (), (), "sum", enter_time=time.time(),
                              exit_time=time.time(), call_site="t.py:1"))  # fmt: skip
        mono.now += TICK_S
        shipper.tick()  # the rank's next batch carries it
        assert completed() == [0, 0, 1, 1, 1]
        calls = [e for e in intake.events[3] if isinstance(e, r.CallRecord)]
        assert [(c.source, c.seq) for c in calls] == [("flight_recorder", 1), ("python", 2)]
        if read_less:  # in one batch: its call, then it
            assert intake.events[3][-2:] == [calls[-1], intake.events[3][-1]]
    finally:
        sock.close()
        fetcher.stop()
        server.stop()
        sink.close()
