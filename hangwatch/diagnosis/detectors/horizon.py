"""What the stuck detector knows of a rank by now, and how long it waits to know more.

A hang is told on what the coordinator has heard: a rank's batches come seconds after it sent
them (at 16,384 ranks, or through a relay), its collectives C++ issued come from Flight Recorder
reads spaced by their cost, and the coordinator itself may run behind. Here: whether a rank's
silence may be a freeze, whether its word or its reads reach past a moment, whether a wait has
been heard as a wait long enough, and whether the slot an open incident tells has new waiters.
"""

from __future__ import annotations

from hangwatch import config
from hangwatch.diagnosis.detectors import Context
from hangwatch.diagnosis.incidents import Finding
from hangwatch.diagnosis.state import JobState, RankState, Slot
from hangwatch.diagnosis.traces import TRACE_WAIT_S, unknown_at

#: Heartbeats come every second; a rank silent this long may be frozen (the frozen detector
#: decides at ``silence_after``), so a hang it is absent from is not yet blamed on it.
SUSPECT_SILENCE_S = 2.5
#: A rank's latest Flight Recorder read this much older than its latest batch: its reads have
#: stopped (the worker server no longer answers, a ring keeps failing), and what it says of
#: C++'s collectives is old. A node agent spaces reads by their cost and spares those Python
#: calls account for, but reads each rank at least every 20 s
#: (``agent.flightrecorder.MAX_READ_EVERY_S``) and a spared CPU ring every 10 s.
FLIGHT_STALE_S = 60.0
#: A rank still inside a call says so in each batch (one at least every 2 s, held up to 1 s by
#: a relay): a wait counts to the threshold only where a waiting rank's word came this close to
#: it since. Before, its exit may be on its way to a coordinator running behind (at 16,384
#: ranks, ranks whose first call's exit was queued were told waiting for ranks not heard yet).
HEARD_WITHIN_S = 3.0
#: A coordinator this far behind its batches holds its stuck judgements until it catches up: the
#: batch that shows an absent rank arrived may be among those queued (at 16,384 ranks x 50/s with
#: device progress, 10 s behind, 2,270 ranks were told waiting in a collective the absent ranks'
#: queued batches held). A job that hangs stops calling, and its coordinator catches up then.
BEHIND_HOLD_S = HEARD_WITHIN_S


def silent(state: RankState, ctx: Context) -> bool:
    return ctx.now - state.last_seen > min(ctx.silence_after, SUSPECT_SILENCE_S) + ctx.behind


def held_for_traces(job: JobState, ctx: Context, finding: Finding) -> bool:
    """Whether a culprit's trace is not known through the wait's start: its C++ collectives come
    from Flight Recorder reads, the latest older than the wait (under load, rank 0 seen busy in
    its backward while its gradient all_reduce, issued from C++, met rank 1's barrier). Held for
    ``TRACE_WAIT_S`` past the threshold at most: reads that stopped are told as they are."""
    if ctx.now - finding.onset_time >= ctx.stuck_after + TRACE_WAIT_S:
        return False
    return bool(unknown_at(job, finding.culprit_ranks, finding.onset_time))


def more_waiting(ctx: Context, group: str, seq: int, waiting: list[int]) -> bool:
    """Whether a slot an open hang incident tells (``Context.told``) has ranks waiting that it
    does not name: one whose call was read after the hang was told (a device's progress, a
    late batch) is told in it then, and a rank blamed for being late that came is blamed no more."""
    told = ctx.told.get((group, seq))
    return told is not None and not told[1].issuperset(waiting)


def still_waiting(job: JobState, waiting: list[int]) -> float:
    """Up to when the waiting ranks are known to wait: the latest word of any of them."""
    return max((st.last_sent for rk in waiting if (st := job.ranks.get(rk)) is not None), default=0.0)


def read_since(st: RankState, t: float, ctx: Context) -> bool:
    """Whether what the rank's C++ issued is known past ``t``: a Flight Recorder read asked half
    the threshold after it has come (one just after may be followed by the call's own end a
    moment later), or, where its reads stopped or no agent says when they were asked, a batch
    one poll after it."""
    if st.flight_to > st.last_sent - FLIGHT_STALE_S:
        return st.flight_to >= t + ctx.stuck_after / 2
    return st.last_sent >= t + config.FR_POLL_INTERVAL_S


def waits_unread(job: JobState, ctx: Context, slot: Slot, waiting: list[int], oldest: float) -> bool:
    """Whether every waiting rank waits in a call C++ issued that no read since has shown still
    under way (``read_since`` its entry): the read that made its record found it in flight, and
    the next may find it long done (under load, CI: a 24-entry ring turned over between reads
    spaced seconds apart, and DDP's constructor broadcast was told stuck 3 s). Held for
    ``TRACE_WAIT_S`` past the threshold at most: reads that stopped are told as they are."""
    if ctx.now - oldest >= ctx.stuck_after + TRACE_WAIT_S:
        return False
    for rank in waiting:
        call, st = slot.calls[rank], job.ranks.get(rank)
        if call.source == "python" or st is None or st.end is not None or read_since(st, call.enter_time, ctx):
            return False
    return True
