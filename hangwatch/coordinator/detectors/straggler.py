"""``straggler`` (a warning, not a hang): one rank persistently arrives last by a wide margin."""

from __future__ import annotations

import collections
import statistics

from hangwatch.coordinator.detectors import Context
from hangwatch.coordinator.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.coordinator.state import JobState

WINDOW = 20  # complete collectives looked at per group
SHARE = 0.8  # the same rank last in at least this share of them
MIN_MARGIN_S = 0.5  # and behind the median arrival by at least this much on average


def _seq(arrival: tuple[int, float, int, float]) -> int:
    return arrival[2]


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
        if count < SHARE * len(recent) or margin < MIN_MARGIN_S:
            continue
        findings.append(
            Finding(
                kind=IncidentKind.STRAGGLER,
                key=incident_key(KeyFamily.STRAGGLER, group=group, rank=rank),
                culprit_ranks=[rank],
                waiting_ranks=[m for m in job.members(group) if m != rank],
                summary=(
                    f"rank {rank} arrived last at {count} of the last {len(recent)} collectives of group "
                    f"{group}, {margin:.1f} s after the median rank on average"
                ),
                hint="Not a hang: look for uneven work on that rank (data loading, a slower host, logging "
                "or evaluation done only there).",
                onset_time=recent[0][3],
                group=group,
                seq=recent[-1][2],
                details={"share_last": round(count / len(recent), 2), "mean_lag_s": round(margin, 2)},
            )
        )
    return findings
