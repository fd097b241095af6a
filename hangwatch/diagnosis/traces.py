"""The ranks' traces as the job state holds them, for the model (``hangwatch.model.align``).

Read only: a run of alike calls is made into calls for the reader, and the history keeps it as
the run. Two ranks' traces start at one place of the program: the first call on the group where
they part that both still hold, and from which every group's history of each rank is whole (each
keeps its last ``HISTORY_PER_GROUP`` calls: a busy group's reach back is the shortest).
"""

from __future__ import annotations

from collections.abc import Sequence

from hangwatch import config
from hangwatch import records as r
from hangwatch.diagnosis.state import HISTORY_PER_GROUP, JobState, RankState
from hangwatch.model.align import Edit, Mark, align, in_order, trace

#: How long a finding waits for the Flight Recorder reads that make a rank's trace known through
#: the moment it is about, before it is told on what is known: read every second, a rank is
#: read at least every ``FR_MAX_READ_EVERY_S`` on a loaded node, and its batch takes up to 3 s
#: more (sent every 2 s, held by a relay up to 1). Shorter, a loaded node's late read came after
#: the story was told without it (a skipped backward told as leaving the loop).
TRACE_WAIT_S = config.FR_MAX_READ_EVERY_S + 5.0


def _calls(st: RankState) -> tuple[list[r.CallRecord], float, bool]:
    """Every call the rank's histories hold up to where its trace is known, and from when all of
    them are whole. A record made from a Flight Recorder entry of a collective the hook also
    recorded (a read as the rank failed ships entries whose Python call it had not matched yet)
    is that call: left out."""
    calls: list[r.CallRecord] = []
    whole_from = 0.0
    for hist in st.history.values():
        if not hist:
            continue
        if len(hist) >= HISTORY_PER_GROUP:  # full: it let calls older than its first go
            whole_from = max(whole_from, hist.first_enter())
        made = list(hist.view())
        python = {c.seq for c in made if c.source == "python" and c.kind is r.OpKind.COLLECTIVE}
        calls.extend(c for c in made if c.source == "python" or c.seq not in python)
    known = _known_to(st, calls)
    kept = [c for c in calls if c.enter_time <= known]
    return kept, whole_from, len(kept) < len(calls)


def _known_to(st: RankState, calls: list[r.CallRecord]) -> float:
    """Up to when the rank's trace is known. A live rank whose collectives C++ also issues is
    known only to its latest Flight Recorder read (a Python call after it may follow C++ calls
    not read yet: a trace cut there would look like a call skipped); a rank that ended or died
    was read to its end."""
    if st.end is not None or not st.alive or all(c.source == "python" for c in calls):
        return float("inf")
    return st.flight_to if st.flight_to > 0 else st.last_sent - config.FR_POLL_INTERVAL_S


def unknown_at(job: JobState, ranks: Sequence[int], t: float) -> list[int]:
    """Those of ``ranks`` whose trace is not known through ``t`` yet: live ranks whose C++
    collectives come from Flight Recorder reads, the latest before ``t``."""
    out = []
    for rank in ranks:
        st = job.ranks.get(rank)
        if st is not None and _known_to(st, [c for h in st.history.values() for c in h.view()]) < t:
            out.append(rank)
    return out


def traces(job: JobState, group: str, ranks: Sequence[int]) -> dict[int, list[Mark]] | None:
    """The traces of ``ranks``, each from its call at the earliest seq on ``group`` that every one
    of them holds with its histories whole from there on; None where there is no such seq."""
    held: dict[int, tuple[list[r.CallRecord], dict[int, int], bool]] = {}
    for rank in ranks:
        st = job.ranks.get(rank)
        if st is None:
            return None
        calls, whole_from, cut = _calls(st)
        on_group = {c.seq: c.call_id for c in calls if c.group == group and c.enter_time >= whole_from}
        held[rank] = (calls, on_group, cut)
    common = set.intersection(*(set(on_group) for _, on_group, _ in held.values())) if held else set()
    if not common:
        return None
    start = min(common)
    out: dict[int, list[Mark]] = {}
    for rank, (calls, on_group, cut) in held.items():
        ordered = in_order(calls)
        at = next(k for k, c in enumerate(ordered) if c.call_id == on_group[start])
        forwards = [f for f in job.ranks[rank].forwards if f[1] != group or f[2] >= start]
        if cut:  # the forward passes begun after the trace's known end are not known either
            last = {c.group: c.seq for c in ordered if c.kind is not r.OpKind.P2P}  # the latest wins
            forwards = [f for f in forwards if f[2] <= last.get(f[1], f[2])]
        out[rank] = trace(ordered[at:], forwards, ordered=True)
    return out


def edit_of(job: JobState, group: str, culprit: int, reference: int) -> Edit | None:
    """Where ``culprit``'s trace parts from ``reference``'s (None: no common place to start)."""
    both = traces(job, group, [culprit, reference])
    return None if both is None else align(both[culprit], both[reference])
