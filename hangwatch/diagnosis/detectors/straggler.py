"""``straggler`` (a warning, not a hang): one rank persistently arrives last by a wide margin."""

from __future__ import annotations

import collections
import statistics

from hangwatch import kinds
from hangwatch.diagnosis.detectors import Context
from hangwatch.diagnosis.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.diagnosis.state import JobState
from hangwatch.wording import stories

WINDOW = 20  # complete collectives looked at per group
SHARE = 0.8  # the same rank last in at least this share of them
MIN_MARGIN_S = 0.5  # and behind the median arrival by at least this much on average


def _seq(arrival: tuple[int, float, int, float]) -> int:
    return arrival[2]


def _offset_excess(job: JobState, group: str, rank: int) -> float:
    """How much later than the median member's the rank's clock offset maps its times (0 if not
    later). A rank's offset is the smallest delay its batches showed (``RankState.observe_clock``):
    where every batch of a rank waited in a coordinator's queue past its capacity, its times
    map that much late, and it looks last at every collective (1,024 ranks at 700 collectives/s
    each, ``bench/ingest.py ceiling``: warned of by 0.7 s). The lag must outdo that excess; a true
    straggler's batches wait no longer than the others', and ranks' clocks agree far closer than
    ``MIN_MARGIN_S``."""
    st = job.ranks.get(rank)
    if st is None or not st.offset_samples:
        return 0.0
    others = [
        peer.clock_offset
        for m in job.members(group)
        if m != rank and (peer := job.ranks.get(m)) is not None and peer.offset_samples
    ]
    return max(0.0, st.clock_offset - statistics.median(others)) if others else 0.0


def detect(job: JobState, ctx: Context) -> list[Finding]:
    """The lag is the median of the rank's lags, not their mean, and slots an incident explains
    are left out: one hang that resolved (a rank 30 s late once) is that incident, not a rank that
    is persistently late; nor is a rank that is the culprit of an open hang now."""
    findings: list[Finding] = []
    for group, arrivals in job.arrivals.items():
        # in seq order: slots and runs complete (and are counted) in the order their last rank's
        # batch comes, so the window is the same whichever way the calls travelled
        recent = sorted((a for a in arrivals if (group, a[2]) not in ctx.claimed), key=_seq)[-WINDOW:]
        if len(recent) < WINDOW:
            continue
        last = collections.Counter(rank for rank, _, _, _ in recent)
        rank, count = last.most_common(1)[0]
        if rank in ctx.hangs:
            continue
        lags = sorted(lag for rk, lag, _, _ in recent if rk == rank)
        margin = statistics.median(lags)
        if count < SHARE * len(recent) or margin - _offset_excess(job, group, rank) < MIN_MARGIN_S:
            continue
        findings.append(
            Finding(
                kind=IncidentKind.STRAGGLER,
                key=incident_key(KeyFamily.STRAGGLER, group=group, rank=rank),
                culprit_ranks=[rank],
                waiting_ranks=[m for m in job.members(group) if m != rank],
                summary=stories.straggler(rank, count, len(recent), group, margin),
                hint=kinds.hint(IncidentKind.STRAGGLER),
                onset_time=recent[0][3],
                group=group,
                seq=recent[-1][2],
                details={"share_last": round(count / len(recent), 2), "mean_lag_s": round(margin, 2)},
            )
        )
    return findings
