"""The model's story of a finding (``hangwatch.model``): which side parted from the program, and
how, in words. Read only: it reads the job state's traces (``diagnosis.traces``).

Two places ask:

- a slot whose calls disagree (:func:`at_slot`): who is wrong when no majority says (the side
  whose call the program's own rounds never made there), and the edit that explains it;
- a slot a rank never came to (:func:`absent`): whether it skipped a call and ran out of them,
  or the ranks waiting made one more than it, or its trace simply stops short.

Each answers None where the traces tell nothing more than the rules did: their story stands.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hangwatch import catalogue
from hangwatch import records as r
from hangwatch.diagnosis.state import JobState, Slot
from hangwatch.diagnosis.traces import traces
from hangwatch.model.align import Edit, EditKind, align, precedented
from hangwatch.wording.stories import call_at, extra_call, fewer_calls, never_called, skipped_ran_out, skipped_went_on

#: A rank in one of these where the others are in another call, its calls before theirs: it
#: left its loop (``detectors.mismatch``'s early exit), unless its trace shows a skip.
BARRIERS = catalogue.record_names([catalogue.Kind.BARRIER])


@dataclass
class Story:
    """What the model says of a finding: its summary (or the clause to add to the rules'), the
    sides, and the facts for ``details``."""

    summary: str
    culprits: list[int]
    others: list[int]
    facts: dict[str, object] = field(default_factory=dict)


def _facts(edit: Edit, rank: int) -> dict[str, object]:
    """The edit for ``details``: the call skipped (or extra), where and when."""
    call = edit.theirs if edit.kind is EditKind.SKIPPED else edit.mine
    if call is None:
        return {"rank": rank, "edit": edit.kind.value}
    op = catalogue.canonical_op(call.op)
    if edit.kind is EditKind.SKIPPED and edit.forward and call.source != "python":
        # a forward pass without its backward: the gradient all-reduce DDP issues from C++
        return {
            "rank": rank,
            "op": op,
            "group": call.group,
            "forward": edit.forward,
            "step": edit.step,
            "behind": edit.count + edit.behind,  # the calls skipped, and any the reference made past its end
        }
    facts: dict[str, object] = {"rank": rank, "op": op, "call_site": call.call_site, "step": edit.step, "seq": call.seq}
    if edit.kind is not EditKind.SKIPPED:
        facts["edit"] = edit.kind.value
    return facts


def sides(job: JobState, slot: Slot, culprits: Sequence[int], agreeing: Sequence[int]) -> tuple[list[int], list[int]]:
    """The rules' sides, or where they had no majority (one rank against one, or a tie), the
    side whose call the program's own rounds never made at that place: it parted from them."""
    if len(culprits) != len(agreeing) or not culprits:
        return list(culprits), list(agreeing)
    a, b = culprits[0], agreeing[0]
    both = traces(job, slot.group, [a, b])
    if both is None:
        return list(culprits), list(agreeing)
    new_a = not precedented(both[a], slot.calls[a])
    new_b = not precedented(both[b], slot.calls[b])
    if new_b and not new_a:
        return list(agreeing), list(culprits)
    return list(culprits), list(agreeing)


def decided(job: JobState, slot: Slot, culprits: Sequence[int], agreeing: Sequence[int]) -> bool:
    """Whether the program's own rounds tell the sides apart (one side's call there is new)."""
    if not culprits or not agreeing:
        return False
    both = traces(job, slot.group, [culprits[0], agreeing[0]])
    if both is None:
        return False
    return not precedented(both[culprits[0]], slot.calls[culprits[0]]) and precedented(
        both[agreeing[0]], slot.calls[agreeing[0]]
    )


def at_slot(job: JobState, slot: Slot, culprits: Sequence[int], agreeing: Sequence[int], detail: str) -> Story | None:
    """Where the culprits' calls at ``slot`` part from the agreeing ranks', when their traces
    tell more than the slot: a skip (and what met it), a call of another line altogether. ``detail``:
    the rules' account of how the calls differ (``rank 0: [4]; rank 1: [1]``)."""
    if not culprits or not agreeing:
        return None
    culprit, reference = culprits[0], agreeing[0]
    both = traces(job, slot.group, [culprit, reference])
    if both is None:
        return None
    edit = align(both[culprit], both[reference])
    mine, theirs = slot.calls[culprit], slot.calls[reference]
    facts = _facts(edit, culprit)
    if edit.kind is EditKind.SKIPPED and edit.confirmed and edit.theirs is not None and edit.pinned:
        if edit.went_on is not None and edit.went_on.call_id == mine.call_id:
            text = skipped_went_on(culprit, edit.theirs, edit.step, mine, slot.seq)
            return Story(f"{text}: {detail}" if detail else text, list(culprits), list(agreeing), facts)
        text = skipped_ran_out(culprit, edit.theirs, edit.step, edit.forward, agreeing, edit.count + edit.behind)
        return Story(f"{text}; it is in {call_at(mine)}", list(culprits), list(agreeing), facts)
    if (
        edit.kind is EditKind.DIFFERENT
        and edit.mine is not None
        and edit.mine.call_id == mine.call_id
        and catalogue.canonical_op(mine.op) != catalogue.canonical_op(theirs.op)
        and mine.op not in BARRIERS  # a barrier after calls the others' own, cut short: it left the loop
    ):
        # another call altogether where the others are: what is seen, and no more
        return Story(never_called(culprits, theirs, agreeing, mine), list(culprits), list(agreeing), facts)
    return None


@dataclass
class Absence:
    """Why a rank never came to a slot, where its trace tells: the story's clause, who is at
    fault (the absent rank, or the waiting ranks where they made a call more), the facts."""

    clause: str
    culprits: list[int]
    facts: dict[str, object]
    skipped: bool = False


T = TypeVar("T")

#: Stories kept per detector cache (a job's distinct (group, culprit, reference) questions).
STORIES_KEPT = 1024


class Stories:
    """The stories told, kept until a rank they read changes its trace (``RankState.traced``):
    a hang is looked at every tick, a slot each time a call comes to it, and the traces are the
    same until a call comes."""

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[tuple[object, ...], object] = collections.OrderedDict()

    def _told(self, key: tuple[object, ...], tell: Callable[[], T]) -> T:
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]  # type: ignore[return-value]
        told = tell()
        self._kept[key] = told
        while len(self._kept) > STORIES_KEPT:
            self._kept.popitem(last=False)
        return told

    def absent(self, job: JobState, group: str, culprit: int, waiting: Sequence[int], members: int) -> Absence | None:
        reads = (culprit, *sorted(waiting)[:1])
        key = ("absent", group, culprit, tuple(waiting), members, *(_traced(job, rk) for rk in reads))
        return self._told(key, lambda: absent(job, group, culprit, waiting, members))

    def slot(
        self, job: JobState, slot: Slot, culprits: Sequence[int], agreeing: Sequence[int], detail: str
    ) -> tuple[list[int], list[int], bool, Story | None]:
        """The sides (:func:`sides`), whether the program's rounds decided them (:func:`decided`),
        and the story (:func:`at_slot`) of a slot whose calls disagree."""
        reads = (*culprits[:1], *agreeing[:1])
        key: tuple[object, ...] = ("slot", slot.group, slot.seq, id(slot), len(slot.calls), tuple(culprits))
        key += (tuple(agreeing), detail, *(_traced(job, rk) for rk in reads))

        def tell() -> tuple[list[int], list[int], bool, Story | None]:
            mine, others = sides(job, slot, culprits, agreeing)
            story = at_slot(job, slot, mine, others, detail) if others else None
            return mine, others, decided(job, slot, mine, others), story

        return self._told(key, tell)


def _traced(job: JobState, rank: int) -> tuple[int, int, float]:
    """What a story of ``rank`` is kept by: its trace changes with its calls, and where C++'s
    calls come from Flight Recorder, with how far its reads reach."""
    st = job.ranks.get(rank)
    return (-1, -1, 0.0) if st is None else (id(st), st.traced, st.flight_to)


def absent(job: JobState, group: str, culprit: int, waiting: Sequence[int], members: int) -> Absence | None:
    """``culprit`` never came to a slot of ``group`` (of ``members`` ranks) that ``waiting`` are
    in: it skipped a call and ran out (pinned among the calls), the waiting ranks made a call it
    never made, or it is one call short where every round looks alike. None: its trace is
    theirs, cut short."""
    if not waiting:
        return None
    reference = sorted(waiting)[0]
    both = traces(job, group, [culprit, reference])
    if both is None:
        return None
    edit = align(both[culprit], both[reference])
    if edit.kind is not EditKind.SKIPPED or not edit.confirmed or edit.theirs is None:
        return None
    if 2 * len(waiting) <= members and _once(both[reference], edit.theirs):
        # no majority says which side is the program's, and the call is the only one its line
        # made: the waiting ranks' own extra call, and the absent rank ran out of calls first
        facts = {**_facts(edit, reference), "edit": EditKind.EXTRA.value, "group": group}
        text = extra_call(reference, edit.theirs, edit.step, [culprit], edit.count + edit.behind)
        return Absence(text, sorted(waiting), facts)
    if edit.pinned:
        text = skipped_ran_out(culprit, edit.theirs, edit.step, edit.forward, waiting, edit.count + edit.behind)
        return Absence(text, [culprit], _facts(edit, culprit), skipped=True)
    return Absence(
        fewer_calls(culprit, edit.theirs, waiting, edit.count + edit.behind), [culprit], _facts(edit, culprit)
    )


def _once(marks: Sequence[object], call: r.CallRecord) -> bool:
    """Whether ``call``'s line made no other call in the trace."""
    return sum(1 for mk in marks if (c := getattr(mk, "call", None)) is not None and c.call_site == call.call_site) == 1
