"""``p2p_mismatch``: a send whose receive does not match (size, dtype) or never comes (wrong peer)."""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.coordinator.detectors import Context
from hangwatch.coordinator.detectors.p2p_unmatched import unmatched_p2p
from hangwatch.coordinator.incidents import Finding
from hangwatch.coordinator.rules import Mismatch, match_p2p
from hangwatch.coordinator.state import JobState

#: A p2p call may legitimately wait for its peer this long before a wrong peer is reported.
P2P_GRACE_S = 2.0


def detect(job: JobState, ctx: Context) -> list[Finding]:
    if job.p2p_changed:  # pair sends with receives only when new p2p calls arrived
        job.p2p_changed = False
        job.p2p_pair_mismatches = _paired(job)
    found = list(job.p2p_pair_mismatches)
    open_calls = list(job.p2p_open.values())
    if open_calls:
        found.extend(unmatched_p2p(open_calls, ctx.now, min(P2P_GRACE_S, ctx.stuck_after)))
    findings = []
    for m in found:
        ranks = sorted(set(m.culprit_ranks) | set(m.agreeing_ranks))
        findings.append(
            Finding(
                kind=m.kind,
                key="p2p:" + ",".join(map(str, ranks)) + ":" + m.summary[:80],
                culprit_ranks=list(m.culprit_ranks),
                waiting_ranks=list(m.agreeing_ranks),
                summary=m.summary,
                hint=m.hint,
                onset_time=ctx.now,
                op="send/recv",
                details={"calls": {str(k): v for k, v in m.details.items()}},
                stack_ranks=ranks[:4],
            )
        )
    return findings


def _paired(job: JobState) -> list[Mismatch]:
    """Sends and receives that pair up (same group, pair and seq) but disagree on size or dtype."""
    sends: dict[tuple[str, int, int, int], r.CallRecord] = {}
    recvs: dict[tuple[str, int, int, int], r.CallRecord] = {}
    for st in job.ranks.values():
        for hist in st.history.values():
            for c in hist:
                if c.op in r.SEND_OPS and c.peer is not None:
                    sends[(c.group, c.rank, c.peer, c.seq)] = c
                elif c.op in r.RECV_OPS and c.peer is not None:
                    recvs[(c.group, c.peer, c.rank, c.seq)] = c
    found: list[Mismatch] = []
    for key, send in sends.items():
        recv = recvs.get(key)
        if recv is not None:
            m = match_p2p(send, recv)
            if m is not None:
                found.append(m)
    return found
