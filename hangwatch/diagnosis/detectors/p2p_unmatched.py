"""Blocked sends and recvs whose peer is blocked in p2p too, but not in the matching call
(a send/send or recv/recv deadlock, or a wrong peer): the hang-detection half of the
``p2p_mismatch`` detector (:mod:`hangwatch.diagnosis.detectors.p2p`), which owns it. The
comparison of a paired send and recv is ``hangwatch.diagnosis.rules.match_p2p``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hangwatch.diagnosis.rules import P2P_MISMATCH, Mismatch
from hangwatch.records import RECV_OPS, SEND_OPS, CallRecord
from hangwatch.wording import describe_call, p2p_doing, stories


def unmatched_p2p(open_calls: Sequence[CallRecord], now: float, grace_s: float) -> list[tuple[CallRecord, Mismatch]]:
    """Blocked sends/recvs whose peer is itself blocked in p2p, but not in the matching call,
    each with the blocked call it starts from.

    Only open calls (``exit_time is None``) of a SEND_OPS/RECV_OPS op with a known peer, open
    for at least ``grace_s`` at ``now``, are considered, on both sides. A send from a to b is
    fine when b has such a recv from a in the same group (in flight); a send whose peer is not
    blocked in p2p at all is not reported here. Each disagreement is reported once, with both
    ranks as culprits (which side has the calls in the wrong order cannot be told).
    """
    blocked: dict[int, list[CallRecord]] = {}
    for c in open_calls:
        if c.exit_time is not None or c.peer is None:
            continue
        if c.op not in SEND_OPS and c.op not in RECV_OPS:
            continue
        if now - c.enter_time < grace_s:
            continue
        blocked.setdefault(c.rank, []).append(c)
    found: list[tuple[CallRecord, Mismatch]] = []
    seen: set[frozenset[tuple[int, int]]] = set()
    for rank in sorted(blocked):
        for c in sorted(blocked[rank], key=lambda c: (c.enter_time, c.call_id)):
            assert c.peer is not None
            peer_calls = sorted(blocked.get(c.peer, []), key=lambda p: (p.enter_time, p.call_id))
            if not peer_calls or c.peer == c.rank:
                continue
            sending = c.op in SEND_OPS
            wanted = RECV_OPS if sending else SEND_OPS
            if any(p.peer == c.rank and p.group == c.group and p.op in wanted for p in peer_calls):
                continue
            key = frozenset({(c.rank, c.call_id)} | {(p.rank, p.call_id) for p in peer_calls})
            if key in seen:
                continue
            seen.add(key)
            found.append((c, _unmatched(c, peer_calls, now)))
    return found


def _unmatched(c: CallRecord, peer_calls: Sequence[CallRecord], now: float) -> Mismatch:
    assert c.peer is not None
    sending = c.op in SEND_OPS
    theirs = " and ".join(p2p_doing(p, c) for p in peer_calls)
    summary = stories.p2p_unmatched(c, theirs, now - c.enter_time)
    both_send = sending and any(p.op in SEND_OPS and p.peer == c.rank for p in peer_calls)
    both_recv = not sending and any(p.op in RECV_OPS and p.peer == c.rank for p in peer_calls)
    sites = [(x.call_site, x.rank) for x in (c, peer_calls[0])]
    hint = stories.p2p_hint(c.rank, c.peer, both_send, both_recv, sites)
    details = {c.rank: describe_call(c), c.peer: "; ".join(describe_call(p) for p in peer_calls)}
    return Mismatch(
        kind=P2P_MISMATCH,
        culprit_ranks=tuple(sorted({c.rank, c.peer})),
        agreeing_ranks=(),
        summary=summary,
        details=details,
        hint=hint,
    )
