"""Ranks that ended while the job runs: ``rank_died``, or ``early_exit`` when the first to go left
cleanly while others were still in (or entering) a collective.

The root cause is the first rank to end, by the precise moment its process vanished (its link to
the node agent closing) or the end it reported. Peers that fail afterwards because their
connection to it broke ("Connection closed by peer", torchrun's SIGTERM) are consequences,
listed as affected ranks of the same incident, never incidents of their own. Not deaths: a job
stopped as a whole (every rank stopped by a stop signal within a short window, or every process
gone at once), ends after our own abort. A death right after a mismatched collective the rank
took part in is the mismatch's aftermath: the finding names the mismatch incident
(``aftermath_of``) and the engine folds it in there.
"""

from __future__ import annotations

import signal

from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context, SlotId
from hangwatch.diagnosis.detectors.stuck import EARLY_EXIT_HINT
from hangwatch.diagnosis.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.diagnosis.state import JobState, RankState
from hangwatch.wording import describe_call, stories

CLEAN = (r.EndKind.CLEAN_EXIT, r.EndKind.DESTROYED)
#: A process's states once it is gone (``detect`` tests them inline: every rank, every tick)
_GONE = (r.ProcState.DEAD, r.ProcState.ZOMBIE)
#: Signals a launcher or scheduler sends to stop a whole job.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
#: How long to wait, after a rank is stopped by such a signal, to see whether the whole job is.
JOB_STOP_WINDOW_S = 2.0
#: A death is told this long after it (link-close time), not before: the ends of a job stopped
#: as a whole, and the peers' records of a mismatch that killed it, arrive within it.
SETTLE_S = 0.5
#: Ranks whose processes vanished within this long of one another went at once: stopped from
#: outside together (kill -9 of the whole job). A launcher reacting to one death (torchrun polls
#: every 0.1 s) stops the others later than that: the first, alone and earlier, is the culprit.
TOGETHER_S = 0.05
#: A death within this many collectives (in a group) after a mismatched slot it took part in is
#: the mismatch's aftermath (gloo aborts on 10 vs 20 floats, float32 vs int64), not a root cause.
AFTERMATH_CALLS = 2
#: A rank the backend aborted this long after others entered a mismatched slot of its group is
#: that mismatch's aftermath; its death is told once the others' collectives up to it are known,
#: or this long after it (``ABORT_EVIDENCE_S``).
ABORT_AFTER_S = 10.0
ABORT_EVIDENCE_S = 5.0

STOP, FAULT, UNKNOWN = "stop", "fault", "unknown"

#: What gloo's transport raises on a rank whose peer went first: such a rank is never the root
#: cause, however early its own end was seen. (NCCL's ``ncclRemoteError`` is left out: it is
#: also raised for a network failure where no peer went.)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
#: The exceptions the backends raise them as (a Python ``ConnectionResetError`` from the user's
#: own socket is the rank's own fault, not a peer's).
BACKEND_ERRORS = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _peer_gone(state: RankState) -> bool:
    """The rank raised what its backend raises when a peer's connection closed: a consequence."""
    end = state.end
    if end is None or end.kind is not r.EndKind.EXCEPTION:
        return False
    raised = end.detail.split(":", 1)[0].rsplit(".", 1)[-1]
    return raised in BACKEND_ERRORS and any(text in end.detail for text in PEER_GONE)


def _raced(state: RankState, first_time: float) -> bool:
    """The rank raised on a peer's closed connection, and its process then vanished within
    ``TOGETHER_S`` of the first, by a stop signal or with nothing known of how (reaped before
    the agent could look): in a job stopped as a whole, a rank signalled a moment after a peer
    fails on that peer's connection first (seen under CI load: every close stamped together, no
    signal seen, one rank's exception a moment before them; and two ranks that raised so and then
    died of their SIGTERM); where the others vanished without a word too, it tells nothing of a
    death of its own."""
    proc = state.proc
    return (
        _peer_gone(state)
        and proc is not None
        and proc.state in (r.ProcState.DEAD, r.ProcState.ZOMBIE)
        and (proc.signal is None or _signal_name(proc.signal) in STOP_SIGNALS)
        and not proc.exit_code
        and not proc.oom_killed
        and abs(proc.time - first_time) <= TOGETHER_S
    )


def _cause(state: RankState) -> str:
    """How a rank that did not exit cleanly ended: ``stop`` (a stop signal, Ctrl-C), ``fault``
    (an exception, a fatal signal, the OOM killer, a failing exit code) or ``unknown`` (its
    process vanished and was reaped before anyone could see how).

    A rank that raised only because a peer's connection closed and whose process a stop signal
    then ended was stopped: a job stopped as a whole is signalled rank by rank (a loop of
    ``kill``), and a rank whose signal came a few milliseconds after a peer's fails on the
    closed connection first (seen on a loaded CI machine)."""
    end = state.end
    proc = state.proc
    if end is not None:
        if end.kind is r.EndKind.SIGNAL:
            return STOP if end.detail in STOP_SIGNALS else FAULT
        if end.kind is r.EndKind.EXCEPTION:
            if _peer_gone(state) and proc is not None and proc.signal is not None:
                return STOP if _signal_name(proc.signal) in STOP_SIGNALS else FAULT
            return STOP if end.detail.startswith("KeyboardInterrupt") else FAULT
        return UNKNOWN
    if proc is None:
        return UNKNOWN
    if proc.oom_killed:
        return FAULT
    if proc.signal is not None:
        return STOP if _signal_name(proc.signal) in STOP_SIGNALS else FAULT
    if proc.exit_code:
        return FAULT
    return UNKNOWN


def _killed(state: RankState) -> bool:
    """Its process was killed by a signal no launcher or scheduler sends to stop a job (SIGKILL,
    SIGSEGV, SIGABRT) or by the OOM killer, as the agent saw it the moment it vanished."""
    proc = state.proc
    if state.end is not None or proc is None:
        return False
    return proc.oom_killed or (proc.signal is not None and _signal_name(proc.signal) not in STOP_SIGNALS)


def _launcher_reaction(ended: list[tuple[float, RankState]]) -> int | None:
    """Where, among the ends seen together with the first, is a rank killed alone whose launcher
    then stopped the rest (None when the ends tell no such story).

    The agent stamps a vanished process when its thread wakes to the link's close. Starved of
    CPU (or of the GIL, when it runs inside the coordinator) for longer than torchrun takes to
    react (it polls every 0.1 s, then SIGTERMs the rest), it wakes to every close at once, in no
    reliable order: the kill and the stops it caused look simultaneous, like a job killed as a
    whole. The signals still tell the story: a job killed as a whole dies of one signal on every
    rank, one stopped as a whole of stop signals; a SIGKILL among SIGTERMs is one rank killed and
    its launcher stopping the rest. (A rank reaped before the agent woke shows no signal: that
    case cannot be told from a stop, and is left silent.)
    """
    first_time = ended[0][0]
    together = [(i, st) for i, (t, st) in enumerate(ended) if t - first_time <= TOGETHER_S]
    killed = [i for i, st in together if _killed(st)]
    stopped = any(_cause(st) == STOP for _, st in together)
    return killed[0] if len(killed) == 1 and stopped else None


def _job_stopping(job: JobState, ctx: Context, first: RankState, first_time: float) -> bool:
    """The first end was a stop signal: wait a moment, then say whether every rank stopped so.

    torchrun, SLURM and Kubernetes stop a job by signalling all its ranks; that is the operator's
    decision, not a fault of the rank that happened to go first. A rank stopped alone is
    different: its peers then fail with connection errors, or keep running.
    """
    if ctx.now - first_time < JOB_STOP_WINDOW_S:
        return True  # undecided yet: look again on a later tick
    others = [st for st in job.ranks.values() if st is not first]
    return all(
        _end_time(st) is not None and ((st.end is not None and st.end.kind in CLEAN) or _cause(st) in (STOP, UNKNOWN))
        for st in others
    )


def _node_stopped(
    job: JobState, first: RankState, first_time: float, ended: list[tuple[float, RankState]]
) -> tuple[str, list[int]] | None:
    """The node whose every rank a stop signal ended together with ``first`` (or that vanished
    with it, unseen), while ranks of other nodes did not stop so (the whole job stopped is no
    incident at all), and its ranks."""
    host = first.identity.host
    if _cause(first) != STOP or not host:
        return None
    on_node = [st for st in job.ranks.values() if st.identity.host == host]
    elsewhere = [st for st in job.ranks.values() if st.identity.host != host]
    if not elsewhere:
        return None  # one node: the job's own stop, or one rank of it stopped alone
    stopped = {st.rank for t, st in ended if st.identity.host == host and t - first_time <= JOB_STOP_WINDOW_S}
    # a node-mate reaped before its agent saw how (a starved agent) vanished without a word: stopped too
    if any(st.rank not in stopped or _cause(st) not in (STOP, UNKNOWN) for st in on_node):
        return None
    return host, sorted(stopped)


def _stop_signal(state: RankState) -> str:
    """The stop signal that ended a rank whose cause is ``STOP``, by name."""
    if state.end is not None and state.end.kind is r.EndKind.SIGNAL:
        return state.end.detail
    if state.proc is not None and state.proc.signal is not None:
        return _signal_name(state.proc.signal)
    return "SIGINT" if state.end is not None and state.end.detail.startswith("KeyboardInterrupt") else "a stop signal"


def _end_time(state: RankState) -> float | None:
    """When a rank ended, or None while it runs: what it said of its end, else the moment its
    process was seen gone (its link to the node agent closing)."""
    if state.end is not None:
        return state.to_local(state.end.time)
    if state.proc is not None and state.proc.state in _GONE:
        return state.proc.time
    return None


def _observed(state: RankState) -> float:
    """When the coordinator learnt of the end (a vanished process: when the agent saw it gone)."""
    if state.end is not None:
        return state.to_local(state.end.time)
    return state.proc.time if state.proc is not None else state.last_seen


def _death_text(state: RankState) -> str:
    proc = state.proc
    signal = _signal_name(proc.signal) if proc is not None and proc.signal else ""
    return stories.death(state.end, proc, signal)


def _answered(leaver: RankState, call: r.CallRecord) -> bool:
    """Whether ``leaver`` issued the p2p call that answers ``call`` (a send or recv of another
    rank with ``leaver`` as its peer) before it left: a send for a recv, a recv for a send,
    counted per pair as the calls are. Its peer's side completing later is not its fault."""
    hist = leaver.history.get(call.group)
    mine = hist.alone() if hist is not None else ()  # p2p calls never come in runs
    wanted = r.SEND_OPS if call.op in r.RECV_OPS else r.RECV_OPS
    return any(c.op in wanted and c.peer == call.rank and c.seq >= call.seq for c in mine)


def _same_error(first: RankState, others: list[RankState]) -> list[int]:
    """Ranks among ``others`` that raised the very exception ``first`` raised (type, message and
    the line it was raised at), each on its own."""
    end = first.end
    if end is None or end.kind is not r.EndKind.EXCEPTION or not end.detail:
        return []
    return [
        st.rank
        for st in others
        if st.end is not None
        and st.end.kind is r.EndKind.EXCEPTION
        and st.end.detail.replace(f"[Rank {st.rank}]", "") == end.detail.replace(f"[Rank {first.rank}]", "")
        and st.end.call_site == end.call_site
    ]


def _mismatch_behind(job: JobState, state: RankState, ctx: Context, died_at: float) -> SlotId | None:
    """The mismatched slot this rank took part in just before it died, if any; or, for a rank the
    backend aborted, one of its groups' mismatched slots that others entered shortly before it
    died (gloo aborts the rank whose data does not fit: its own record of that call may never
    have been read, a collective issued from C++ known only from reads of its Flight Recorder)."""
    best: SlotId | None = None
    for group, seq in ctx.mismatched:
        hist = state.history.get(group)
        seqs = [c.seq for c in hist.view() if c.kind is r.OpKind.COLLECTIVE] if hist else []
        took_part = seq in seqs and state.reached.get(group, 0) - seq <= AFTERMATH_CALLS
        slots = job.slots.get(group)
        slot = slots.get(seq) if slots is not None else None
        aborted_in = (
            _aborted(state)
            and state.rank in job.members(group)
            and slot is not None
            and 0.0 <= died_at - slot.first_enter <= ABORT_AFTER_S
        )
        if (took_part or aborted_in) and (best is None or seq > best[1]):
            best = (group, seq)
    return best


def _aborted(state: RankState) -> bool:
    """Its process was killed by SIGABRT: what gloo (and NCCL's watchdog) do to a rank."""
    proc = state.proc
    return state.end is None and proc is not None and proc.signal == signal.SIGABRT


def _evidence_pending(job: JobState, first: RankState, died_at: float, now: float) -> bool:
    """A rank the backend aborted: whether the others' collectives up to its end are still to be
    known (their Flight Recorder reads, where one is read, asked before it died): a mismatch they
    show is its cause, and is to be found before its death is told."""
    if not _aborted(first) or now - died_at >= ABORT_EVIDENCE_S:
        return False
    return any(
        st is not first and st.end is None and st.alive and 0.0 < st.flight_to < died_at for st in job.ranks.values()
    )


def detect(job: JobState, ctx: Context) -> list[Finding]:
    ended = [
        (t, st)
        for st in job.ranks.values()
        if (st.end is not None or (st.proc is not None and st.proc.state in _GONE)) and (t := _end_time(st)) is not None
    ]
    if job.aborted_at is not None:  # ends caused by our own --abort-on-hang are not deaths
        aborted = job.aborted_at
        ended = [(t, st) for t, st in ended if _observed(st) < aborted]
    if not ended:
        return []
    ended.sort(key=lambda item: item[0])
    reaction = _launcher_reaction(ended)
    if reaction is not None:
        ended.insert(0, ended.pop(reaction))
    elif _peer_gone(ended[0][1]):
        # It raised because a peer had gone: that peer is the cause, though the agent, starved of
        # CPU, saw its process vanish later than the rank it left behind said it failed.
        # A rank stopped by a signal is that peer only if the job was being stopped as a whole: a
        # bystander torchrun stopped after the failures (the peer's end never seen) is not.
        near = [i for i, (t, st) in enumerate(ended) if not _peer_gone(st) and t - ended[0][0] <= JOB_STOP_WINDOW_S]
        went = next((i for i in near if _cause(ended[i][1]) != STOP), near[0] if near else None)
        if went is None:
            if ctx.now - ended[0][0] < JOB_STOP_WINDOW_S:
                return []  # the peer that went is yet to be seen gone
        elif (
            _cause(ended[went][1]) != STOP
            or _job_stopping(job, ctx, ended[went][1], ended[went][0])
            or _node_stopped(job, ended[went][1], ended[went][0], ended) is not None
        ):
            ended.insert(0, ended.pop(went))
    first_time, first = ended[0]
    running = [st for st in job.ranks.values() if _end_time(st) is None]
    clean = first.end is not None and first.end.kind in CLEAN
    if clean:
        # the ranks that left cleanly, in turn: one whose group-mates went on without it (a
        # rank that finished its program first, its work done, may not be the one they wait for)
        for t, st in ended:
            if st.end is not None and st.end.kind in CLEAN:
                findings = _early_exit(job, ctx, st, t, ended)
                if findings:
                    return findings
        return []
    if ctx.now - first_time < SETTLE_S or _evidence_pending(job, first, first_time, ctx.now):
        return []  # undecided yet: a stop's other ends, a mismatch's records, are on their way
    cause = _cause(first)
    if cause == STOP and _job_stopping(job, ctx, first, first_time):
        return []
    is_exception = first.end is not None and first.end.kind is r.EndKind.EXCEPTION
    if (
        cause != STOP
        and not is_exception
        and not running
        and reaction is None
        and all((st.end is None or _raced(st, first_time)) and abs(t - first_time) <= TOGETHER_S for t, st in ended)
        # a peer that raised counts as vanished only beside another that vanished without a word
        and (all(st.end is None for _, st in ended) or any(st.end is None for _, st in ended[1:]))
    ):
        return []  # every process vanished at once: the job was stopped (killed) as a whole
    affected = sorted(st.rank for _, st in ended[1:]) + sorted(st.rank for st in running)
    last = first.last_call
    in_call = f" inside {describe_call(last)}" if last is not None and last.exit_time is None else ""
    exit_details: dict[str, object] = {
        "kind": first.end.kind.value if first.end else "vanished",
        "detail": first.end.detail if first.end else "",
        "call_site": first.end.call_site if first.end else "",
        "exit_code": (first.end.exit_code if first.end else (first.proc.exit_code if first.proc else None)),
        "signal": first.proc.signal if first.proc else None,
        "oom_killed": bool(first.proc and first.proc.oom_killed),
        "time": first_time,
    }
    details: dict[str, object] = {
        "exit": exit_details,
        "affected": {str(st.rank): _death_text(st) for _, st in ended[1:]},
    }
    stack_ranks = [st.rank for st in running][:4]

    def died(
        culprits: list[int],
        waiting: list[int],
        summary: str,
        hint: str = "",
        aftermath_of: str = "",
        slot: tuple[str, int] | None = None,
    ) -> list[Finding]:
        group, seq = slot if slot is not None else ((last.group, last.seq) if last else ("", 0))
        return [
            Finding(
                kind=IncidentKind.RANK_DIED,
                key=incident_key(KeyFamily.DIED, session=first.identity.session),
                culprit_ranks=culprits,
                waiting_ranks=waiting,
                summary=summary,
                hint=hint,
                onset_time=first_time,
                op=last.op if last else "",
                group=group,
                seq=seq,
                step=first.step,
                details=details,
                aftermath_of=aftermath_of,
                stack_ranks=[] if aftermath_of else stack_ranks,
            )
        ]

    then_died = f"rank {first.rank} then died: {_death_text(first)}{in_call}"
    behind = _mismatch_behind(job, first, ctx, first_time)
    if behind is not None:
        # The backend crashed on the mismatch (gloo aborts on 10 vs 20 floats, float32 vs int64):
        # the mismatch is the root cause, the death its aftermath, told in the mismatch's incident.
        mismatch = incident_key(KeyFamily.MISMATCH, group=behind[0], seq=behind[1])
        return died([first.rank], affected, then_died, aftermath_of=mismatch, slot=behind)
    hang = ctx.hangs.get(first.rank)
    if hang is not None:
        # The rank was part of a hang already diagnosed (waiting in it, or its culprit): its death
        # now (NCCL's watchdog aborting at torch's timeout, the launcher giving up, a NCCL error
        # the hang surfaced) is that hang's aftermath, told in its incident, not a new root cause.
        return died([first.rank], affected, then_died, aftermath_of=hang)
    alike = _same_error(first, [st for _, st in ended[1:]])
    if alike:
        # The same exception at the same place on several ranks: each failed on its own (a
        # configuration error, a bad input every rank read), not because the first one left.
        culprits = sorted([first.rank, *alike])
        rest = [rk for rk in affected if rk not in alike]
        site = first.end.call_site if first.end is not None else ""
        summary = stories.same_error(culprits, first.end.detail if first.end is not None else "", site, rest)
        hint = stories.SAME_ERROR_HINT
        return died(culprits, rest, summary, hint)
    node = _node_stopped(job, first, first_time, ended)
    if node is not None:
        # every rank of one node stopped at once while the other nodes' ran on: the node, or its
        # launcher, was stopped from outside; the others' failures are its aftermath
        host, stopped = node
        rest = [rk for rk in affected if rk not in stopped]
        summary = stories.node_stopped(host, stopped, _stop_signal(first), rest)
        hint = stories.NODE_STOPPED_HINT
        return died(stopped, rest, summary, hint)
    summary = stories.died(first.rank, _death_text(first), in_call, affected)
    hint = stories.DIED_HINT
    return died([first.rank], affected, summary, hint)


def _early_exit(
    job: JobState, ctx: Context, first: RankState, first_time: float, ended: list[tuple[float, RankState]]
) -> list[Finding]:
    """The first rank to end left cleanly: a problem only if others were in a collective it skipped."""
    waiting: list[int] = []
    op = group = ""
    seq = 0
    # What C++ issued is known only from Flight Recorder reads. A leaver whose node agent reads
    # its rings gets one last read as it ends; where that read was not asked after its end (its
    # worker server did not answer within the farewell, on a loaded machine), its last C++
    # collectives are unknown, and another rank's C++ collective it seems not to have reached
    # proves nothing (a healthy DDP job was told an early exit so, its last buckets unread).
    end_time = first.end.time + first.clock_offset if first.end is not None else first_time
    blind = 0.0 < first.flight_to < end_time
    for st in job.ranks.values():
        if st is first:
            continue
        for call in st.history_calls_after(first_time - 1.0):
            if call.kind is r.OpKind.MARKER:
                continue
            if blind and call.source != "python":
                continue
            members = job.members(call.group)
            if members and first.rank not in members:
                continue
            if call.kind is r.OpKind.P2P:
                if call.peer != first.rank:
                    continue  # a send or recv with another rank (or any source): not the leaver's to answer
                reached = _answered(first, call)
            else:  # (not its history: a late Flight Recorder read may have pushed its last calls out)
                reached = first.reached.get(call.group, 0) >= call.seq
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
    why = ctx.cache.stories.absent(job, group, first.rank, sorted(waiting), len(job.members(group)))
    details: dict[str, object] = {"exit": {"kind": end.kind.value, "call_site": end.call_site, "step": first.step}}
    kind, hint, step = IncidentKind.EARLY_EXIT, EARLY_EXIT_HINT, first.step
    summary = stories.left_early(first.rank, first.step, end, sorted(waiting), op, group, seq)
    culprits, others = [first.rank], sorted(waiting)
    if why is not None:  # it did not leave the loop: it skipped a call and ran out, or they made one more
        kind, hint = IncidentKind.STUCK_COLLECTIVE, stories.SKIPPED_HINT if why.skipped else stories.EXTRA_HINT
        step = int(str(why.facts.get("step", step)))
        details["skipped" if why.skipped else "edit"] = why.facts
        if not why.skipped:
            culprits, others = why.culprits, [first.rank]
        summary = stories.ran_out_then_ended(sorted(waiting), op, group, seq, first.rank, why.clause, end)
    return [
        Finding(
            kind=kind,
            key=incident_key(KeyFamily.EARLY_END, session=first.identity.session),
            culprit_ranks=culprits,
            waiting_ranks=others,
            summary=summary,
            hint=hint,
            onset_time=first_time,
            op=op,
            group=group,
            seq=seq,
            step=step,
            details=details,
            stack_ranks=sorted(waiting)[:2],
        )
    ]
