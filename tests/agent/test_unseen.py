"""A rank inside a collective whose Flight Recorder entry its ring overwrote before any read.

Found in CI: a metrics thread's all-reduces (100 a second) filled a rank's 256-entry CPU ring
while its main thread waited inside DDP's bucket all-reduce, which C++ issued and only the ring
shows; on a loaded machine reads were spaced ten seconds apart by their cost, the entry was
gone, and the rank was blamed for not arriving. Two mends, both driven here on the real tracker
and fetcher with the worker server's answers faked (the seam ``RingFetcher.read``, as in
``test_cpu_ring_spared``): the ring's counters (``pg_status``) outlive the entry, and say that
the group has an op under way no entry and no Python call explains (``EntryTracker.unseen``);
and a ring that turns over is read every half turnover, within ``TURNOVER_BUDGET`` of a core.
``tests/e2e/test_cpu_ring_spared`` proves both through real ranks.
"""

from __future__ import annotations

from typing import Any

from hangwatch.agent.flightrecorder import READ_BUDGET, TURNOVER_BUDGET, RingFetcher
from hangwatch.agent.frquery import cpu_status
from hangwatch.flight_entries import EntryTracker, PythonSeqs


class Ring:
    """A rank's CPU ring of ``size`` entries: a metrics thread's Python all-reduces on group
    "1", C++'s collectives on group "0", numbered as torch numbers them (``record_id`` one
    sequence for the ring, ``collective_seq_id`` one per group) with the ring's counters."""

    def __init__(self, size: int = 24) -> None:
        self.size = size
        self.entries: list[dict[str, Any]] = []
        self.ids = 0
        self.seqs: dict[str, int] = {}
        self.counters: dict[str, list[int]] = {}  # group -> [enqueued, completed]
        self.python = PythonSeqs()
        self.calls = 0
        self.tracker = EntryTracker(0)
        self.now = 1000.0

    def _add(self, group: str, done: bool) -> dict[str, Any]:
        seq = self.seqs[group] = self.seqs.get(group, 0) + 1
        counts = self.counters.setdefault(group, [0, 0])
        counts[0] += 1
        if done:
            counts[1] += 1
        entry = {
            "record_id": self.ids,
            "collective_seq_id": seq,
            "process_group": [group, ""],
            "profiling_name": "gloo:all_reduce",
            "input_sizes": [[4]],
            "input_dtypes": ["Float"],
            "is_p2p": False,
            "retired": done,
            "state": "scheduled",
        }
        self.ids += 1
        self.entries = [*self.entries, entry][-self.size :]
        return entry

    def metrics(self, n: int, group: str = "1") -> None:
        """``n`` Python all-reduces of the metrics thread, each begun and finished."""
        for _ in range(n):
            entry = self._add(group, True)
            self.calls += 1
            self.python.entered(self.calls, group, entry["collective_seq_id"], False)
            self.python.exited(self.calls, 1)

    def cxx(self, group: str = "0", done: bool = False) -> None:
        """A collective C++ issued (DDP's bucket all-reduce): under way until ``finish``."""
        self._add(group, done)

    def finish(self, group: str = "0") -> None:
        counts = self.counters[group]
        counts[1] = counts[0]
        for entry in self.entries:
            if entry["process_group"][0] == group:
                entry["retired"] = True

    def rings(self) -> dict[str, Any]:
        status = {
            g: {"last_enqueued_collective": str(e), "last_completed_collective": str(c)}
            for g, (e, c) in self.counters.items()
        }
        return {"cpu": {"pg_status": status, "entries": [dict(e) for e in self.entries]}}

    def read(self) -> list[Any]:
        """One read of the ring, handled as the shipper handles it."""
        rings = self.rings()
        self.now += 1.0
        return self.tracker.update(
            rings["cpu"]["entries"], self.python, 0, self.now, cpu_status(rings), self.python.busy_on
        )


def test_an_op_under_way_whose_entry_was_overwritten_unread_is_unseen() -> None:
    ring = Ring()
    ring.metrics(10)
    ring.cxx("0", done=True)  # DDP's constructor's broadcast, read
    assert [e.seq for e in ring.read()] == [1]
    ring.cxx("0")  # the bucket all-reduce the main thread waits in
    ring.metrics(100)  # pushed out of the 24-entry ring before the next read
    assert ring.read() == []  # nothing to make a record of
    assert set(ring.tracker.unseen) == {"0"}
    assert ring.tracker.lost == 101 - 24  # the C++ entry and 100 calls, 24 of them held
    ring.metrics(100)
    ring.read()
    assert set(ring.tracker.unseen) == {"0"}  # kept while the group's completed count stands still
    ring.finish("0")
    ring.metrics(5)
    ring.read()
    assert ring.tracker.unseen == {}  # it completed: the rank is not inside it any more


def test_a_ring_read_before_it_turned_over_tells_the_entry_itself_not_an_unseen_op() -> None:
    ring = Ring()
    ring.metrics(10)
    ring.read()
    ring.cxx("0")
    ring.metrics(5)  # the entry is still there at the next read
    made = ring.read()
    assert [(e.group, e.seq) for e in made] == [("0", 1)]
    assert ring.tracker.unseen == {} and ring.tracker.lost == 0


def test_a_record_whose_entry_was_overwritten_before_it_retired_is_closed_by_the_counters() -> None:
    """Found with a busy ring: DDP's constructor's all-gather was read under way, its entry was
    overwritten before a read showed it retired, and no later collective of its group was read:
    the rank stayed "in" it for good, told waiting. The counters say when the group is idle."""
    ring = Ring()
    ring.metrics(10)
    ring.read()
    ring.cxx("0")  # under way at the next read: an open record
    (made,) = ring.read()
    assert made.exit_time is None
    ring.finish("0")
    ring.metrics(100)  # retired, then overwritten unread
    (done,) = ring.read()
    assert (done.call_id, done.exit_time) == (made.call_id, ring.now)
    assert ring.tracker.unseen == {}


def test_a_ring_that_turned_over_with_nothing_under_way_has_nothing_unseen() -> None:
    """The look-alike: the same overwritten ring while the main thread is elsewhere (a
    checkpoint save): every counter says done, and the rank stays absent from group 0's calls."""
    ring = Ring()
    ring.metrics(10)
    ring.cxx("0", done=True)
    ring.read()
    ring.cxx("0", done=True)  # a collective that completed, then was overwritten unread
    ring.metrics(100)
    ring.read()
    assert ring.tracker.unseen == {} and ring.tracker.lost > 0


def test_an_op_under_way_a_python_call_may_explain_is_not_unseen() -> None:
    ring = Ring()
    ring.metrics(10)
    ring.read()
    # an async all-reduce of the rank's own on group "2", still open, its entry overwritten
    ring.cxx("2")
    ring.calls += 1
    ring.python.entered(ring.calls, "2", ring.seqs["2"], True)
    ring.metrics(100)
    ring.read()
    assert ring.tracker.unseen == {}


def test_a_group_python_sends_and_receives_on_can_be_unseen() -> None:
    """A pipeline stage's sends and receives on group 0 beside DDP's buckets there: gloo's p2p
    ops leave the counters as they were while under way (an isend or irecv waiting on its peer,
    a batch of them: torch 2.13, measured), so they explain no op under way, and the bucket
    all-reduce whose entry the metrics thread overwrote is found as before."""
    ring = Ring()
    ring.metrics(10)
    ring.read()
    ring.counters["0"] = [5, 5]  # the pipeline's p2p ops moved group 0's sequence past seq 5
    ring.cxx("0")
    ring.metrics(100)
    ring.read()
    assert set(ring.tracker.unseen) == {"0"}


def test_counters_of_a_group_the_nccl_ring_shows_are_left_out() -> None:
    rings = {"cpu": {"pg_status": {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"}}}}
    assert cpu_status(rings) == {"0": (5, 4)}
    assert cpu_status(rings, {"0"}) == {}
    assert cpu_status({"cpu": {"pg_status": {"0": {"last_enqueued_collective": "x"}}}}) == {}  # garbage: nothing


class Server:
    """The worker server's answers to the fetcher: the ring of ``Ring``, ``gain`` entries a
    second, each read taking ``cost`` seconds of the driven clock."""

    def __init__(self, ring: Ring, gain: int, cost: float) -> None:
        self.ring, self.gain, self.cost = ring, gain, cost
        self.reads: list[float] = []

    def clock(self) -> float:
        return self.ring.now

    def __call__(self, path: str, pid: int, *, names: Any = ("cpu",), **_: Any) -> Any:
        self.reads.append(self.ring.now)
        self.ring.now += self.cost
        return (self.ring.rings() if "cpu" in names else {}), {}

    def run(self, seconds: int) -> RingFetcher:
        fetcher = RingFetcher(interval_s=1.0, read=self, clock=self.clock, background=False)
        fetcher.watch(1, "/run/w.sock", 4242)
        for _ in range(seconds):
            self.ring.metrics(self.gain)
            self.ring.now += 1.0
            fetcher.poll_once(due_only=True)
        fetcher.stop()
        return fetcher


def _gaps(reads: list[float], after: int) -> list[float]:
    """Seconds between successive reads, from the ``after``-th on (the first ones learn the pace)."""
    return [b - a for a, b in zip(reads[after:], reads[after + 1 :], strict=False)]


def test_a_ring_that_turns_over_faster_than_its_budget_spaces_reads_is_read_every_half_turnover() -> None:
    """A read whose round trip takes 50 ms (a loaded machine): the budget alone reads it every
    5 s. Its 256 entries turn over in 2.56 s at 100 a second: it is read at least every 1.3 s."""
    cost = 0.05
    assert cost / READ_BUDGET == 5.0 and cost / TURNOVER_BUDGET <= 1.28
    server = Server(Ring(size=256), gain=100, cost=cost)
    server.run(30)
    gaps = _gaps(server.reads, 5)
    assert gaps and max(gaps) <= 256 / 100 / 2 + 1.0, gaps  # half the turnover, on the next tick


def test_a_quiet_ring_keeps_the_budget_s_pace() -> None:
    """The look-alike: the same costly reads of a ring that gains 5 entries a second (it would
    take 51 s to turn over): read as the budget says, every 5 s."""
    server = Server(Ring(size=256), gain=5, cost=0.05)
    server.run(30)
    gaps = _gaps(server.reads, 3)
    assert gaps and min(gaps) >= 4.0, gaps


def test_a_ring_turning_over_faster_than_the_turnover_budget_allows_is_read_at_that_budget_s_pace() -> None:
    """10,000 entries a second turn a 256-entry ring over in 26 ms: following it would take the
    rank's CPU whole. Reads that cost 150 ms are read every 3 s (150 ms at 5 %), not every tick
    and not every 15 s (the budget alone)."""
    server = Server(Ring(size=256), gain=10_000, cost=0.15)
    server.run(40)
    gaps = _gaps(server.reads, 3)
    assert gaps and all(2.5 <= gap <= 4.5 for gap in gaps), gaps


def test_a_record_whose_entry_was_overwritten_is_closed_once_its_group_completed_past_it() -> None:
    """Found under load: DDP's constructor's all-gather was read under way, then overwritten
    unread, and the rank went on into a bucket all-reduce of the same group, where it waits: the
    group never idle again, the all-gather stayed "waiting" for good, and the detector, which
    looks at each group's oldest open collective, told it and never the real hang. The group's
    completed count reaching what it had enqueued when the record was made closes it."""
    ring = Ring()
    ring.metrics(10)
    ring.read()
    ring.cxx("0")  # the constructor's all-gather, read under way
    (made,) = ring.read()
    assert made.exit_time is None
    ring.finish("0")
    ring.cxx("0")  # the bucket all-reduce the rank now waits in
    ring.metrics(100)  # both entries overwritten unread
    (done,) = ring.read()
    assert (done.call_id, done.exit_time) == (made.call_id, ring.now)
    assert set(ring.tracker.unseen) == {"0"}  # and the rank is inside the all-reduce
