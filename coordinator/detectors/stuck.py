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

from hangwatch import records as r
from hangwatch.coordinator.detectors import Context, slot_key
from hangwatch.coordinator.detectors.describe import doing
from hangwatch.coordinator.incidents import Finding
from hangwatch.coordinator.rules import describe_call, format_ranks
from hangwatch.coordinator.state import JobState, RankState, Slot

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
            waiting = [rk for rk, c in slot.calls.items() if c.exit_time is None]
            if not waiting:
                continue
            key = slot_key(group, seq)
            oldest = min(slot.calls[rk].enter_time for rk in waiting)
            if ctx.now - oldest < ctx.stuck_after or key in ctx.claimed:
                break  # later slots of this group are younger; this one is not a hang (yet)
            finding = _diagnose(job, ctx, slot, members, waiting)
            if finding is not None:
                findings.append(finding)
            break  # one hang per group: the oldest unresolved slot is the root
    return findings


def _diagnose(job: JobState, ctx: Context, slot: Slot, members: tuple[int, ...], waiting: list[int]) -> Finding | None:
    absent = [m for m in members if m not in slot.calls]
    sample = slot.calls[waiting[0]]
    op = sample.op
    waited = ctx.now - min(slot.calls[rk].enter_time for rk in waiting)
    key = slot_key(slot.group, slot.seq)
    base = {
        "op": op,
        "group": slot.group,
        "seq": slot.seq,
        "step": max(c.step for c in slot.calls.values()),
        "onset_time": slot.last_enter if not absent else min(slot.calls[rk].enter_time for rk in waiting),
    }
    calls = {str(rk): describe_call(c) for rk, c in sorted(slot.calls.items())}
    if not absent:
        if not members:
            return None  # membership unknown: "every member entered" cannot be told
        if any(c.source != "python" for c in slot.calls.values()):
            return None  # completion of C++-issued calls is not observable precisely enough
        if any(c.exit_time is not None for c in slot.calls.values()):
            return None  # someone returned: the others are being delivered, not stalled
        return Finding(
            kind="transport_stall",
            key=f"stall:{key}",
            culprit_ranks=[],
            waiting_ranks=sorted(waiting),
            summary=(
                f"all {len(members)} ranks of group {slot.group} entered {op} (seq {slot.seq}) with matching "
                f"arguments and none has returned after {waited:.0f} s: the transport is stalled"
            ),
            hint=(
                "The ranks agree, so the backend is stuck: check the network (NCCL_DEBUG=INFO, "
                "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), a failed NIC or switch, or a GPU that stopped "
                "responding; the native stacks show where each rank waits."
            ),
            details={"calls": calls, "waited_s": round(waited, 1)},
            stack_ranks=sorted(waiting)[:8],
            native=True,
            **base,  # type: ignore[arg-type]
        )
    states = {rk: job.ranks.get(rk) for rk in absent}
    if any(s is None for s in states.values()):
        unregistered = [rk for rk, s in states.items() if s is None]
        return Finding(
            kind="stuck_collective",
            key=f"stuck:{key}",
            culprit_ranks=unregistered,
            waiting_ranks=sorted(waiting),
            summary=(
                f"ranks {format_ranks(sorted(waiting))} wait in {op} (group {slot.group}, seq {slot.seq}) for "
                f"{waited:.0f} s; rank(s) {format_ranks(unregistered)} never registered with hangwatch"
            ),
            hint="Check that every rank started and has HANGWATCH_ADDR set; look at its launcher's logs.",
            details={"calls": calls, "waited_s": round(waited, 1)},
            stack_ranks=sorted(waiting)[:2],
            **base,  # type: ignore[arg-type]
        )
    present = {rk: s for rk, s in states.items() if s is not None}
    if any(not s.alive for s in present.values()):
        return None  # rank_died explains it
    if any(s.end is None and _silent(s, ctx) for s in present.values()):
        return None  # rank_frozen explains it (or will, once the silence lasts silence_after)
    doings = {rk: doing(s, ctx.now) for rk, s in present.items()}
    left = [
        rk
        for rk, s in present.items()
        if (s.end is not None and s.end.kind in (r.EndKind.CLEAN_EXIT, r.EndKind.DESTROYED))
        or (
            s.oldest_open() is not None
            and s.oldest_open().op in ("barrier", "monitored_barrier")  # type: ignore[union-attr]
            and op not in ("barrier", "monitored_barrier")
        )
    ]
    who = format_ranks(sorted(absent))
    waiting_txt = format_ranks(sorted(waiting))
    if left and len(left) == len(absent):
        last_steps = sorted({present[rk].step for rk in absent})
        absent_text = "; ".join(f"rank {rk} {d}" for rk, d in sorted(doings.items()))
        return Finding(
            kind="early_exit",
            key=f"early:{key}",
            culprit_ranks=sorted(absent),
            waiting_ranks=sorted(waiting),
            summary=(
                f"rank{'s' if len(absent) > 1 else ''} {who} left the training loop at step "
                f"{', '.join(map(str, last_steps))} ({absent_text}) "
                f"while rank{'s' if len(waiting) > 1 else ''} {waiting_txt} entered {op} "
                f"(group {slot.group}, seq {slot.seq}) and wait for {waited:.0f} s"
            ),
            hint=EARLY_EXIT_HINT,
            details={"calls": calls, "absent": {str(k): v for k, v in doings.items()}, "waited_s": round(waited, 1)},
            stack_ranks=sorted(absent) + sorted(waiting)[:1],
            **base,  # type: ignore[arg-type]
        )
    return Finding(
        kind="stuck_collective",
        key=f"stuck:{key}",
        culprit_ranks=sorted(absent),
        waiting_ranks=sorted(waiting),
        summary=(
            f"rank{'s' if len(waiting) > 1 else ''} {waiting_txt} wait{'' if len(waiting) > 1 else 's'} in {op} "
            f"(group {slot.group}, seq {slot.seq}) at {sample.call_site or '?'} for {waited:.0f} s; "
            + "; ".join(f"rank {rk} {d}" for rk, d in sorted(doings.items()))
        ),
        hint=(
            f"Rank{'s' if len(absent) > 1 else ''} {who} never reached this {op}. Look at "
            f"{'their' if len(absent) > 1 else 'its'} stack below: work that only some ranks do (a checkpoint "
            "save or evaluation on rank 0, a data loader that stalls, a conditional branch) must either be "
            "done by every rank or finish before the others' next collective; if it is legitimately long, "
            "raise --stuck-after."
        ),
        details={"calls": calls, "absent": {str(k): v for k, v in doings.items()}, "waited_s": round(waited, 1)},
        stack_ranks=sorted(absent) + sorted(waiting)[:1],
        **base,  # type: ignore[arg-type]
    )
