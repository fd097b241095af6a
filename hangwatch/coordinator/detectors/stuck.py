"""Hangs in a collective: some members wait, others never arrive (or nobody completes).

- ``stuck_collective``: members waited longer than the stuck threshold at (group, seq) while
  others have not entered it. Culprits are the absent ranks; the diagnosis says what they are
  doing instead (heartbeat frame, open calls elsewhere).
- ``early_exit``: the absent ranks have left the loop: they ended cleanly, destroyed the group,
  or wait in a barrier of their own.
- ``transport_stall``: every member entered the same call and none returned.
Dead and frozen absentees are left to their own detectors.
"""

from __future__ import annotations

from hangwatch import catalogue, config
from hangwatch import records as r
from hangwatch.coordinator.detectors import Context
from hangwatch.coordinator.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.coordinator.state import JobState, RankState, Slot
from hangwatch.wording import describe_call, doing, format_ranks

EARLY_EXIT_HINT = (
    "Stop every rank at the same step: make the stop decision collectively (all_reduce the stop "
    "flag with ReduceOp.MAX and break on the result), or with Accelerate use "
    "accelerator.set_trigger() on the rank that wants to stop and accelerator.check_trigger() in "
    "every rank's loop."
)


#: Heartbeats come every second; a rank silent this long may be frozen (the frozen detector
#: decides at ``silence_after``), so a hang it is absent from is not yet blamed on it.
SUSPECT_SILENCE_S = 2.5


def _silent(state: RankState, ctx: Context) -> bool:
    return ctx.now - state.last_seen > min(ctx.silence_after, SUSPECT_SILENCE_S)


def detect(job: JobState, ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    for group, slots in job.slots.items():
        members = job.members(group)
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
            if ctx.now - oldest < ctx.stuck_after or (group, seq) in ctx.claimed:
                break  # later slots of this group are younger; this one is not a hang (yet)
            finding = _diagnose(job, ctx, slot, members, waiting)
            if finding is not None:
                findings.append(finding)
            break  # one hang per group: the oldest unresolved slot is the root
    return findings


BARRIERS = catalogue.record_names([catalogue.Kind.BARRIER])
KEY_FAMILY = {
    IncidentKind.STUCK_COLLECTIVE: KeyFamily.STUCK,
    IncidentKind.EARLY_EXIT: KeyFamily.EARLY,
    IncidentKind.TRANSPORT_STALL: KeyFamily.STALL,
}


def _left_the_loop(state: RankState, op: str) -> bool:
    """Ended cleanly, or waits in a barrier of its own while the others are in something else."""
    if state.end is not None:
        return state.end.kind in (r.EndKind.CLEAN_EXIT, r.EndKind.DESTROYED)
    blocked = state.oldest_open()
    return blocked is not None and blocked.op in BARRIERS and op not in BARRIERS


def _diagnose(job: JobState, ctx: Context, slot: Slot, members: tuple[int, ...], waiting: list[int]) -> Finding | None:
    absent = [m for m in members if m not in slot.calls]
    waiting = sorted(waiting)
    sample = slot.calls[waiting[0]]
    op = sample.op
    entered = min(slot.calls[rk].enter_time for rk in waiting)
    waited = ctx.now - entered
    where = f"{op} (group {slot.group}, seq {slot.seq})"
    details: dict[str, object] = {"waited_s": round(waited, 1)}

    def finding(
        kind: IncidentKind,
        culprits: list[int],
        summary: str,
        hint: str,
        stack_ranks: list[int],
        native: bool = False,
    ) -> Finding:
        # built only for a finding: a slot of thousands of calls is examined every tick
        details["calls"] = {str(rk): describe_call(c) for rk, c in sorted(slot.calls.items())}
        return Finding(
            kind=kind,
            key=incident_key(KEY_FAMILY[kind], group=slot.group, seq=slot.seq),
            culprit_ranks=culprits,
            waiting_ranks=waiting,
            summary=summary,
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

    if not absent:
        if not members:
            return None  # membership unknown: "every member entered" cannot be told
        if any(c.source != "python" for c in slot.calls.values()):
            return None  # completion of C++-issued calls is not observable precisely enough
        if any(c.exit_time is not None for c in slot.calls.values()):
            return None  # someone returned: the others are being delivered, not stalled
        return finding(
            IncidentKind.TRANSPORT_STALL,
            [],
            f"all {len(members)} ranks of group {slot.group} entered {op} (seq {slot.seq}) with matching "
            f"arguments and none has returned after {waited:.0f} s: the transport is stalled",
            "The ranks agree, so the backend is stuck: check the network (NCCL_DEBUG=INFO, "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), a failed NIC or switch, or a GPU that stopped "
            "responding; the native stacks show where each rank waits.",
            waiting[:8],
            native=True,
        )
    states = {rk: job.ranks.get(rk) for rk in absent}
    unregistered = [rk for rk, st in states.items() if st is None]
    if unregistered:
        return finding(
            IncidentKind.STUCK_COLLECTIVE,
            unregistered,
            f"ranks {format_ranks(waiting)} wait in {where} for {waited:.0f} s; rank(s) "
            f"{format_ranks(unregistered)} never registered with hangwatch",
            "Check that every rank started and has HANGWATCH_ADDR set; look at its launcher's logs.",
            waiting[:2],
        )
    present = {rk: st for rk, st in states.items() if st is not None}
    if any(not st.alive for st in present.values()):
        return None  # rank_died explains it
    if any(st.end is None and _silent(st, ctx) for st in present.values()):
        return None  # rank_frozen explains it (or will, once the silence lasts silence_after)
    # The latest batch we have from an absent rank must have left it after the others entered,
    # else its absence is not known yet (batches travel for up to a report interval, more
    # through a relay or a busy coordinator; thousands of ranks report every 2 s). A collective
    # issued from C++ is known only from the rank's next Flight Recorder read, up to one poll later.
    known_from = slot.first_enter
    if any(c.source != "python" for c in slot.calls.values()):
        known_from += config.FR_POLL_INTERVAL_S
    if any(st.end is None and st.last_sent < known_from for st in present.values()):
        return None
    doings = {
        rk: doing(st.end, st.oldest_open(), st.where, st.where_user, ctx.now) for rk, st in sorted(present.items())
    }
    details["absent"] = {str(rk): text for rk, text in doings.items()}
    absent_text = "; ".join(f"rank {rk} {text}" for rk, text in doings.items())
    plural = len(absent) > 1
    who = format_ranks(absent)
    stack_ranks = absent + waiting[:1]
    if all(_left_the_loop(st, op) for st in present.values()):
        steps = ", ".join(str(step) for step in sorted({st.step for st in present.values()}))
        return finding(
            IncidentKind.EARLY_EXIT,
            absent,
            f"rank{'s' if plural else ''} {who} left the training loop at step {steps} ({absent_text}) while "
            f"rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} entered {where} and wait for "
            f"{waited:.0f} s",
            EARLY_EXIT_HINT,
            stack_ranks,
        )
    return finding(
        IncidentKind.STUCK_COLLECTIVE,
        absent,
        f"rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} wait{'' if len(waiting) > 1 else 's'} in "
        f"{where} at {sample.call_site or '?'} for {waited:.0f} s; {absent_text}",
        f"Rank{'s' if plural else ''} {who} never reached this {op}. Look at {'their' if plural else 'its'} stack "
        "below: work that only some ranks do (a checkpoint save or evaluation on rank 0, a data loader that "
        "stalls, a conditional branch) must either be done by every rank or finish before the others' next "
        "collective; if it is legitimately long, raise --stuck-after.",
        stack_ranks,
    )
