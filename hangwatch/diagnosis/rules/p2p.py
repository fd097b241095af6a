"""Point-to-point matching: a send and the recv paired with it must carry the same data.

The caller pairs them (same group, src, dst and pair seq). A send or recv that waits for a
peer busy with something else is hang detection, not a comparison of two calls: see
``hangwatch.diagnosis.detectors.p2p_unmatched``.
"""

from __future__ import annotations

from hangwatch.diagnosis.rules.checks import numel
from hangwatch.diagnosis.rules.slot import P2P_MISMATCH, Mismatch
from hangwatch.records import CallRecord, TensorMeta
from hangwatch.wording import describe_call, format_metas
from hangwatch.wording import mismatches as words


def _p2p_metas(c: CallRecord) -> tuple[TensorMeta, ...]:
    return c.inputs or c.outputs


def match_p2p(send: CallRecord, recv: CallRecord) -> Mismatch | None:
    """A send and the recv paired with it (same group, src, dst and pair seq, matched by the
    caller) must carry the same number of elements of the same dtype (object lists: the same
    length). Which side is wrong cannot be told, so both are culprits."""
    s_metas, r_metas = _p2p_metas(send), _p2p_metas(recv)
    if not s_metas or not r_metas:
        return None
    s_dtypes = tuple(dict.fromkeys(m.dtype for m in s_metas))
    r_dtypes = tuple(dict.fromkeys(m.dtype for m in r_metas))
    s_numel = sum(numel(m.shape) for m in s_metas)
    r_numel = sum(numel(m.shape) for m in r_metas)
    if s_dtypes == r_dtypes and s_numel == r_numel:
        return None
    objects = "object" in s_dtypes or "object" in r_dtypes
    if s_dtypes != r_dtypes and not objects:
        problem = "dtypes differ"
        fix = "the same dtype"
    else:
        problem = "lengths differ" if objects else "sizes differ"
        fix = "lists of the same length" if objects else "the same number of elements"
    send_desc = format_metas(s_metas)
    recv_desc = format_metas(r_metas)
    if not objects:
        send_desc += f" ({s_numel} elements)"
        recv_desc += f" ({r_numel} elements)"
    summary = words.p2p_summary(send.group, send.seq, send.rank, send_desc, recv.rank, recv_desc, problem)
    hint = words.p2p_hint(fix, [("the send", send.call_site, send.rank), ("the recv", recv.call_site, recv.rank)])
    return Mismatch(
        kind=P2P_MISMATCH,
        culprit_ranks=tuple(sorted({send.rank, recv.rank})),
        agreeing_ranks=(),
        summary=summary,
        details={send.rank: describe_call(send), recv.rank: describe_call(recv)},
        hint=hint,
    )
