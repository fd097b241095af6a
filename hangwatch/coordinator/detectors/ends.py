"""Ranks that ended while the job runs: ``rank_died``, or ``early_exit`` when the first to go left
cleanly while others were still in (or entering) a collective.

The root cause is the first rank to end. Peers that fail afterwards because their connection
to it broke ("Connection closed by peer", torchrun's SIGTERM) are consequences, listed as
affected ranks of the same incident, never incidents of their own.
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.coordinator.detectors import Context
from hangwatch.coordinator.detectors.stuck import EARLY_EXIT_HINT
from hangwatch.coordinator.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.coordinator.state import JobState, RankState
from hangwatch.wording import describe_call, format_ranks

CLEAN = (r.EndKind.CLEAN_EXIT, r.EndKind.DESTROYED)
#: Signals a launcher or scheduler sends to stop a whole job.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
#: How long to wait, after a rank is stopped by such a signal, to see whether the whole job is.
JOB_STOP_WINDOW_S = 2.0


def _stopped_by_signal(state: RankState) -> bool:
    """Ended the way a stopped job's ranks end: a stop signal (the process vanishes, or reports it),
    or Ctrl-C's KeyboardInterrupt."""
    end = state.end
    if end is None:
        return state.proc is not None and state.proc.state in (r.ProcState.DEAD, r.ProcState.ZOMBIE)
    if end.kind is r.EndKind.SIGNAL:
        return end.detail in STOP_SIGNALS
    return end.kind is r.EndKind.EXCEPTION and end.detail.startswith("KeyboardInterrupt")


def _job_stopping(job: JobState, ctx: Context, first: RankState, first_time: float) -> bool:
    """The first end looks like a stop: wait a moment, then say whether every rank stopped so.

    torchrun, SLURM and Kubernetes stop a job by signalling all its ranks; that is the operator's
    decision, not a fault of the rank that happened to go first. A rank killed alone (the OOM
    killer) is different: its peers then fail with connection errors, or keep running.
    """
    if not _stopped_by_signal(first):
        return False
    if ctx.now - first_time < JOB_STOP_WINDOW_S:
        return True  # undecided yet: look again on a later tick
    others = [st for st in job.ranks.values() if st is not first]
    return all(
        _stopped_by_signal(st) or (st.end is not None and st.end.kind is not r.EndKind.EXCEPTION) for st in others
    )


def _end_time(state: RankState) -> float | None:
    """When a rank ended, or None while it runs (a dead process without an end: last heard)."""
    if state.end is not None:
        return state.to_local(state.end.time)
    if state.proc is not None and state.proc.state in (r.ProcState.DEAD, r.ProcState.ZOMBIE):
        return state.last_seen
    return None


def _observed(state: RankState) -> float:
    """When the coordinator learnt of the end (a vanished process: when the agent saw it gone)."""
    if state.end is not None:
        return state.to_local(state.end.time)
    return state.proc.time if state.proc is not None else state.last_seen


def _death_text(state: RankState) -> str:
    end = state.end
    if end is None:
        proc = state.proc
        how = "its process disappeared without a word (SIGKILL, the OOM killer, or a native crash)"
        if proc is not None and proc.signal:
            how = f"its process was killed by signal {proc.signal}"
        elif proc is not None and proc.exit_code is not None:
            how = f"its process exited with code {proc.exit_code}"
        return how
    where = f" at {end.call_site}" if end.call_site else ""
    if end.kind is r.EndKind.EXCEPTION:
        return f"it raised {end.detail}{where}"
    if end.kind is r.EndKind.SIGNAL:
        return f"it received {end.detail}{where}"
    return f"it ended ({end.kind.value}){where}"


def detect(job: JobState, ctx: Context) -> list[Finding]:
    ended = [(t, st) for st in job.ranks.values() if (t := _end_time(st)) is not None]
    if job.aborted_at is not None:  # ends caused by our own --abort-on-hang are not deaths
        aborted = job.aborted_at
        ended = [(t, st) for t, st in ended if _observed(st) < aborted]
    if not ended:
        return []
    ended.sort(key=lambda item: item[0])
    first_time, first = ended[0]
    running = [st for st in job.ranks.values() if _end_time(st) is None]
    if _job_stopping(job, ctx, first, first_time):
        return []
    clean = first.end is not None and first.end.kind in CLEAN
    if clean:
        return _early_exit(job, ctx, first, first_time, ended)
    affected = sorted(st.rank for _, st in ended[1:]) + sorted(st.rank for st in running)
    last = first.last_call
    if (
        last is not None
        and (last.group, last.seq) in ctx.mismatched
        and (first.end is None or last.exit_time is None or last.error is not None)
    ):
        # Killed, or failed, inside a mismatched call: the backend crashed on the mismatch (gloo:
        # 10 vs 20 floats, float32 vs float64). The mismatch incident is the root cause.
        return []
    mismatch_note = ""
    if last is not None and (last.group, last.seq) in ctx.mismatched:
        mismatch_note = f"; its last call, {last.op} (group {last.group}, seq {last.seq}), was mismatched"
    if last is not None and last.exit_time is None:
        in_call = f" inside {describe_call(last)}"
    else:
        in_call = ""
    summary = f"rank {first.rank} died: {_death_text(first)}{in_call}{mismatch_note}"
    if affected:
        summary += f"; rank{'s' if len(affected) > 1 else ''} {format_ranks(affected)} then failed or wait for it"
    return [
        Finding(
            kind=IncidentKind.RANK_DIED,
            key=incident_key(KeyFamily.DIED, session=first.identity.session),
            culprit_ranks=[first.rank],
            waiting_ranks=affected,
            summary=summary,
            hint=(
                "Fix the error on the culprit rank (its exception and frame are above); the other ranks only "
                "failed because it left. If it was killed without a word, check dmesg for the OOM killer and "
                "the launcher's logs."
                if not mismatch_note
                else "The backend crashed on a mismatched collective: make every rank call it with the same "
                "arguments (see the mismatch incident)."
            ),
            onset_time=first_time,
            op=last.op if last else "",
            group=last.group if last else "",
            seq=last.seq if last else 0,
            step=first.step,
            details={
                "exit": {
                    "kind": first.end.kind.value if first.end else "vanished",
                    "detail": first.end.detail if first.end else "",
                    "call_site": first.end.call_site if first.end else "",
                    "exit_code": (first.end.exit_code if first.end else (first.proc.exit_code if first.proc else None)),
                },
                "affected": {str(st.rank): _death_text(st) for _, st in ended[1:]},
            },
            stack_ranks=[st.rank for st in running][:4],
        )
    ]


def _early_exit(
    job: JobState, ctx: Context, first: RankState, first_time: float, ended: list[tuple[float, RankState]]
) -> list[Finding]:
    """The first rank to end left cleanly: a problem only if others were in a collective it skipped."""
    waiting: list[int] = []
    op = group = ""
    seq = 0
    for st in job.ranks.values():
        if st is first:
            continue
        for call in st.history_calls_after(first_time - 1.0):
            if call.kind is r.OpKind.MARKER:
                continue
            members = job.members(call.group)
            if members and first.rank not in members:
                continue
            first_hist = first.history.get(call.group)
            reached = first_hist is not None and any(
                c.seq >= call.seq for c in first_hist if c.kind is call.kind and c.kind is r.OpKind.COLLECTIVE
            )
            # A collective that a member never reached cannot have completed, whatever its record
            # says: Flight Recorder retires DDP's all-reduce when gloo fails it, with no error.
            unfinished = call.exit_time is None or call.error is not None or call.kind is r.OpKind.COLLECTIVE
            if unfinished and not reached:
                waiting.append(st.rank)
                op, group, seq = call.op, call.group, call.seq
                break
    if not waiting:
        return []
    end = first.end
    assert end is not None
    where = f" at {end.call_site}" if end.call_site else ""
    action = "called destroy_process_group()" if end.kind is r.EndKind.DESTROYED else "exited"
    return [
        Finding(
            kind=IncidentKind.EARLY_EXIT,
            key=incident_key(KeyFamily.EARLY_END, session=first.identity.session),
            culprit_ranks=[first.rank],
            waiting_ranks=sorted(waiting),
            summary=(
                f"rank {first.rank} left the training loop after step {first.step} and {action}{where}, while "
                f"rank{'s' if len(waiting) > 1 else ''} {format_ranks(sorted(waiting))} entered {op} "
                f"(group {group}, seq {seq}) of the next step and never got an answer"
            ),
            hint=EARLY_EXIT_HINT,
            onset_time=first_time,
            op=op,
            group=group,
            seq=seq,
            step=first.step,
            details={"exit": {"kind": end.kind.value, "call_site": end.call_site, "step": first.step}},
            stack_ranks=sorted(waiting)[:2],
        )
    ]
