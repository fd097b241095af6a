"""The NCCL path end to end without a GPU: ranks' rings -> the node agent -> the coordinator -> the
diagnosis.

Each rank is a real ring (``RingSink``) written as the hook writes it, linked to a real agent
(``RingServer`` + ``Shipper``) that ships to a real ``Coordinator`` whose engine runs. The seam is
each rank's worker server: it answers with NCCL Flight Recorder JSON in the schema captured on an
H100 (``tests/fixtures/nccl/ws_blocked_item_dump_nccl_trace_json.json``: an all_reduce enqueued
behind a busy stream, the host blocked in ``.item()``), with the counters and states each
scenario sets. NCCL refuses two ranks on one GPU, so multi-rank NCCL logic is proven here.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent.flightrecorder import RingFetcher
from hangwatch.agent.procinfo import PsutilInspector
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import Shipper
from hangwatch.client.ringsink import RingSink
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import wait_for

NCCL = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"
CAPTURED: dict[str, Any] = json.loads((NCCL / "ws_blocked_item_dump_nccl_trace_json.json").read_text())
META = (r.TensorMeta((4,), "float32", "cuda:0"),)
ITEM = "train.py:57 in train_step"

#: Each test waits out the coordinator's stuck threshold: left out of ``make unit``.
pytestmark = pytest.mark.slow


class Rank:
    """One rank: its ring, what its hook wrote, and what its worker server answers."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.sink = RingSink(256, rank=rank)
        self.ids = iter(range(1, 10_000))
        self.where = "train.py:50 in train_step"
        self.entries: list[dict[str, Any]] = []
        self.status = {"last_enqueued_collective": 0, "last_started_collective": -1, "last_completed_collective": 0}

    def python_all_reduce(self, seq: int, *, completes: bool) -> None:
        """The hook's record of a Python ``all_reduce`` (it returns at once: enqueued), and the
        ring's entry for it."""
        now = time.time()
        record = r.CallRecord(self.rank, next(self.ids), "all_reduce", "0", seq, META, META, "sum", enter_time=now)
        record.exit_time = now + 0.0001
        self.sink.put(record)
        self.enqueue(seq, completes=completes, t=now)

    def enqueue(self, seq: int, *, completes: bool, t: float | None = None) -> None:
        """A collective enqueued on the group (from Python, or from C++: DDP's buckets)."""
        entry = copy.deepcopy(CAPTURED["entries"][0])
        t = time.time() if t is None else t
        entry.update(collective_seq_id=seq, record_id=seq, time_created_ns=int(t * 1e9))
        if completes:
            entry.update(state="completed", time_discovered_completed_ns=int((t + 0.002) * 1e9))
        self.entries.append(entry)
        self.status["last_enqueued_collective"] = seq
        if completes:
            self.status["last_completed_collective"] = seq

    def complete_through(self, seq: int) -> None:
        """The GPU completed every collective enqueued up to ``seq`` (as its ring's entries say)."""
        now = time.time()
        for entry in self.entries:
            if entry["collective_seq_id"] <= seq and entry["state"] != "completed":
                entry.update(state="completed", time_discovered_completed_ns=int(now * 1e9))
        self.status["last_completed_collective"] = max(self.status["last_completed_collective"], seq)

    def serve(self, path: str, pid: int, *, names: Any = ("cpu", "nccl"), collectives: bool = True, **_: Any) -> Any:
        if "nccl" not in names:
            return {}, {}
        ring = copy.deepcopy({k: v for k, v in CAPTURED.items() if k != "entries"})
        ring["pg_status"] = {"0": {k: str(v) for k, v in self.status.items()}}
        if collectives:
            ring["entries"] = copy.deepcopy(self.entries)
        return {"nccl": ring}, {}

    def beat(self) -> None:
        """What the rank's sender thread does every heartbeat: say where the main thread is."""
        self.sink.set_status(f"{self.where}\n{self.where}", time.time())


class Job:
    def __init__(self, coordinator: Coordinator, world: int, tmp: Path) -> None:
        self.ranks = [Rank(rk, world) for rk in range(world)]
        self.server = RingServer(str(tmp / "agent.sock"))
        self.server.start()

        def read(path: str, pid: int, **kw: Any) -> Any:
            return self.ranks[int(path.rsplit("-", 1)[1])].serve(path, pid, **kw)

        self.fetcher = RingFetcher(interval_s=0.1, read=read)
        self.shipper = Shipper(self.server, coordinator, "node-1", PsutilInspector(), flight_recorder=self.fetcher)
        self.links: list[socket.socket] = []
        for rank in self.ranks:
            hello = {"job_id": "nccl-job", "rank": rank.rank, "world_size": world, "session": f"s{rank.rank}",
                     "backend": "nccl", "worker_socket": f"/run/worker-{rank.rank}"}  # fmt: skip
            sock = link.connect(self.server.path, hello, [rank.sink.fd])
            assert sock is not None
            self.links.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for rank in self.ranks:
                rank.beat()
            self.shipper.tick()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.links:
            sock.close()
        self.fetcher.stop()
        self.server.stop()
        for rank in self.ranks:
            rank.sink.close()


@pytest.fixture
def nccl_job(coordinator_factory: Callable[..., Coordinator], tmp_path: Path) -> Iterator[Callable[[int], Any]]:
    made: list[tuple[Coordinator, Job]] = []

    def make(world: int) -> tuple[Coordinator, Job]:
        coordinator = coordinator_factory(stuck_after=3.0, embedded_agent=False)
        job = Job(coordinator, world, tmp_path)
        made.append((coordinator, job))
        # the agent's first read of each rank's NCCL ring: from then on completion is watched (a
        # call returned before it counts as complete at its return, as without a NCCL ring)
        wait_for(lambda: _completion(coordinator) == ["device"] * world, 10, 0.05, "progress from every rank")
        return coordinator, job

    yield make
    for _, job in made:
        job.close()


def _completion(coordinator: Coordinator) -> list[str]:
    return [rk["completion"] for rk in coordinator.status()["ranks"]]


def _incidents(coordinator: Coordinator) -> list[dict[str, Any]]:
    return coordinator.incidents_json()  # type: ignore[no-any-return]


def test_ranks_waiting_on_the_gpu_and_blocked_in_item_blame_the_rank_that_never_enqueued(nccl_job: Any) -> None:
    coordinator, job = nccl_job(3)
    for rank in job.ranks:
        rank.python_all_reduce(1, completes=True)
    for rk in (0, 2):
        job.ranks[rk].python_all_reduce(2, completes=False)  # behind a busy stream, or a peer missing
        job.ranks[rk].where = ITEM  # the host went on to loss.item() and blocks there
    job.ranks[1].where = "train.py:90 in save_checkpoint"
    wait_for(lambda: _incidents(coordinator), 20, 0.1, "an incident")
    time.sleep(0.5)
    (inc,) = _incidents(coordinator)
    assert inc["kind"] == "stuck_collective", inc["summary"]
    assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["seq"]) == ([1], [0, 2], 2)
    assert "ranks 0, 2 enqueued it on the GPU, where it has not completed" in inc["summary"]
    assert f"rank 0 in {ITEM}" in inc["summary"] and "save_checkpoint" in inc["summary"]
    assert "torch's own timeout fires at" in inc["summary"]
    ranks = {rk["rank"]: rk for rk in coordinator.status()["ranks"]}
    assert ranks[0]["state"] == "waiting" and ranks[0]["completion"] == "device" and ranks[0]["host_returned"]
    assert ranks[1]["state"] == "running"


def test_ddp_buckets_seen_only_in_the_nccl_ring_and_a_rank_that_left_the_loop(nccl_job: Any) -> None:
    """DDP's bucket all_reduce is issued from C++: only the NCCL ring knows it. Rank 1 stopped
    issuing them (its loop ended on its own condition); rank 0's bucket waits on the GPU."""
    coordinator, job = nccl_job(2)
    for rank in job.ranks:
        rank.python_all_reduce(1, completes=True)
        rank.enqueue(2, completes=True)  # a bucket both ranks reduced
    job.ranks[0].enqueue(3, completes=False)
    job.ranks[0].where = ITEM
    job.ranks[1].where = "train.py:70 in evaluate"
    wait_for(lambda: _incidents(coordinator), 20, 0.1, "an incident")
    time.sleep(0.5)
    (inc,) = _incidents(coordinator)
    assert inc["kind"] == "stuck_collective", inc["summary"]
    assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["seq"]) == ([1], [0], 3)
    assert "issued from C++ (nccl:all_reduce)" in inc["details"]["calls"]["0"]


def test_healthy_nccl_ranks_whose_gpus_complete_raise_nothing(nccl_job: Any) -> None:
    """The look-alike: every rank enqueues step after step and returns at once; the GPU completes
    each collective a moment later; hosts spend their time in ``.item()``."""
    coordinator, job = nccl_job(2)
    for rank in job.ranks:
        rank.where = ITEM
    deadline = time.time() + 5.5  # past the 3 s stuck threshold
    seq = 0
    while time.time() < deadline:
        seq += 1
        for rank in job.ranks:
            rank.python_all_reduce(seq, completes=False)
        time.sleep(0.3)
        for rank in job.ranks:
            rank.complete_through(seq)
        time.sleep(0.05)
    # the last read (everything completed) rides with the rank's next batch, within a read or two
    settled = lambda: all(not rk["host_returned"] for rk in coordinator.status()["ranks"])  # noqa: E731
    wait_for(settled, 10, 0.1, "each rank's last collective completed")
    assert _incidents(coordinator) == []
    assert _completion(coordinator) == ["device", "device"]


def _steady_steps(job: Any, steps: int, per_step: int, behind: int) -> int:
    """Every rank issues ``per_step`` Python all_reduces a step (they travel as runs), the GPUs
    ``behind`` collectives behind their hosts at each read; the last seq issued."""
    seq = 0
    for _ in range(steps):
        for _ in range(per_step):
            seq += 1
            for rank in job.ranks:
                rank.python_all_reduce(seq, completes=False)
        time.sleep(0.15)
        for rank in job.ranks:
            rank.complete_through(seq - behind)
    return seq


def test_a_steady_loop_in_runs_on_the_gpu_blames_the_rank_that_never_enqueued(nccl_job: Any) -> None:
    """A steady loop travels as runs, its calls arriving before their GPU completed them: each
    run's calls are noted, no open call each. Rank 1 then stops issuing (busy elsewhere); ranks 0
    and 2 enqueue on, and their GPUs never complete the next one: it becomes an open call once
    reads find the GPU stopped there, and the hang is told as call by call."""
    coordinator, job = nccl_job(3)
    seq = _steady_steps(job, steps=8, per_step=12, behind=12)
    for rank in job.ranks:
        rank.complete_through(seq)
    for rk in (0, 2):
        for s in range(seq + 1, seq + 7):
            job.ranks[rk].python_all_reduce(s, completes=False)
        job.ranks[rk].where = ITEM
    job.ranks[1].where = "train.py:90 in save_checkpoint"
    wait_for(lambda: _incidents(coordinator), 20, 0.1, "an incident")
    time.sleep(0.5)
    (inc,) = _incidents(coordinator)
    assert inc["kind"] == "stuck_collective", inc["summary"]
    assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["seq"]) == ([1], [0, 2], seq + 1)
    assert "ranks 0, 2 enqueued it on the GPU, where it has not completed" in inc["summary"]
    status = coordinator.status()
    assert status["job"]["records_on_device"] > 0 and status["job"]["device_stops"] >= 2
    ranks = {rk["rank"]: rk for rk in status["ranks"]}
    assert ranks[0]["state"] == "waiting" and ranks[0]["host_returned"]


def test_a_steady_loop_in_runs_whose_gpus_lag_and_complete_raises_nothing(nccl_job: Any) -> None:
    """The look-alike: the same loop, its GPUs a step behind their hosts at every read, past the
    stuck threshold, then catching up."""
    coordinator, job = nccl_job(2)
    for rank in job.ranks:
        rank.where = ITEM
    seq = _steady_steps(job, steps=30, per_step=12, behind=12)
    for rank in job.ranks:
        rank.complete_through(seq)
    # the reads that complete them reach the coordinator a tick or two later (seconds when loaded)
    wait_for(lambda: all(not rk["host_returned"] for rk in coordinator.status()["ranks"]), 15, 0.1, "completions")
    assert _incidents(coordinator) == []
    assert coordinator.status()["job"]["records_on_device"] > 0
