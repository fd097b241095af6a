"""``rank_frozen``: the process is alive but its hook went silent.

The hook's sender thread heartbeats every second, even while the main thread waits inside a
collective (the backend releases the GIL). Silence with a live process means the whole
interpreter is stuck: the GIL held in native code, SIGSTOP, uninterruptible sleep. The node
agent tells alive from dead; the stacks (with native frames) say where it froze.
"""

from __future__ import annotations

from hangwatch import kinds
from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context
from hangwatch.diagnosis.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.diagnosis.state import JobState, RankState
from hangwatch.wording import stories

#: Ranks silent at once on more hosts than this are not frozen without an agent's word.
FROZEN_HOSTS = 2
_EVIDENCE = (r.ProcState.STOPPED, r.ProcState.DISK_SLEEP)


def detect(job: JobState, ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    # a coordinator behind its batches hears every rank late: that lateness is its own, unless
    # the rank's node agent says now that it is stopped (a whole job stopped stops the frontier)
    # (the allowance is never below 0: asked only of ranks silent as long as the threshold)
    # (the silence first: at 16,384 ranks this walk is made four times a second)
    silent = [
        st
        for st in job.ranks.values()
        if (quiet := ctx.now - st.last_seen) >= ctx.silence_after
        and st.end is None
        and st.alive
        and quiet >= ctx.silence_after + _allowance(st, ctx)
    ]
    if not silent:
        return findings
    live = sum(1 for st in job.ranks.values() if st.end is None and st.alive)
    if len(silent) > max(1, live // 2) or len({st.identity.host for st in silent}) > FROZEN_HOSTS:
        # Ranks on several hosts silent at once are the network or a coordinator late to its
        # batches (a stall of its own hears whichever ranks were next, on any node), not frozen
        # ranks: a freeze is one process's doing, or one node's. Only a node agent's word that
        # a process is stopped or in uninterruptible sleep makes one of them frozen then. Their
        # collectives will tell if they hang.
        silent = [st for st in silent if st.proc is not None and st.proc.state in _EVIDENCE]
    silent = [st for st in silent if not relay_lost(job, st, ctx.now, ctx.silence_after)]
    blocked = sorted(o.rank for o in job.ranks.values() if o.open_calls and o.end is None) if silent else []
    for st in silent:
        silent_for = ctx.now - st.last_seen
        proc = st.proc
        how = stories.frozen_how(proc.state if proc is not None else None)
        waiting = [rk for rk in blocked if rk != st.rank]
        last = st.last_call
        summary = stories.frozen(st.rank, st.identity.pid, st.identity.host, how, ctx.silence_after, last, waiting)
        findings.append(
            Finding(
                kind=IncidentKind.RANK_FROZEN,
                # one freeze, one incident: a rank that freezes again after it came back (its
                # last heartbeat then moved on) is a new one, not the first one seen again
                key=incident_key(KeyFamily.FROZEN, session=st.identity.session, since=int(st.last_seen)),
                culprit_ranks=[st.rank],
                waiting_ranks=waiting,
                summary=summary,
                hint=kinds.hint(IncidentKind.RANK_FROZEN),
                onset_time=st.last_seen,
                op=last.op if last else "",
                group=last.group if last else "",
                seq=last.seq if last else 0,
                step=st.step,
                details={
                    "process": proc.state.value if proc else "unknown",
                    "silent_s": round(silent_for, 1),
                },
                stack_ranks=[st.rank],
                native=True,
            )
        )
    return findings


def _allowance(st: RankState, ctx: Context) -> float:
    """The silence of ``st`` that may be the coordinator's own (``Context.behind``): none where
    its agent's word, heard lately, is that the process is stopped or in uninterruptible sleep."""
    proc = st.proc
    if proc is not None and proc.state in _EVIDENCE and ctx.now - proc.time < ctx.silence_after:
        return 0.0
    return ctx.behind


def relay_lost(job: JobState, st: RankState, now: float, silence_after: float) -> bool:
    """``st`` came through a relaying agent whose every other rank fell silent too: the relay
    went (killed, its node's network), not the ranks; unless that agent's own word says the
    process is stopped or in uninterruptible sleep, it is not frozen."""
    if not st.relay or (st.proc is not None and st.proc.state in _EVIDENCE):
        return False
    carried = [o for o in job.ranks.values() if o.relay == st.relay and o.end is None and o.alive]
    return len(carried) >= 2 and all(now - o.last_seen >= silence_after for o in carried)
