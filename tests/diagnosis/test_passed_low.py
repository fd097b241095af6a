"""Where a group's members stand (``Runs._advance``): the lowest seq every member has passed, and
how many stand there, kept by counting members per seq, never by walking every member."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch.diagnosis.state import JobState

GROUP = "0"


def _held(job: JobState) -> tuple[int, int]:
    """The lowest seq the job state holds, and how many members it counts there."""
    low = job.passed_low[GROUP]
    return low, job.passed_counts[GROUP][2][low]


def _truth(job: JobState, members: tuple[int, ...]) -> tuple[int, int]:
    where = [job.passed_to[GROUP].get(m, 0) for m in members]
    return min(where), where.count(min(where))


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 12),
    moves=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 6)), min_size=1, max_size=120),
    regroup=st.integers(0, 120),
)
def test_the_lowest_member_is_known_after_every_advance(size: int, moves: list[tuple[int, int]], regroup: int) -> None:
    """Members move up by a few seqs at a time (some not at all, some twice; a rank outside the
    group too); at some point the group's members are learned anew (another tuple), and its
    tables may be let go of. After every move, the lowest and how many stand there are what a
    walk of every member gives."""
    job = JobState()
    members = tuple(range(size))
    at: dict[int, int] = {}
    for i, (rank, step) in enumerate(moves):
        if i == regroup:
            members = tuple(list(members))  # an equal tuple, not the same object
            if size % 3 == 0:
                job.passed_low.pop(GROUP, None)  # as a numbering made anew does
                job.passed_counts.pop(GROUP, None)
        at[rank] = at.get(rank, 0) + step
        job._advance(GROUP, rank, at[rank], members)
        if GROUP in job.passed_low:  # (once a member has moved)
            assert _held(job) == _truth(job, members)


def test_a_member_that_moves_last_moves_the_lowest() -> None:
    job = JobState()
    members = tuple(range(4))
    for rank in (0, 1, 2):
        job._advance(GROUP, rank, 5, members)
    assert job.passed_low.get(GROUP, 0) == 0  # rank 3 has passed nothing
    job._advance(GROUP, 3, 2, members)
    assert _held(job) == (2, 1)
    job._advance(GROUP, 3, 9, members)
    assert _held(job) == (5, 3)
    for rank in (0, 1):
        job._advance(GROUP, rank, 7, members)
    assert _held(job) == (5, 1)
    job._advance(GROUP, 2, 6, members)
    assert _held(job) == (6, 1)
