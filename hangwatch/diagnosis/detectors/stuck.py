"""Hangs in a collective: some members wait, others never arrive (or nobody completes).

- ``stuck_collective``: members waited longer than the stuck threshold at (group, seq) while
  others have not entered it. Culprits are the absent ranks; the diagnosis says what they are
  doing instead (heartbeat frame, open calls elsewhere).
- ``early_exit``: the absent ranks have left the loop: they ended cleanly, destroyed the group,
  or wait in a barrier of their own.
- ``transport_stall``: every member entered the same call and none returned; on NCCL, where a
  call returns when it is enqueued: every member has it started on the GPU (or, start events
  off, enqueued with nothing before it left for ``config.STALL_UNSTARTED_S``) and none completed.
Dead and frozen absentees are left to their own detectors.

On NCCL a rank "waits" in a collective from its enqueue to its completion on the GPU, whatever its
host thread does meanwhile (``CallRecord.returned_time``; see ``JobState.awaits_completion``):
the report says where that host thread is (usually the next CUDA synchronisation, ``.item()``)
and when torch's own watchdog will give up.
"""

from __future__ import annotations

from hangwatch import catalogue, config, kinds
from hangwatch import records as r
from hangwatch.diagnosis import waits
from hangwatch.diagnosis.detectors import Context, horizon, joins
from hangwatch.diagnosis.incidents import Finding, IncidentKind, KeyFamily, incident_key, unscoped
from hangwatch.diagnosis.state import JobState, RankState, Slot
from hangwatch.model.waitfor import Graph, Stand
from hangwatch.wording import describe_call, doing, gpu_load, joining, stories

EARLY_EXIT_HINT = kinds.hint(IncidentKind.EARLY_EXIT)


def detect(job: JobState, ctx: Context) -> list[Finding]:
    """One hang per group, the oldest unresolved slot of each, diagnosed oldest first: a hang
    whose absent ranks' waits all end in another hang (ranks stuck in a subgroup's collective
    never reach the world barrier a third rank waits in; two stages that both send first) is
    that hang's aftermath, told in its incident, not a root cause of its own. None while the
    coordinator runs ``horizon.BEHIND_HOLD_S`` behind (``status`` says so)."""
    if ctx.behind >= horizon.BEHIND_HOLD_S:
        return []
    # (NCCL) calls that came in runs and a device holds below those slots, waiting as long as
    # the threshold, are open calls already, as they would have been call by call
    # (``JobState.before_detection``, before the detectors run)
    candidates = _candidates(job, ctx)
    found = []
    for _, slot, members, waiting in sorted(candidates, key=lambda c: c[0]):
        finding = _diagnose(job, ctx, slot, members, waiting)
        told = ctx.told.get((slot.group, slot.seq))
        if finding is not None and (told is None or finding.key == told[0]):
            found.append(finding)  # (a slot told before: in its own incident, never another)
    if not found:
        return []
    graph = waits.graph(job, ctx.now, ctx.silence_after + ctx.behind)  # its lateness: no rank frozen

    def blames_where_waits_end(finding: Finding) -> bool:
        ends = graph.reached(finding.culprit_ranks)
        return all(set(h.ranks) <= set(finding.culprit_ranks) for h in ends)

    # the hangs whose culprits are where the waits end are told first, whatever their age: a
    # subgroup's older all_reduce held up by a rank stuck in a younger one is that one's aftermath
    hung = dict(ctx.hangs)  # rank -> the hang it is part of (open incidents, then this tick's)
    findings: list[Finding] = []

    def culprits_waiting(finding: Finding) -> int:
        return sum(graph.stand(rk) is Stand.WAITING for rk in finding.culprit_ranks)

    for finding in sorted(found, key=lambda f: (not blames_where_waits_end(f), culprits_waiting(f))):
        root = _root(graph, finding.culprit_ranks, hung)
        if (finding.group, finding.seq) in ctx.told:  # its own incident, told again with who came since
            if root and unscoped(root) != finding.key:
                continue  # (its culprits now wait in another hang: told there, not twice)
            root = ""
        if not root and _held_by_younger(job, ctx, finding):
            continue  # told next, as the aftermath of the hang its culprits' waits end in
        if not root and horizon.held_for_traces(job, ctx, finding):
            continue  # the culprits' C++ calls since the wait began are not read yet
        if root and root != finding.key:
            finding.aftermath_of = root
        else:
            for rk in finding.culprit_ranks + finding.waiting_ranks:
                hung.setdefault(rk, finding.key)
        findings.append(finding)
    return findings


def _held_by_younger(job: JobState, ctx: Context, finding: Finding) -> bool:
    """Whether the finding's culprits wait in calls younger than the threshold (ranks 2 and 3
    in a barrier that rank 0 never reaches, rank 0 in a subgroup's all_reduce a moment younger,
    held up by rank 1): the hang those waits end in is told first once it is due, this one as its
    aftermath. For one more threshold at most: a culprit always in some young call (a loop of
    its own) is blamed then."""
    if ctx.now - finding.onset_time >= 2 * ctx.stuck_after:
        return False
    for rank in finding.culprit_ranks:
        st = job.ranks.get(rank)
        if st is None or st.end is not None or not st.alive:
            continue
        if any(ctx.now - c.enter_time < ctx.stuck_after for c in st.open_calls.values()):
            return True
    return False


def _doing(st: RankState, now: float) -> str:
    """What an absent rank is doing: where its own processes it waits for are (an edge of the
    wait-for graph to them, from a stack dumped since its last progress), else its own word."""
    blocked = st.oldest_open()
    if st.end is None and blocked is None and st.waits_for and st.waits_for_at >= st.last_progress:
        return stories.waits_for_own(st.where_user, st.waits_for)
    return doing(st.end, blocked, st.where, st.where_user, now)


def _root(graph: Graph, culprits: list[int], hung: dict[int, str]) -> str:
    """The one hang already told that the culprits' waits all end in ("": none, or several)."""
    ends = graph.reached(culprits)
    if not ends:
        roots = {hung.get(rk, "") for rk in culprits}  # no wait known: the culprits themselves
    else:
        # a sink is told by the incident that blames it; a cycle by the one its ranks are all in
        roots = {owners.pop() if len(owners := {hung.get(rk, "") for rk in h.ranks}) == 1 else "" for h in ends}
    return roots.pop() if len(roots) == 1 else ""


def _candidates(job: JobState, ctx: Context) -> list[tuple[float, Slot, tuple[int, ...], list[int]]]:
    """Each group's oldest unresolved slot, where it has waited the threshold: (its oldest
    wait's start, the slot, the group's members, the ranks waiting in it)."""
    candidates: list[tuple[float, Slot, tuple[int, ...], list[int]]] = []
    for group, slots in job.slots.items():
        for seq, slot in slots.items():
            if not slot.open:
                continue
            waiting = [rk for rk, c in slot.calls.items() if c.exit_time is None]
            if not waiting:
                continue
            if any(not st.alive for rk in waiting if (st := job.ranks.get(rk)) is not None):
                # a rank died inside it: the call never returns, and its end explains the slot
                # (rank_died, or nothing at all where the whole job was stopped mid-call)
                continue
            oldest = min(slot.calls[rk].enter_time for rk in waiting)
            if (
                ctx.now - oldest >= ctx.stuck_after
                and ((group, seq) not in ctx.claimed or horizon.more_waiting(ctx, group, seq, waiting))
                and horizon.still_waiting(job, waiting) >= oldest + ctx.stuck_after - horizon.HEARD_WITHIN_S
                and not horizon.waits_unread(job, ctx, slot, waiting, oldest)
            ):
                candidates.append((oldest, slot, job.members(group), waiting))
            break  # later slots of this group are younger: the oldest unresolved slot is the root
    return candidates


BARRIERS = catalogue.record_names([catalogue.Kind.BARRIER])
KEY_FAMILY = {
    IncidentKind.STUCK_COLLECTIVE: KeyFamily.STUCK,
    IncidentKind.EARLY_EXIT: KeyFamily.EARLY,
    IncidentKind.TRANSPORT_STALL: KeyFamily.STALL,
}


def _left_the_loop(state: RankState, op: str, group: str) -> bool:
    """Ended cleanly, waits in a barrier of its own while the others are in something else, or
    is busy outside any call and no longer in the function its last collective on ``group``
    came from."""
    if state.end is not None:
        return state.end.kind in (r.EndKind.CLEAN_EXIT, r.EndKind.DESTROYED)
    blocked = state.oldest_open()
    if blocked is not None:
        return blocked.op in BARRIERS and op not in BARRIERS
    return _left_function(state, group) is not None


def _function(site: str) -> tuple[str, str] | None:
    """``train.py:12 in train`` -> ``("train.py", "train")`` (None: not a site of that form)."""
    where, sep, function = site.rpartition(" in ")
    return (where.rsplit(":", 1)[0], function) if sep and where else None


def _last_on(state: RankState, group: str) -> r.CallRecord | None:
    hist = state.history.get(group)
    return hist[-1] if hist else None


def _left_function(state: RankState, group: str) -> str | None:
    """The function the rank's last collective on ``group`` came from, where the rank's program
    is no longer in it (its latest stack): it returned from the function holding its loop. None
    where it is, where that function is a script's top level (a loop there is never left that
    way), or where its stack is not known. (Its last call on another group may come from a side
    thread, a metrics loop, that the main thread's stack is never in.)"""
    last = _last_on(state, group)
    if last is None or not state.where_stack:
        return None
    home = _function(last.call_site)
    if home is None or home[1] == "<module>":
        return None
    return None if home in {_function(f) for f in state.where_stack} else home[1]


def _device_clause(
    job: JobState, slot: Slot, waiting: list[int], now: float
) -> tuple[str, dict[int, str], float] | None:
    """For waiting ranks whose host returned from the call while the GPU has not completed it
    (NCCL): a clause saying so and where each host thread is, those places by rank, and when
    torch's own watchdog gives up (0: unknown). None when no waiting rank is in that state."""
    hosts: dict[int, str] = {}
    timeout_at = 0.0
    for rk in waiting:
        call = slot.calls[rk]
        st = job.ranks.get(rk)
        if call.returned_time is None or st is None:
            continue
        hosts[rk] = st.where_user or st.where or "?"
        progress = st.progress.get(slot.group)
        if progress is not None and progress.timeout_ms > 0:
            due = call.enter_time + progress.timeout_ms / 1000
            timeout_at = due if not timeout_at else min(timeout_at, due)
    if not hosts:
        return None
    return stories.held_on_gpu(hosts, timeout_at, now), hosts, timeout_at


def _started_everywhere(job: JobState, slot: Slot, ctx: Context) -> str | None:
    """Whether a slot every member is in can be called a transport stall. Calls the host thread
    is still inside: yes (gloo, or NCCL blocking in the call). Calls on the GPU: when every
    member's progress shows it started there; with start events off, when nothing before it is
    left (every member completed its previous seq) and it has waited ``config.STALL_UNSTARTED_S``
    and 4x the stuck threshold. Returns how it was told ("" for host calls), None for no."""
    on_device = [rk for rk, c in slot.calls.items() if c.returned_time is not None]
    if not on_device:
        return ""
    unknown = False
    for rk in on_device:
        st = job.ranks.get(rk)
        progress = None if st is None else st.progress.get(slot.group)
        if progress is None:
            return None
        if progress.started >= slot.seq:
            continue
        if progress.started >= 0 or progress.completed < slot.seq - 1:
            return None  # start events on and not started, or something before it is left
        unknown = True
    if not unknown:
        return "started on every rank"
    waited = ctx.now - slot.last_enter
    if waited < max(config.STALL_UNSTARTED_S, 4 * ctx.stuck_after):
        return None
    return "nothing queued before it; whether it started is unknown without TORCH_NCCL_ENABLE_TIMING=1"


def _unseen(job: JobState, slot: Slot, absent: list[int]) -> list[int]:
    """The absent ranks whose node agent found them inside an op on the slot's group that no
    Flight Recorder read showed (its entry overwritten before it was read, ``RankState.unseen``):
    not known to be absent, and not known to be anywhere else."""
    return [
        rk
        for rk in absent
        if (st := job.ranks.get(rk)) is not None and st.end is None and st.alive and slot.group in st.unseen
    ]


def _diagnose(job: JobState, ctx: Context, slot: Slot, members: tuple[int, ...], waiting: list[int]) -> Finding | None:
    absent = [m for m in members if m not in slot.calls]
    inside = _unseen(job, slot, absent)
    if inside and len(inside) == len(absent):
        return None  # every member is in a collective of the group: nothing known to blame
    absent = [rk for rk in absent if rk not in inside]
    waiting = sorted(waiting)
    sample = slot.calls[waiting[0]]
    op = sample.op
    entered = min(slot.calls[rk].enter_time for rk in waiting)
    waited = ctx.now - entered
    where = f"{op} (group {slot.group}, seq {slot.seq})"
    details: dict[str, object] = {"waited_s": round(waited, 1)}
    clause = ""
    if inside:
        details["unseen"] = inside
        clause = stories.inside_unread(inside, slot.group)
    if slot.seq == 1 and any(st.identity.backend == "nccl" for rk in waiting if (st := job.ranks.get(rk))):
        # NCCL creates a group's communicator in its first collective (unless init_process_group
        # made it eagerly, with device_id): the ranks there may wait on one that never forms
        details["communicator"] = "created in this collective"
        clause += stories.COMMUNICATOR_CLAUSE

    def finding(
        kind: IncidentKind,
        culprits: list[int],
        summary: str,
        hint: str,
        stack_ranks: list[int],
        native: bool = False,
        others: list[int] | None = None,
    ) -> Finding:
        # built only for a finding: a slot of thousands of calls is examined every tick
        details["calls"] = {str(rk): describe_call(c) for rk, c in sorted(slot.calls.items())}
        return Finding(
            kind=kind,
            key=incident_key(KEY_FAMILY[kind], group=slot.group, seq=slot.seq),
            culprit_ranks=culprits,
            waiting_ranks=sorted(waiting + inside) if others is None else others,
            summary=summary + clause,
            hint=hint,
            onset_time=slot.last_enter if not absent else entered,
            op=op,
            group=slot.group,
            seq=slot.seq,
            step=max(c.step for c in slot.calls.values()),
            details=details,
            stack_ranks=stack_ranks,
            native=native,
        )

    device = _device_clause(job, slot, waiting, ctx.now)
    if device:
        details["host"] = {str(rk): text for rk, text in device[1].items()}
    if device and device[2]:
        details["timeout_at"] = device[2]
    load = gpu_load({rk: st.proc for rk in members or waiting if (st := job.ranks.get(rk)) is not None})
    if load:
        details["gpus"] = load
        device = (f"{device[0]}; GPUs: {load}", device[1], device[2]) if device else (f"GPUs: {load}", {}, 0.0)

    if not absent:
        if not members:
            return None  # membership unknown: "every member entered" cannot be told
        if any(c.source != "python" for c in slot.calls.values()):
            return None  # completion of C++-issued calls is not observable precisely enough
        if any(c.exit_time is not None for c in slot.calls.values()):
            return None  # someone returned: the others are being delivered, not stalled
        started = _started_everywhere(job, slot, ctx)
        if started is None:
            return None  # queued behind the GPU's other work, as far as can be told
        how = "returned" if not device else f"completed on the GPU ({started})"
        return finding(
            IncidentKind.TRANSPORT_STALL,
            [],
            stories.transport_stalled(len(members), slot.group, op, slot.seq, how, waited, device[0] if device else ""),
            stories.TRANSPORT_STALL_HINT,
            waiting[:8],
            native=True,
        )
    states = {rk: job.ranks.get(rk) for rk in absent}
    unregistered = [rk for rk, st in states.items() if st is None]
    if unregistered and job.from_dumps and len(unregistered) < len(absent):
        # a post-mortem: the ranks whose dumps show them absent are the story; those that wrote
        # none are unknown, not culprits (``hangwatch.postmortem`` says they are missing)
        absent = [rk for rk in absent if rk not in unregistered]
        states = {rk: st for rk, st in states.items() if st is not None}
        unregistered = []
    if unregistered and job.from_dumps:
        return finding(
            IncidentKind.STUCK_COLLECTIVE,
            unregistered,
            stories.waiting_in(waiting, where, waited) + stories.no_dump(unregistered),
            stories.NO_DUMP_HINT,
            [],
        )
    if unregistered and all(rk in job.joining for rk in unregistered):
        # started as ranks, not joined: where their processes are (the model's edge to them)
        told = "; ".join(joins.joiner_story(job.joining[rk]) for rk in unregistered)
        return finding(
            IncidentKind.STUCK_COLLECTIVE,
            unregistered,
            stories.waiting_in(waiting, where, waited) + "; " + told,
            joining.JOIN_HINT,
            [rk for rk in unregistered if job.joining[rk].identity.phase == r.STARTING] + waiting[:1],
        )
    if unregistered:
        return finding(
            IncidentKind.STUCK_COLLECTIVE,
            unregistered,
            stories.waiting_in(waiting, where, waited) + stories.never_registered(unregistered),
            stories.NEVER_REGISTERED_HINT,
            waiting[:2],
        )
    present = {rk: st for rk, st in states.items() if st is not None}
    if any(not st.alive for st in present.values()):
        return None  # rank_died explains it
    if any(st.end is None and horizon.silent(st, ctx) for st in present.values()):
        return None  # rank_frozen explains it (or will, once the silence lasts silence_after)
    # The latest batch we have from an absent rank must have left it after the others entered,
    # else its absence is not known yet (batches travel for up to a report interval, more
    # through a relay or a busy coordinator; thousands of ranks report every 2 s). A collective
    # issued from C++ is known only from a Flight Recorder read of the rank (``flight_to``: its
    # node agent says when the latest was asked; reads are spaced by their cost, and spared where
    # Python calls account for them), or, where no agent says, up to one poll later. A read
    # shows only that the rank had not arrived when it was asked: one asked just after the
    # others entered says nothing of the seconds since (on a loaded machine a rank's reads came
    # seconds apart, and a rank that arrived right after one was blamed at the stuck threshold).
    # The rank's absence is known from a read asked half the threshold after the others entered.
    # Reads that stopped coming (a worker server that no longer answers) say nothing: then the
    # allowance is what it is where no agent says.
    cxx = any(c.source != "python" for c in slot.calls.values())
    for st in present.values():
        if st.end is not None:
            continue
        if st.last_sent < slot.first_enter:
            return None
        if cxx and not horizon.read_since(st, slot.first_enter, ctx):
            return None
    doings = {rk: _doing(st, ctx.now) for rk, st in sorted(present.items())}
    details["absent"] = {str(rk): text for rk, text in doings.items()}
    absent_text = "; ".join(f"rank {rk} {text}" for rk, text in doings.items())
    stack_ranks = absent + waiting[:1]
    if len(absent) == 1 and absent[0] in present:
        # where its trace parts from theirs: a skip it ran out after, or their extra call
        why = ctx.cache.stories.absent(job, slot.group, absent[0], waiting, len(members))
        if why is not None:
            details["skipped" if why.skipped else "edit"] = why.facts
            return finding(
                IncidentKind.STUCK_COLLECTIVE,
                why.culprits,
                stories.waiting_in(waiting, where, waited)
                + stories.will_never_make_it(absent[0], why.clause, doings[absent[0]])
                + stories.then(device[0] if device else ""),
                stories.SKIPPED_HINT if why.skipped else stories.EXTRA_HINT,
                stack_ranks,
                others=None if why.skipped else absent,  # their extra call: the absent rank did right
            )
    if all(_left_the_loop(st, op, slot.group) for st in present.values()):
        steps = ", ".join(str(step) for step in sorted({st.step for st in present.values()}))
        busy = [(rk, fn) for rk, st in present.items() if st.end is None and (fn := _left_function(st, slot.group))]
        if len(busy) == 1 and len(present) == 1:
            # alive, and out of the function its loop's calls came from: it left the loop and
            # went on to what comes after it (an export, a checkpoint of its own)
            rk, fn = busy[0]
            st = present[rk]
            last = _last_on(st, slot.group)
            assert last is not None
            text = stories.left_its_loop(rk, steps, fn, last, doings[rk])
        else:
            text = stories.left_the_loop(absent, steps, absent_text)
        return finding(
            IncidentKind.EARLY_EXIT,
            absent,
            f"{text} while " + stories.entered_and_wait(waiting, where, sample.call_site, waited),
            EARLY_EXIT_HINT,
            stack_ranks,
        )
    return finding(
        IncidentKind.STUCK_COLLECTIVE,
        absent,
        stories.waiting_in(waiting, where, waited, sample.call_site)
        + f"; {absent_text}"
        + stories.then(device[0] if device else ""),
        stories.never_reached_hint(absent, op),
        stack_ranks,
    )
