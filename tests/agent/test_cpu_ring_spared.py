"""The CPU Flight Recorder ring is left unread while the rank's Python calls account for all of it.

torch 2.13's worker server serialises the CPU ring whole for every read, however little of it is
new (5.6 ms of the rank's CPU for a full 256-entry ring, BENCHMARKS.md): at one read a second
that is 0.56 % of a core, more than all the hook's per-call work at 1,000 calls/s. The fetcher
asks :class:`PythonAccounts` before each read; these tests drive it with the real tracker and
coverage the shipper keeps, on a driven clock. The seam faked is the fetcher's ``read`` (what the
worker server answers), as in ``test_shipper_flight_recorder``; ``tests/e2e/test_cpu_ring_spared``
proves the same through real ranks and a real worker server.
"""

from __future__ import annotations

from typing import Any

from hangwatch.agent.flightrecorder import WHOLE_READ_EVERY_S, RingFetcher
from hangwatch.flight_entries import CLEAN_READS, EntryTracker, PythonAccounts, PythonSeqs


def _entry(seq: int, group: str = "0") -> dict[str, Any]:
    return {
        "collective_seq_id": seq,
        "process_group": [group, "default_pg"],
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_sizes": [[4]],
        "is_p2p": False,
        "retired": True,
        "state": "scheduled",
    }


class Rank:
    """A rank as the agent sees it: its Python calls (into ``python``, as the shipper reads them
    from its ring), the entries its CPU ring holds (the last 256), and the reads the worker
    server answered; ``nccl`` says whether the build has a NCCL ring (else: 404, no error)."""

    def __init__(self, nccl: bool = False) -> None:
        self.python = PythonSeqs()
        self.tracker = EntryTracker(0)
        self.entries: list[dict[str, Any]] = []
        self.seq: dict[str, int] = {}
        self.ids = 0
        self.reads = 0
        self.asked: list[tuple[str, ...]] = []
        self.nccl = nccl
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def __call__(self, path: str, pid: int, *, names: Any = ("cpu", "nccl"), **_: Any) -> Any:
        self.asked.append(tuple(names))
        rings: dict[str, Any] = {}
        if "cpu" in names:
            self.reads += 1
            rings["cpu"] = {"pg_status": {}, "entries": list(self.entries[-256:])}
        if "nccl" in names and self.nccl:
            rings["nccl"] = {"pg_status": {}, "entries": []}
        return rings, {}

    def collective(self, group: str = "0", *, python: bool = True, done: bool = True, async_op: bool = False) -> int:
        seq = self.seq[group] = self.seq.get(group, 0) + 1
        self.entries.append(_entry(seq, group))
        if python:
            self.ids += 1
            self.python.entered(self.ids, group, seq, async_op)
            if done:
                self.python.exited(self.ids, 1)
        return seq

    def run(self, n: int, group: str = "0") -> None:
        """``n`` Python calls one after another, as a run (``records.CallRun``) reports them."""
        lo = self.seq.get(group, 0) + 1
        for _ in range(n):
            self.collective(group, python=False)
        self.python.ran(group, lo, lo + n - 1)

    def fetcher(self) -> RingFetcher:
        fetcher = RingFetcher(interval_s=1.0, read=self, clock=self.clock, background=False)
        fetcher.watch(1, "/run/w.sock", 4242, accounted=PythonAccounts(self.tracker, self.python))
        return fetcher

    def poll(self, fetcher: RingFetcher, seconds: float = 1.0) -> list[Any]:
        """One poll, ``seconds`` after the last, and the shipper's handling of what it read."""
        self.now += seconds
        fetcher.poll_once(due_only=True)
        fetched = fetcher.take(1)
        return [] if fetched is None else self.tracker.update(fetched.entries, self.python, 0, self.now)


#: Python calls a poll: more than the ring holds (256), so it turns over between two polls
FAST = 300


def _steady(rank: Rank, fetcher: RingFetcher, calls: int = FAST) -> None:
    """Python calls only, read until the reads are spared."""
    for _ in range(CLEAN_READS + 1):
        rank.run(calls)
        assert rank.poll(fetcher) == []
    assert rank.tracker.clean >= CLEAN_READS and fetcher.spared_cpu == 1


def test_a_ring_that_holds_only_python_calls_is_left_unread_while_they_account_for_all() -> None:
    rank = Rank()
    fetcher = rank.fetcher()
    _steady(rank, fetcher)
    reads = rank.reads
    for _ in range(5):
        rank.run(FAST)
        rank.poll(fetcher)
    assert (rank.reads, fetcher.spared_cpu) == (reads, 6)  # nothing asked of the rank at all
    assert fetcher.reads == reads  # no round trip either
    assert fetcher.vouched(1) == rank.now  # as good as a read that found nothing new (the header says so)
    # whatever it says, the ring is read whole every WHOLE_READ_EVERY_S
    for _ in range(int(WHOLE_READ_EVERY_S)):
        rank.run(FAST)
        rank.poll(fetcher)
    assert rank.reads == reads + 1
    fetcher.stop()


def test_a_ring_that_would_keep_every_entry_between_polls_is_read_before_it_turns_over() -> None:
    """At 50 calls a poll a 256-entry ring read every poll loses nothing: it is read whenever
    it has gained half its size (every third poll), so that a collective C++ issued on a group
    no Python call shows is read before it is overwritten."""
    rank = Rank()
    fetcher = rank.fetcher()
    for _ in range(CLEAN_READS):
        rank.run(50)
        rank.poll(fetcher)
    reads = rank.reads
    for _ in range(9):
        rank.run(50)
        rank.poll(fetcher)
    assert (rank.reads, fetcher.spared_cpu) == (reads + 3, 6)
    rank.collective("7", python=False)  # issued from C++ on a group Python never calls
    made: list[Any] = []
    for _ in range(3):
        rank.run(50)
        made += rank.poll(fetcher)
    assert [(e.group, e.seq) for e in made] == [("7", 1)]
    fetcher.stop()


def test_a_collective_cxx_issued_between_python_calls_is_read_at_the_next_poll() -> None:
    """DDP's buckets, FSDP's gathers: a seq no Python call issued, seen as a gap when the next
    Python call on the group comes."""
    rank = Rank()
    fetcher = rank.fetcher()
    _steady(rank, fetcher)
    rank.run(FAST // 2)
    cxx = rank.collective(python=False)  # issued from C++
    rank.run(FAST // 2)
    reads = rank.reads
    made = rank.poll(fetcher)
    assert rank.reads == reads + 1
    assert [e.seq for e in made] == [cxx]
    assert rank.tracker.clean == 0  # and reads go on every poll until it is clean again
    rank.run(FAST)
    rank.poll(fetcher)
    assert rank.reads == reads + 2
    fetcher.stop()


def test_a_rank_whose_python_calls_stop_is_read_every_poll() -> None:
    """Inside one collective (a hang, or C++'s collectives while Python waits in backward) or in
    none (a checkpoint): no Python call finished since the last poll, so its ring may hold
    what Python does not know."""
    rank = Rank()
    fetcher = rank.fetcher()
    _steady(rank, fetcher)
    rank.collective(done=False)  # entered, never returns
    reads = rank.reads
    rank.poll(fetcher)
    assert rank.reads == reads + 1
    rank.poll(fetcher)
    assert rank.reads == reads + 2
    fetcher.stop()


def test_an_async_call_under_way_is_read() -> None:
    rank = Rank()
    fetcher = rank.fetcher()
    _steady(rank, fetcher)
    rank.run(FAST)
    rank.collective(done=False, async_op=True)
    reads = rank.reads
    rank.poll(fetcher)
    assert rank.reads == reads + 1
    fetcher.stop()


def test_a_collective_cxx_issued_on_a_group_python_never_calls_is_read_within_the_whole_read_period() -> None:
    """What the rank's Python calls cannot show: C++ at work on a group they never call, while
    they go on elsewhere faster than the ring holds. The ring is read whole every
    ``WHOLE_READ_EVERY_S`` whatever ``accounted`` says; the C++ collectives still in it then are
    read, and from that read on it is read every poll (the read was not clean). Those it had
    overwritten before are lost, as they would be at a read a poll: the ring turns over between
    two polls at this rate."""
    rank = Rank()
    fetcher = rank.fetcher()
    _steady(rank, fetcher)
    made: list[Any] = []
    seconds = 0
    while not made:
        rank.run(FAST)
        rank.collective("7", python=False)  # C++ at work on group 7, once a poll
        made = rank.poll(fetcher)
        seconds += 1
        assert seconds <= WHOLE_READ_EVERY_S
    assert [(e.group, e.seq) for e in made] == [("7", seconds)]  # the newest; the others were overwritten
    reads = rank.reads
    rank.run(FAST)
    rank.poll(fetcher)
    assert rank.reads == reads + 1
    fetcher.stop()


def test_an_answer_that_raises_is_a_read() -> None:
    rank = Rank()
    fetcher = RingFetcher(interval_s=1.0, read=rank, clock=rank.clock, background=False)

    def broken() -> bool:
        raise RuntimeError("a snapshot taken mid-update")

    fetcher.watch(1, "/run/w.sock", 4242, accounted=broken)
    for _ in range(3):
        rank.run(10)
        rank.poll(fetcher)
    assert (rank.reads, fetcher.spared_cpu) == (3, 0)
    fetcher.stop()


def test_a_ring_the_build_has_not_is_asked_for_once() -> None:
    """A CPU build's worker server answers 404 for the NCCL ring: asked once, not every read."""
    rank = Rank(nccl=False)
    fetcher = RingFetcher(interval_s=1.0, read=rank, clock=rank.clock, background=False)
    fetcher.watch(1, "/run/w.sock", 4242)
    for _ in range(3):
        rank.poll(fetcher)
    assert rank.asked == [("cpu", "nccl"), ("cpu",), ("cpu",)]
    cuda = Rank(nccl=True)
    fetcher = RingFetcher(interval_s=1.0, read=cuda, clock=cuda.clock, background=False)
    fetcher.watch(1, "/run/w.sock", 4242)
    for _ in range(2):
        cuda.poll(fetcher)
    assert cuda.asked == [("cpu", "nccl"), ("cpu", "nccl")]


# ---- found by an attacking review: a side thread's calls, object collectives -------------------


def test_a_main_thread_waiting_in_a_cxx_collective_is_read_while_a_side_thread_calls_python() -> None:
    """The main thread waits inside DDP's bucket all-reduce (group 0, issued from C++, never
    retired) while a metrics thread's Python calls go on on group 1. Python making progress on
    group 1 says nothing of group 0, which the ring showed before: it is read at the next poll
    (sparing it let the coordinator take the waiting rank for absent, and blame it)."""
    rank = Rank()
    fetcher = rank.fetcher()
    rank.collective("0", python=False)  # DDP's constructor's broadcast: group 0 is known
    _steady(rank, fetcher)  # on group 0 too: spared once both groups moved
    for _ in range(FAST):
        rank.collective("1")  # the side thread goes on, as fast as the ring turns over
    seq = rank.seq["0"] = rank.seq["0"] + 1  # the hang: C++'s all_reduce on group 0, in flight
    rank.entries.append({**_entry(seq, "0"), "retired": False, "state": "started"})
    made = rank.poll(fetcher)
    assert [(m.group, m.seq, m.exit_time) for m in made] == [("0", seq, None)]


def test_a_group_the_rank_created_and_python_does_not_call_keeps_the_ring_read() -> None:
    """A group made (``new_group``, DeviceMesh, FSDP) and handed to C++: no Python progress on it."""
    rank = Rank()
    fetcher = rank.fetcher()
    _steady(rank, fetcher)
    rank.python.told("5", created=True)
    reads = rank.reads
    for _ in range(3):
        rank.run(FAST)
        rank.poll(fetcher)
    assert rank.reads == reads + 3
    rank.python.told("5", created=False)  # destroyed: no collective can come from it
    rank.run(FAST)
    rank.poll(fetcher)
    rank.run(FAST)
    rank.poll(fetcher)
    assert rank.reads == reads + 3


def _object_call(rank: Rank, group: str = "0") -> None:
    """all_gather_object: one Python call, two collectives in the ring (sizes, then data)."""
    lo = rank.seq.get(group, 0) + 1
    for _ in range(2):
        rank.seq[group] = rank.seq.get(group, 0) + 1
        rank.entries.append(_entry(rank.seq[group], group))
    rank.ids += 1
    rank.python.entered(rank.ids, group, lo)
    rank.python.exited(rank.ids, 2)


def test_the_ring_is_read_before_it_turns_over_counting_entries_not_calls() -> None:
    """100 object collectives a poll are 200 entries a poll: a 256-entry ring read every poll
    loses nothing, so it must be read at every poll (counting 100 calls, it was read every
    other one, and a collective C++ issued right after a read was overwritten unread)."""
    rank = Rank()
    fetcher = rank.fetcher()
    for _ in range(CLEAN_READS + 2):
        for _ in range(100):
            _object_call(rank)
        rank.poll(fetcher)
    rank.collective("7", python=False)  # right after a read, on a group Python never calls
    made: list[Any] = []
    for _ in range(3):
        for _ in range(100):
            _object_call(rank)
        made += rank.poll(fetcher)
    assert [(m.group, m.seq) for m in made] == [("7", 1)]
