"""Ranks that called different things at the same (group, seq): op, shape, dtype, arguments.

Checked as soon as a second rank reaches a slot (so within the detection tick of the last
involved call), whatever the backend then does with the call: hang, crash or silent success.
Also: the same group name with different member ranks on different ranks (``new_group`` called
in a different order).
"""

from __future__ import annotations

import itertools

from hangwatch.coordinator.detectors import Context, slot_key
from hangwatch.coordinator.detectors.stuck import BARRIERS, EARLY_EXIT_HINT
from hangwatch.coordinator.incidents import Finding, IncidentKind
from hangwatch.coordinator.rules import compare_collective, explain_extra_call, format_ranks
from hangwatch.coordinator.state import JobState


def detect(job: JobState, ctx: Context) -> list[Finding]:
    if job.groups_changed:  # compare memberships only when a rank created or destroyed a group
        job.groups_changed = False
        job.membership_mismatches = _group_membership(job)
    findings = list(job.membership_mismatches)
    changed = job.changed_slots
    job.changed_slots = set()
    for group, seq in sorted(changed):
        slot = job.slots[group].get(seq) if group in job.slots else None
        if slot is None or len(slot.calls) < 2 or len(slot.calls) == slot.checked:
            continue
        size = len(job.members(group))
        if slot.uniform and slot.checked >= 2 and slot.checked_size == size:
            slot.checked = len(slot.calls)  # more of the same calls: nothing new to compare
            continue
        slot.checked, slot.checked_size = len(slot.calls), size
        if slot.uniform and compare_collective(dict(itertools.islice(slot.calls.items(), 2)), size or None) is None:
            continue  # identical calls: two of them answer for all (the full check names culprits)
        mismatch = compare_collective(slot.calls, size or None)
        if mismatch is None:
            continue
        key = slot_key(group, seq)
        ctx.claimed.add(key)
        ctx.mismatched.add(key)
        culprit = list(mismatch.culprit_ranks)
        agreeing = list(mismatch.agreeing_ranks)
        step = max(c.step for c in slot.calls.values())
        details: dict[str, object] = {"calls": {str(k): v for k, v in sorted(mismatch.details.items())}}
        summary, hint, kind = mismatch.summary, mismatch.hint, mismatch.kind
        if kind == IncidentKind.OP_MISMATCH:
            history = {rk: list(st.history.get(group, ())) for rk, st in job.ranks.items()}
            extra = explain_extra_call(history, seq)
            if extra:
                summary = f"{summary}; {extra}"
                details["extra_call"] = extra
            in_barrier = [rk for rk, c in slot.calls.items() if c.op in BARRIERS]
            others = [rk for rk in slot.calls if rk not in in_barrier]
            if in_barrier and others:
                # One side is waiting in a barrier the others never reach: it left the loop early.
                kind, culprit, agreeing, hint = (
                    IncidentKind.EARLY_EXIT,
                    sorted(in_barrier),
                    sorted(others),
                    EARLY_EXIT_HINT,
                )
                other_op = slot.calls[others[0]].op
                summary = (
                    f"rank{'s' if len(in_barrier) > 1 else ''} {format_ranks(culprit)} left the loop and wait in "
                    f"a final barrier while rank{'s' if len(others) > 1 else ''} {format_ranks(agreeing)} "
                    f"entered {other_op} (group {group}, seq {seq}) at step {step}: {mismatch.summary}"
                )
        findings.append(
            Finding(
                kind=kind,
                key=f"mismatch:{key}",
                culprit_ranks=culprit,
                waiting_ranks=agreeing,
                summary=summary,
                hint=hint,
                onset_time=slot.last_enter,
                op=slot.calls[agreeing[0] if agreeing else culprit[0]].op,
                group=group,
                seq=seq,
                step=step,
                details=details,
                stack_ranks=sorted(set(culprit) | set(agreeing[:1])),
            )
        )
    return findings


def _group_membership(job: JobState) -> list[Finding]:
    """The same group name bound to different member ranks on different ranks."""
    findings: list[Finding] = []
    for name in job.groups:
        views: dict[tuple[int, ...], list[int]] = {}
        for rk, st in job.ranks.items():
            info = st.groups.get(name)
            if info is not None and info.ranks:
                views.setdefault(info.ranks, []).append(rk)
        if len(views) < 2:
            continue
        ordered = sorted(views.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
        agreeing = ordered[0][1]
        culprits = sorted(rk for members, rks in ordered[1:] for rk in rks)
        lines = "; ".join(
            f"rank{'s' if len(rks) > 1 else ''} {format_ranks(sorted(rks))}: {list(members)}"
            for members, rks in ordered
        )
        findings.append(
            Finding(
                kind=IncidentKind.ARG_MISMATCH,
                key=f"group:{name}",
                culprit_ranks=culprits,
                waiting_ranks=sorted(agreeing),
                summary=f"process group {name} has different members on different ranks ({lines}): "
                "new_group was called in a different order",
                hint="Every rank must call new_group for every group, in the same order, with the same ranks "
                "(even ranks that are not members).",
                onset_time=min((st.registered_at for st in job.ranks.values()), default=0.0),
                group=name,
                details={"members": {format_ranks(sorted(rks)): list(m) for m, rks in ordered}},
                stack_ranks=culprits[:4],
            )
        )
    return findings
