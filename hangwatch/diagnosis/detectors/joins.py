"""Hangs before the job's ranks joined: ranks wait in ``init_process_group`` for others.

A rank joins when its ``init_process_group`` returns. Until then its node agent tells where
the process its launcher started stands (``JobState.joining``): started, inside
``init_process_group``, or gone. Where members have waited inside it ``ctx.init_after``, and
no rank of their launch has joined:

1. ranks of the job that are not inside it are the sink their waits end in: each never entered
   it (alive: where it is, from its stack), ended before it joined, or was never seen (no
   process of it linked to a node agent) -> ``stuck_collective`` on ``init_process_group``;
2. every rank is inside and none leaves: the rendezvous or the transport between them fails
   -> ``transport_stall``.

Once any rank of the launch joined, its own collectives tell the rest.
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context
from hangwatch.diagnosis.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.diagnosis.state import JobState, Joiner
from hangwatch.wording import joining

INIT = r.INIT_OP


def joiner_story(j: Joiner) -> str:
    """Where a process started as a rank stands, having not joined."""
    i = j.identity
    if i.phase == r.GONE:
        return joining.gone_unjoined(i.rank, i.pid, i.host)
    if i.phase == r.IN_INIT:
        return joining.inside_init(i.rank, i.pid, i.host)
    return joining.never_entered(i.rank, i.pid, i.host, j.where)


def detect(job: JobState, ctx: Context) -> list[Finding]:
    if not job.joining:
        return []
    attempt = max(j.identity.attempt for j in job.joining.values())
    current = {rk: j for rk, j in job.joining.items() if j.identity.attempt == attempt}
    inside = {rk: j for rk, j in current.items() if j.identity.phase == r.IN_INIT}
    if not inside:
        return []
    waited = ctx.now - min(j.since for j in inside.values())
    if waited < ctx.init_after:
        return []
    if any(st.identity.attempt == attempt for st in job.ranks.values()):
        return []  # some returned from it: their first collective tells who is missing
    world = max(j.identity.world_size for j in current.values())
    waiting = sorted(inside)
    missing = [rk for rk in range(world) if rk not in inside]
    key = incident_key(KeyFamily.STUCK if missing else KeyFamily.STALL, group=INIT, seq=attempt)
    details: dict[str, object] = {"joining": {str(rk): j.identity.phase for rk, j in sorted(current.items())}}
    onset = min(j.since for j in inside.values())

    def finding(kind: IncidentKind, culprits: list[int], summary: str, hint: str, stacks: list[int]) -> Finding:
        return Finding(
            kind=kind,
            key=key,
            culprit_ranks=culprits,
            waiting_ranks=waiting if missing else [],
            summary=summary,
            hint=hint,
            onset_time=onset,
            op=INIT,
            group="",
            seq=0,
            step=0,
            details=details,
            stack_ranks=stacks,
        )

    if not missing:
        summary = joining.rendezvous_stalled(waiting, waited, job.launch)
        return [finding(IncidentKind.TRANSPORT_STALL, waiting, summary, joining.RENDEZVOUS_HINT, waiting[:1])]
    absent = [joining.never_seen(rk) if rk not in current else joiner_story(current[rk]) for rk in missing]
    starting = [rk for rk in missing if rk in current and current[rk].identity.phase == r.STARTING]
    summary = joining.never_joined(waiting, waited, absent)
    return [finding(IncidentKind.STUCK_COLLECTIVE, missing, summary, joining.JOIN_HINT, starting + waiting[:1])]
