"""Ranks that called different things at the same (group, seq): op, shape, dtype, arguments.

Checked as soon as a second rank reaches a slot (so within the detection tick of the last
involved call), whatever the backend then does with the call: hang, crash or silent success.
Also: the same group name with different member ranks on different ranks (``new_group`` called
in a different order).

Incremental (``MismatchCache``, owned by the engine): memberships are compared only when a group
was created or destroyed, and a slot only when calls arrived at it; a slot whose calls so far
are identical is compared in full only when a different call arrives.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from hangwatch.diagnosis import traces
from hangwatch.diagnosis.detectors import Context
from hangwatch.diagnosis.detectors.stuck import BARRIERS, EARLY_EXIT_HINT
from hangwatch.diagnosis.incidents import Finding, IncidentKind, KeyFamily, incident_key
from hangwatch.diagnosis.rules import compare_collective
from hangwatch.diagnosis.state import JobState, Slot
from hangwatch.wording import format_ranks, stories


@dataclass
class Checked:
    """The last check of a slot: ``calls`` calls were compared with a group of ``size`` members."""

    slot: Slot  # the slot checked (a slot pruned and started again at the same seq is another)
    calls: int = 0
    size: int = 0
    repeat: bool = False  # counted as a repeat of an earlier slot's mismatch (once, whatever comes later)


#: Distinct mismatches remembered for their repeats (a loop repeating one mismatch is one incident).
FIRSTS_KEPT = 1024
#: How long after a slot's first call a mismatch seen before every rank arrived, and with no
#: majority for either side, waits for the batches of ranks whose absence is not known yet
#: (their latest batch left before the slot's latest call began) before it is told provisionally.
PROVISIONAL_WAIT_S = 1.0


@dataclass
class First:
    """The first slot where a mismatch was seen, and how often it came back at later slots."""

    key: str
    seq: int
    summary: str
    culprits: list[int]
    waiting: list[int]
    kind: IncidentKind = IncidentKind.OP_MISMATCH  # as reported (a final barrier makes it an early exit)
    repeats: int = 0
    last_seq: int = 0
    last_step: int = 0


@dataclass
class MismatchCache:
    """What ``detect`` remembers between ticks (engine-owned; see detectors/__init__.py)."""

    membership: list[Finding] | None = None  # group membership findings; None: compare again
    #: slots whose mismatch waits for the batches of ranks not arrived yet (``PROVISIONAL_WAIT_S``),
    #: looked at every tick until told
    waiting: dict[tuple[str, int], float] = field(default_factory=dict)
    #: each distinct mismatch (kind, group, the calls as described) -> where it was first seen
    firsts: collections.OrderedDict[tuple[object, ...], First] = field(default_factory=collections.OrderedDict)
    #: per group, per seq: the last check of each slot still in the job state (slots pruned
    #: from the state are let go at the next tick that touches their group)
    checked: dict[str, collections.OrderedDict[int, Checked]] = field(default_factory=dict)

    def check_of(self, slot: Slot) -> Checked:
        per_group = self.checked.get(slot.group)
        if per_group is None:
            per_group = self.checked[slot.group] = collections.OrderedDict()
        entry = per_group.get(slot.seq)
        if entry is None or entry.slot is not slot:
            entry = per_group[slot.seq] = Checked(slot)
        return entry

    def forget_pruned(self, job: JobState, groups: set[str]) -> None:
        """Let go of checks of slots no longer in ``job`` (bounded by what the state keeps)."""
        for group in [g for g in self.checked if g not in job.slots]:
            del self.checked[group]
        for group in groups:
            per_group, live = self.checked.get(group), job.slots.get(group)
            if per_group is None or live is None:
                continue
            while per_group:  # oldest first, like the state prunes
                seq, entry = next(iter(per_group.items()))
                if live.get(seq) is entry.slot:
                    break
                del per_group[seq]


def detect(job: JobState, ctx: Context) -> list[Finding]:
    cache = ctx.cache.mismatch
    if cache.membership is None or ctx.changes.groups:  # only when a rank created or destroyed a group
        cache.membership = _group_membership(job)
    findings = list(cache.membership)
    changed = ctx.changes.slots
    for group, seq in sorted(set(changed) | set(cache.waiting)):
        slot = job.slots[group].get(seq) if group in job.slots else None
        if slot is None or len(slot.calls) < 2:
            cache.waiting.pop((group, seq), None)
            continue
        check = cache.check_of(slot)
        if len(slot.calls) == check.calls:
            continue
        size = len(job.members(group))
        if slot.uniform and check.calls >= 2 and check.size == size:
            check.calls = len(slot.calls)  # more of the same calls: nothing new to compare
            continue
        check.calls, check.size = len(slot.calls), size
        if slot.uniform and compare_collective(dict(itertools.islice(slot.calls.items(), 2)), size or None) is None:
            continue  # identical calls: two of them answer for all (the full check names culprits)
        mismatch = compare_collective(slot.calls, size or None)
        if mismatch is None:
            cache.waiting.pop((group, seq), None)
            continue
        ctx.claimed.add((group, seq))
        ctx.mismatched.add((group, seq))
        # the same calls disagreeing the same way, in the same processes (a rerun is news)
        members = job.members(group) or tuple(slot.calls)
        sessions = frozenset(st.identity.session for rk in members if (st := job.ranks.get(rk)) is not None)
        signature = (mismatch.kind, group, frozenset(mismatch.details.values()), sessions)
        first = cache.firsts.get(signature)
        if first is not None and first.seq != seq:
            # The same mismatch again at a later slot (a loop repeating it: gloo carries on after
            # a reduce-op mismatch): one root cause, one incident, which counts the repeats; each
            # slot once, whatever order slots are seen in, and at once (its sides are known).
            cache.waiting.pop((group, seq), None)
            if not check.repeat:
                check.repeat = True
                first.repeats += 1
            step = max(c.step for c in slot.calls.values())
            if seq > first.last_seq:
                first.last_seq, first.last_step = seq, step
            findings.append(
                _repeat(first, group, slot.calls[first.culprits[0]].op if first.culprits[0] in slot.calls else "", step)
            )
            continue
        # where no majority says which side is wrong, the program's own rounds may; and where
        # the culprits' traces part from the others' says what happened
        detail = mismatch.summary.partition(": ")[2]
        culprit, agreeing, decided, story = ctx.cache.stories.slot(
            job, slot, mismatch.culprit_ranks, mismatch.agreeing_ranks, detail
        )
        step = max(c.step for c in slot.calls.values())
        details: dict[str, object] = {
            "calls": {str(k): v for k, v in sorted(mismatch.details.items())},
            "provisional": False,
        }
        summary, hint, kind = mismatch.summary, mismatch.hint, mismatch.kind
        if size and len(slot.calls) < size and len(agreeing) * 2 <= size:
            # Not every rank has arrived and the side taken for right is no majority of the group
            # yet. The others' batches may be on their way (a node agent reads a steady rank that
            # keeps writing every 0.4 s; remote agents and relays add their transit): wait for them a
            # moment. Then, unless the program's own rounds told the sides apart, say who
            # disagrees, not who is wrong (told again as they come).
            missing = [rk for rk in job.members(group) if rk not in slot.calls]
            on_their_way = any(
                (st := job.ranks.get(rk)) is not None and st.end is None and st.last_sent < slot.last_enter
                for rk in missing
            )
            if on_their_way and ctx.now - slot.first_enter < PROVISIONAL_WAIT_S:
                cache.waiting.setdefault((group, seq), ctx.now)
                check.calls = 0  # compared again on the next tick
                continue
        if size and len(slot.calls) < size and len(agreeing) * 2 <= size and not decided:
            culprit, agreeing = sorted(slot.calls), []
            details["provisional"] = True
            summary += stories.provisional(len(slot.calls), size)
        # the traces may yet tell (a skip, another line): where a side's C++ calls are read from
        # Flight Recorder, wait for a read past the slot before the sides' rules speak
        if (
            story is None
            and agreeing
            and first is None
            and ctx.now - slot.first_enter < traces.TRACE_WAIT_S
            and traces.unknown_at(job, [culprit[0], agreeing[0]], slot.last_enter)
        ):
            cache.waiting.setdefault((group, seq), ctx.now)
            check.calls = 0  # compared again on the next tick
            continue
        if story is not None and agreeing:
            summary = story.summary
            details["edit"] = story.facts
        if kind == IncidentKind.OP_MISMATCH and (story is None or not agreeing):
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
                summary = stories.in_final_barrier(culprit, agreeing, other_op, group, seq, step, mismatch.summary)
        cache.waiting.pop((group, seq), None)
        key = incident_key(KeyFamily.MISMATCH, group=group, seq=seq)
        if first is None:
            cache.firsts[signature] = First(key, seq, summary, culprit, agreeing, kind)
            while len(cache.firsts) > FIRSTS_KEPT:
                cache.firsts.popitem(last=False)
        else:  # the first slot again, with more ranks in it
            first.summary, first.culprits, first.waiting, first.kind = summary, culprit, agreeing, kind
        findings.append(
            Finding(
                kind=kind,
                key=key,
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
    if changed:
        cache.forget_pruned(job, {group for group, _ in changed})
    return findings


def _repeat(first: First, group: str, op: str, step: int) -> Finding:
    return Finding(
        kind=first.kind,
        key=first.key,
        culprit_ranks=first.culprits,
        waiting_ranks=first.waiting,
        summary=first.summary + stories.repeated(first.repeats, first.last_seq, first.last_step),
        hint="",
        onset_time=0.0,
        op=op,
        group=group,
        seq=first.seq,
        step=step,
        details={"repeats": {"count": first.repeats, "last_seq": first.last_seq, "last_step": first.last_step}},
    )


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
        views_of = [(sorted(rks), list(members)) for members, rks in ordered]
        findings.append(
            Finding(
                kind=IncidentKind.ARG_MISMATCH,
                key=incident_key(KeyFamily.GROUP, group=name),
                culprit_ranks=culprits,
                waiting_ranks=sorted(agreeing),
                summary=stories.group_members_differ(name, views_of),
                hint="Every rank must call new_group for every group, in the same order, with the same ranks "
                "(even ranks that are not members).",
                onset_time=min((st.registered_at for st in job.ranks.values()), default=0.0),
                group=name,
                details={"members": {format_ranks(sorted(rks)): list(m) for m, rks in ordered}},
                stack_ranks=culprits[:4],
            )
        )
    return findings
