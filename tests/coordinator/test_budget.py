"""Memory budgets in bytes (issue 15): what the coordinator holds is charged, the charges match
what is held, the estimates are not below what Python allocates, and floods stop at the budget.

The RPC-level property test (no input sequence through the public RPCs takes the coordinator
over its configured budget, measured with ``tracemalloc``) is in ``test_budget_rpc.py``.
"""

from __future__ import annotations

import gc
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatch import records as r
from hangwatch.coordinator import budget as b
from hangwatch.coordinator.budget import Budget, Ledger
from hangwatch.coordinator.jobs import Jobs
from hangwatch.coordinator.state import HISTORY_PER_GROUP, JobState, RankState
from tests.factories import T0, call, call_exit, group_event, identity

KB = 1024


# ---- the audit: every charge recomputed from what is held --------------------------------------


def _rank_expected(job: JobState, st: RankState) -> int:
    n = b.RANK_BYTES
    n += sum(b.RANK_GROUP_BYTES + sum(c.cost for c in hist) for hist in st.history.values())
    n += sum(c.cost + b.OPEN_BYTES for c in st.open_calls.values())
    n += sum(b.marker_bytes(m) for m in st.markers)
    n += sum(b.PROGRESS_BYTES + b.text_bytes(g) for g in st.progress)
    n += sum(b.group_bytes(info) for name, info in st.groups.items() if info is not job.groups.get(name))
    return n


def audit(job: JobState) -> None:
    """What ``job`` is charged equals what it holds, counted from scratch."""
    for rs in job.ranks.values():
        assert rs.held == _rank_expected(job, rs), f"rank {rs.rank}"
    slots = sum(
        b.SLOT_BYTES + sum(c.cost + b.SLOT_ENTRY_BYTES for c in slot.calls.values())
        for per_group in job.slots.values()
        for slot in per_group.values()
    )
    groups = sum(b.group_bytes(info) + b.JOB_GROUP_BYTES for info in job.groups.values())
    assert job.held == sum(st.held for st in job.ranks.values()) + slots + groups


# ---- a random job, step by step -----------------------------------------------------------------

GROUPS = ["0", "1", "2", "g" * 300]
actions = st.lists(
    st.one_of(
        st.tuples(st.just("enter"), st.integers(0, 2), st.sampled_from(GROUPS), st.integers(1, 40), st.booleans()),
        st.tuples(st.just("exit"), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("group"), st.integers(0, 2), st.sampled_from(GROUPS[1:]), st.booleans()),
        st.tuples(st.just("marker"), st.integers(0, 2), st.integers(0, 3000)),
        st.tuples(st.just("progress"), st.integers(0, 2), st.sampled_from(GROUPS), st.integers(0, 40)),
        st.tuples(
            st.just("lapse"),
        ),
        st.tuples(st.just("reregister"), st.integers(0, 2)),
        st.tuples(
            st.just("newrun"),
        ),
        st.tuples(st.just("p2p"), st.integers(0, 2), st.integers(0, 2)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=actions, rank_kb=st.sampled_from([24, 64, 100_000]), site=st.integers(0, 1024))
def test_charges_match_what_is_held(steps: list[tuple[object, ...]], rank_kb: int, site: int) -> None:
    ledger = Ledger(Budget(rank_kb * KB, 400 * KB, 1 << 40))
    jobs = Jobs(ledger)
    sessions = {rk: 0 for rk in range(3)}
    attempt = 0
    t = T0
    opened: list[r.CallRecord] = []

    def register(rk: int) -> None:
        sessions[rk] += 1
        jobs.register(identity(rk, 3, session=f"s{rk}-{sessions[rk]}-{attempt}", attempt=attempt), t, "agent")

    for rk in range(3):
        register(rk)
    for step in steps:
        t += 1.0
        (job,) = list(jobs)
        kind = step[0]
        if kind == "enter":
            _, rk, group, seq, done = step
            assert isinstance(rk, int) and isinstance(group, str) and isinstance(seq, int)
            c = call(rk, seq, group=group, enter_time=t, call_site="x" * site, exit_time=t + 0.5 if done else None)
            job.apply(job.ranks[rk], c, t)
            if not done:
                opened.append(c)
        elif kind == "exit" and opened:
            _, rk, failed = step
            c = opened.pop(0)
            if c.rank in job.ranks:
                job.apply(job.ranks[c.rank], call_exit(c.rank, c.call_id, t, "boom " * 50 if failed else None), t)
        elif kind == "group":
            _, rk, name, created = step
            assert isinstance(rk, int) and isinstance(name, str)
            how = r.GroupEventKind.CREATED if created else r.GroupEventKind.DESTROYED
            job.apply(job.ranks[rk], group_event(rk, name, (0, 1, 2) if rk else (0, 1), t, how), t)
        elif kind == "marker":
            _, rk, size = step
            assert isinstance(rk, int) and isinstance(size, int)
            job.apply(job.ranks[rk], r.MarkerEvent(rk, "trigger", t, detail="d" * size), t)
        elif kind == "progress":
            _, rk, group, seq = step
            assert isinstance(rk, int) and isinstance(group, str) and isinstance(seq, int)
            job.apply(job.ranks[rk], r.GroupProgress(rk, group, seq, -1, max(0, seq - 1), t), t)
        elif kind == "lapse":
            job.lapse_progress(t + 100)
        elif kind == "reregister":
            _, rk = step
            assert isinstance(rk, int)
            job.ranks[rk].end = r.RankEnd(rk, r.EndKind.EXCEPTION, t)  # its process is gone
            register(rk)
        elif kind == "newrun":
            attempt += 1
            register(0)
            for rk in (1, 2):
                register(rk)
            opened.clear()
        elif kind == "p2p":
            _, rk, peer = step
            assert isinstance(rk, int) and isinstance(peer, int)
            job.apply(job.ranks[rk], call(rk, 1, "send", peer=peer, enter_time=t), t)
        audit(job)
        assert ledger.held == job.held
        for st_ in job.ranks.values():
            assert st_.held + st_.slotted <= ledger.budget.rank or not st_.history, "over the rank budget"
        assert job.held <= ledger.budget.job + b.RANK_BYTES * 3


def test_a_job_retired_gives_back_all_it_held() -> None:
    ledger = Ledger()
    jobs = Jobs(ledger)
    job, st = jobs.register(identity(0, 1, session="a"), T0)
    for seq in range(1, 200):
        job.apply(st, call(0, seq, enter_time=T0 + seq, exit_time=T0 + seq + 0.1), T0 + seq)
    assert ledger.held == job.held > 0
    job.apply(st, r.RankEnd(0, r.EndKind.CLEAN_EXIT, T0 + 300), T0 + 300)
    st.proc = r.ProcessStatus(pid=st.identity.pid, state=r.ProcState.DEAD, time=T0 + 300)
    jobs.register(identity(0, 1, session="b", job_id="other"), T0 + 400)  # a new process: the old job retires
    assert len(jobs) == 1
    assert ledger.held == next(iter(jobs)).held


# ---- the estimates are upper bounds ---------------------------------------------------------------


def _traced(build: object) -> tuple[int, JobState]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        job = build()  # type: ignore[operator]
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return after - before, job


def _job_of(
    calls_per_rank: int, *, site: int, groups: int, ranks: int, done: bool, tensors: int, hostile: bool = False
) -> JobState:
    job = JobState(Ledger())
    states = [job.register(identity(rk, ranks, session=f"s{rk}"), T0) for rk in range(ranks)]
    for g in range(1, groups + 1):
        for rs in states:
            job.apply(rs, group_event(rs.rank, f"grp{g}", tuple(range(ranks)), T0), T0)
    inputs = tuple(r.TensorMeta((i + 1, 3, 224), "float32") for i in range(tensors))
    for i in range(calls_per_rank):
        if hostile:  # nothing shared: tensors of 24 large dims, wide characters, many extras
            inputs = tuple(r.TensorMeta(tuple(2**40 + i + d for d in range(24)), f"dt{i}") for _ in range(tensors))
        group = f"grp{i % groups + 1}" if groups else "0"
        t = T0 + i
        for rs in states:
            c = call(
                rs.rank,
                i // max(1, groups) + 1,
                group=group,
                enter_time=t,
                inputs=inputs,
                exit_time=t + 0.1 if done else None,
                call_site=(("site " if not hostile else "sïtè€ ") * site)[:site] + str(i),  # its own string
                extra={f"k{k}{i}": f"v{k}{i}" for k in range(10 if hostile else 1)} if i % 3 == 0 or hostile else {},
            )
            job.apply(rs, c, t)
    return job


def test_estimates_are_not_below_what_python_allocates() -> None:
    for shape in (
        dict(site=0, groups=0, ranks=4, done=True, tensors=1),  # a healthy job's steady state
        dict(site=1000, groups=0, ranks=2, done=False, tensors=0),  # open calls, long call sites
        dict(site=40, groups=300, ranks=2, done=False, tensors=3),  # many groups, slots never complete
        dict(site=1024, groups=50, ranks=1, done=True, tensors=8),
        dict(site=1024, groups=3, ranks=2, done=False, tensors=4, hostile=True),
    ):
        traced, job = _traced(lambda shape=shape: _job_of(400, **shape))  # type: ignore[misc, arg-type]
        assert traced <= job.held, f"{shape}: allocated {traced} bytes, charged only {job.held}"
        assert job.held <= 6 * traced, f"{shape}: charged {job.held} bytes for {traced} allocated (too coarse)"


# ---- floods stop at the budget ----------------------------------------------------------------------


def test_one_rank_opening_thousands_of_groups_stops_at_its_budget_and_the_others_go_on() -> None:
    """The issue's flood: one rank announcing 16,384 groups and calling on each. It is refused
    at its own budget, the refusals are counted, and the other rank's world-group collectives
    are still held (the flooding rank's own open calls fill its budget: its later calls are
    refused too)."""
    ledger = Ledger(Budget(2 * 1024 * KB, 64 * 1024 * KB, 1 << 40))
    job = JobState(ledger)
    hostile, other = job.register(identity(0, 2, session="h"), T0), job.register(identity(1, 2, session="o"), T0)
    for g in range(16_384):
        name = f"flood{g}"
        job.apply(hostile, group_event(0, name, (0, 1), T0), T0)
        job.apply(hostile, call(0, 1, group=name, enter_time=T0, call_site="s" * 1024), T0)
    assert hostile.held + hostile.slotted <= ledger.budget.rank
    assert job.refused > 10_000 and ledger.refused_by["rank"] == job.refused
    for seq in range(1, 50):
        for rs in (hostile, other):
            job.apply(rs, call(rs.rank, seq, enter_time=T0 + seq, exit_time=T0 + seq + 0.1), T0 + seq)
    assert [c.seq for c in other.history["0"]][-1] == 49  # the other rank's calls are all held
    assert hostile.held + hostile.slotted <= ledger.budget.rank  # still within its budget after them
    audit(job)


def test_history_trimmed_before_a_call_is_refused() -> None:
    ledger = Ledger(Budget(256 * KB, 1 << 40, 1 << 40))
    job = JobState(ledger)
    st = job.register(identity(0, 1, session="a"), T0)
    for seq in range(1, 500):
        group = f"g{seq % 20}"
        job.apply(st, call(0, seq, group=group, enter_time=T0 + seq, exit_time=T0 + seq + 0.1), T0 + seq)
    assert st.held + st.slotted <= 256 * KB
    assert ledger.trimmed > 100
    assert job.refused == 0  # trimming made room every time: nothing refused
    assert len(st.history) == 20 and max(len(h) for h in st.history.values()) < HISTORY_PER_GROUP
    audit(job)


def test_coordinator_total_budget_refuses_a_new_rank() -> None:
    ledger = Ledger(Budget(1 << 40, 1 << 40, 3 * b.RANK_BYTES))
    jobs = Jobs(ledger)
    for rk in range(3):
        jobs.register(identity(rk, 8, session=f"s{rk}"), T0)
    try:
        jobs.register(identity(3, 8, session="s3"), T0)
    except ValueError as e:
        assert "memory budget" in str(e)
    else:
        raise AssertionError("a rank past the coordinator's budget was registered")
    assert ledger.refused_by["total"] == 1
