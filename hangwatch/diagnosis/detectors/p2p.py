"""``p2p_mismatch``: a send whose receive does not match (size, dtype) or never comes (wrong peer).

Incremental (``P2PCache``, owned by the engine): sends are paired with receives only when new p2p
calls arrived. Keys: a pair that disagrees is (group, pair seq, sender, receiver); a blocked call
whose peer waits in something else is (group, its rank and peer, send or recv).
"""

from __future__ import annotations

from dataclasses import dataclass

from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context
from hangwatch.diagnosis.detectors.p2p_unmatched import unmatched_p2p
from hangwatch.diagnosis.incidents import Finding, KeyFamily, incident_key
from hangwatch.diagnosis.rules import Mismatch, match_p2p
from hangwatch.diagnosis.state import JobState

#: A p2p call may legitimately wait for its peer this long before a wrong peer is reported.
P2P_GRACE_S = 2.0


@dataclass
class P2PCache:
    """What ``detect`` remembers between ticks (engine-owned; see detectors/__init__.py)."""

    pairs: list[tuple[str, Mismatch]] | None = None  # (key, mismatch) of paired calls; None: pair again


def detect(job: JobState, ctx: Context) -> list[Finding]:
    cache = ctx.cache.p2p
    if cache.pairs is None or ctx.changes.p2p:  # pair sends with receives only when new p2p calls arrived
        cache.pairs = _paired(job)
    found = list(cache.pairs)
    open_calls = list(job.p2p_open.values())
    if open_calls:
        found.extend(
            (_blocked_key(c), m) for c, m in unmatched_p2p(open_calls, ctx.now, min(P2P_GRACE_S, ctx.stuck_after))
        )
    findings = []
    for key, m in found:
        ranks = sorted(set(m.culprit_ranks) | set(m.agreeing_ranks))
        findings.append(
            Finding(
                kind=m.kind,
                key=key,
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


def _blocked_key(c: r.CallRecord) -> str:
    """A blocked call whose peer waits in something else: its group, its rank and peer, and
    whether it sends or receives."""
    direction = "send" if c.op in r.SEND_OPS else "recv"
    return incident_key(
        KeyFamily.P2P, group=c.group, ranks=(c.rank, c.peer if c.peer is not None else -1), direction=direction
    )


def _paired(job: JobState) -> list[tuple[str, Mismatch]]:
    """Sends and receives that pair up (same group, pair and seq) but disagree on size or dtype."""
    sends: dict[tuple[str, int, int, int], r.CallRecord] = {}
    recvs: dict[tuple[str, int, int, int], r.CallRecord] = {}
    for st in job.ranks.values():
        for hist in st.history.values():
            for c in hist.alone():  # p2p calls never come in runs: those stay unmade
                if c.op in r.SEND_OPS and c.peer is not None:
                    sends[(c.group, c.rank, c.peer, c.seq)] = c
                elif c.op in r.RECV_OPS and c.peer is not None:
                    recvs[(c.group, c.peer, c.rank, c.seq)] = c
    found: list[tuple[str, Mismatch]] = []
    for pair, send in sends.items():
        recv = recvs.get(pair)
        if recv is not None:
            m = match_p2p(send, recv)
            if m is not None:
                group, src, dst, seq = pair
                found.append((incident_key(KeyFamily.P2P, group=group, seq=seq, ranks=(src, dst)), m))
    return found
