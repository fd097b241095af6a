"""Calls a rank sent one by one that repeat a cycle, folded into one run by the coordinator.

A rank's steady state repeats one step's calls: FSDP's per-layer gathers and scatters, a
pipeline's schedule. Senders gather runs and short cycles within a step (``ringruns``); a
step of many signatures, or a batch holding less than two periods, still travels call by
call, and the coordinator then paid for every call. Here its decoder folds such a batch's
calls into a ``records.CallRun`` whose cycle is the step's signatures and whose steps advance
every ``per_step`` calls: the job state takes it whole, and its cost grows with batches, not
calls. Folding changes nothing a detector sees (``CallRun.call`` makes each call as it came).

A stretch folds when its calls are alike to a cycle's in every field but their ids, seqs,
steps and times: consecutive ids and seqs on one group, each completed once with finite
times, none async, steps one apart at most, advancing at a fixed number of calls. The
cycle is the shortest period of the stretch's signatures (seen twice over, or, where no cycle
was known, at least its first ``FOLD_MIN`` calls again), or the one the rank's previous batch
folded, where this batch takes up where it left off. Where no cycle was known, calls that
are each another call (a job's first step, seen once) are a run of their own. Every test is a
comparison of lists (C), not a loop over calls in Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hangwatch import records as r

#: The fewest calls a cycle is first found in (a batch that takes one up may hold two).
FOLD_MIN = 4
#: The longest cycle of signatures folded: a step of up to this many calls.
MAX_FOLD = 64
#: Cycles whose templates a rank session keeps found.
MAX_KNOWN = 256
#: A sender's runs' signature ids, from their first call, to where their least turn starts:
#: ids alone, so one for every rank whose sender numbered its signatures alike (``Folder.shape``).
_STARTS: dict[tuple[int, ...], int] = {}
MAX_STARTS = 4096
_UNKNOWN = object()


@dataclass(frozen=True)
class Cycle:
    """The cycle a rank's last fold ended in: its signatures, calls a step (0: not known), the
    next call's id and seq, the last call's step, and the next call's place in the cycle."""

    sids: tuple[int, ...]
    per_step: int
    call_id: int
    seq: int
    step: int
    phase: int


@dataclass(frozen=True)
class Recent:
    """The signatures of a rank's last calls sent one by one, and the id and seq after them."""

    sids: tuple[int, ...]
    call_id: int
    seq: int


def period(sids: Sequence[int], limit: int = MAX_FOLD, once: bool = False) -> int:
    """The shortest period of ``sids`` seen twice over, or (``once``) whose first ``FOLD_MIN``
    calls at least come again (0: none)."""
    n = len(sids)
    for p in range(1, min(limit, max(n // 2, n - FOLD_MIN) if once else n // 2) + 1):
        if sids[p:] == sids[: n - p]:
            return p
    return 0


def steps_of(steps: Sequence[int], per_hint: int) -> tuple[int, int] | None:
    """(calls a step, calls of the first step before the first of ``steps``) where the steps
    advance by one every so many calls ((0, 0): one step); ``per_hint``: calls a step where
    ``steps`` show one change only (0: not known, and then None). None: they do not."""
    n = len(steps)
    s0 = steps[0]
    last = steps[-1]
    if last == s0:
        return (0, 0) if steps.count(s0) == n else None
    try:
        b1 = steps.index(s0 + 1)
        per = steps.index(s0 + 2, b1) - b1 if last > s0 + 1 else per_hint
    except ValueError:
        return None
    if per <= 0 or b1 > per:
        return None
    lead = per - b1
    expected = [s0] * b1  # a step at a time, not a call
    for s in range(s0 + 1, s0 + 1 + (n - b1 + per - 1) // per):
        expected += [s] * per
    if list(steps) != expected[:n]:
        return None
    return per, lead


def fold(
    rank: int,
    table: dict[int, r.CallRecord],
    sids: Sequence[int],
    cids: Sequence[int],
    seqs: Sequence[int],
    steps: Sequence[int],
    enters: Sequence[float],
    exits: Sequence[float],
    before: Cycle | None,
    recent: Recent | None = None,
    known: dict[tuple[int, ...], r.Shape | None] | None = None,
    whole: bool = False,
) -> tuple[r.CallRun, Cycle] | None:
    """The calls of these columns (none a run, every one counted once) as one run, and the
    cycle it ends in; None where they do not fold whole. ``before``: the cycle the rank's last
    fold ended in; ``recent``: the calls of its last batch, where it did not fold; ``known``:
    the rank's cycles found before (``Folder.known``); ``whole``: calls that are each another
    call and show no cycle are a run whose cycle is themselves (then ``Cycle.sids`` are them)."""
    n = len(sids)
    if n < 2:
        return None
    c0, q0 = cids[0], seqs[0]
    if list(range(c0, c0 + n)) != (cids if type(cids) is list else list(cids)) or list(range(q0, q0 + n)) != (
        seqs if type(seqs) is list else list(seqs)
    ):
        return None
    if not math.isfinite(sum(enters) + sum(exits)):  # NaN: one under way (inf: a time no clock gives)
        return None
    per_hint = p = turn = 0
    one: tuple[int, ...] = ()  # the cycle in its one turn (``Cycle.sids``), and ``turn``: where the run starts in it
    if before is not None and before.call_id == c0 and before.seq == q0 and before.step <= steps[0]:
        turned = before.sids[before.phase :] + before.sids[: before.phase]
        if tuple(sids) == (turned * (n // len(turned) + 1))[:n]:
            one, turn, p, per_hint = before.sids, before.phase, len(turned), before.per_step
    if not one:
        # the calls just before these (the rank's last batch, not folded), where they lead here
        lead_in = list(recent.sids) if recent is not None and (recent.call_id, recent.seq) == (c0, q0) else []
        k = len(lead_in)
        # where no cycle was taken up, a period seen once and in part again will do: a job's
        # first batch may hold less than two of its steps (every rank's at once, each call a
        # slot the others fill); one that gets it wrong costs the next batch a call alone
        p = period(lead_in + list(sids), once=before is None) if k + n >= FOLD_MIN else 0
        if p:
            base = tuple(lead_in[:p]) if k >= p else tuple((lead_in + list(sids))[:p])
            cycle = base[k % p :] + base[: k % p]
            start = min(range(p), key=lambda j: cycle[j:] + cycle[:j])  # the turn least as ids
            one, turn = cycle[start:] + cycle[:start], (p - start) % p
        elif whole and n <= MAX_FOLD and len(set(sids)) == n:
            one, p = tuple(sids), n
        else:
            return None
    if known is None:
        found = templates_of(table, one)
    elif one in known:
        found = known[one]
    else:
        found = known[one] = templates_of(table, one)
    if found is None:
        return None
    stepping = steps_of(steps, per_hint or (p if p > 1 else 0))
    if stepping is None:
        return None
    per, lead = stepping
    shape = found
    ordered = shape.templates[turn:] + shape.templates[:turn] if turn else shape.templates
    run = r.CallRun(
        rank, ordered[0], c0, q0, steps[0], _owned(enters), _owned(exits), cycle=ordered[1:], per_step=per, lead=lead,
        shape=shape, turn=turn,
    )  # fmt: skip
    return run, Cycle(one, per or per_hint, c0 + n, q0 + n, run.last_step, (turn + n) % p)


def _owned(values: Sequence[float]) -> list[float]:
    """``values`` as a list of the run's own: the columns' slices are, a tuple is copied."""
    return values if type(values) is list else list(values)


def templates_of(table: dict[int, r.CallRecord], sids: tuple[int, ...]) -> r.Shape | None:
    """The templates of a cycle's signatures, where a run may be of them (each known,
    collective, not async, all on one group); else None."""
    templates = [t for sid in sids if (t := table.get(sid)) is not None]
    if len(templates) != len(sids):
        return None
    group = templates[0].group
    if any(t.group != group or t.async_op or t.kind is not r.OpKind.COLLECTIVE for t in templates):
        return None
    return r.Shape(tuple(templates))


def passed(cycle: Cycle, sids: Sequence[int], cids: Sequence[int], seqs: Sequence[int], steps: Sequence[int]) -> Cycle:
    """``cycle`` past the call left out of the fold (under way, the batch's last) where that
    call is the cycle's next: the next batch takes up after it."""
    if len(sids) != 1 or (sids[0], cids[0], seqs[0]) != (cycle.sids[cycle.phase], cycle.call_id, cycle.seq):
        return cycle
    return dataclasses.replace(
        cycle, call_id=cycle.call_id + 1, seq=cycle.seq + 1, step=steps[0], phase=(cycle.phase + 1) % len(cycle.sids)
    )


def recent(before: Recent | None, sids: Sequence[int], cids: Sequence[int], seqs: Sequence[int]) -> Recent | None:
    """A batch's calls that did not fold, after ``before`` where they follow it, as the lead-in
    of the next batch's (consecutive ids and seqs; the last ``2 * MAX_FOLD``); None where
    they are not."""
    n = len(sids)
    if not n or list(cids) != list(range(cids[0], cids[0] + n)) or list(seqs) != list(range(seqs[0], seqs[0] + n)):
        return None
    lead_in = before.sids if before is not None and (before.call_id, before.seq) == (cids[0], seqs[0]) else ()
    return Recent((*lead_in, *sids)[-2 * MAX_FOLD :], cids[-1] + 1, seqs[-1] + 1)


def expand(
    entries: int,
    columns: Sequence[Sequence[Any]],
    run_enter: Sequence[float],
    run_exit: Sequence[float],
    run_signature: Sequence[int],
) -> tuple[list[int], list[int], list[int], list[int], list[float], list[float]] | None:
    """The first ``entries`` column entries (``columns``: signature, call id, seq, step, enter,
    exit, count, run, cycle) call by call, where a sender gathered some into runs (a step of
    one signature each: tensor parallelism's): signatures, ids, seqs, steps, enters and exits
    of every call. None where the entries do not follow each other (ids and seqs one apart)."""
    sids: list[int] = []
    steps: list[int] = []
    enters: list[float] = []
    exits: list[float] = []
    at = cat = 0
    cid0, seq0 = columns[1][0], columns[2][0]
    total = 0
    for sid, cid, seq, step, enter, exit_time, _, k, c in zip(*(col[:entries] for col in columns), strict=True):
        if cid != cid0 + total or seq != seq0 + total:
            return None
        if k > 1:
            pattern = [sid, *run_signature[cat : cat + c]]
            cat += c
            sids += (pattern * (k // len(pattern) + 1))[:k]
            enters.append(enter)
            enters += run_enter[at : at + k - 1]
            exits.append(exit_time)
            exits += run_exit[at : at + k - 1]
            at += k - 1
        else:
            sids.append(sid)
            enters.append(enter)
            exits.append(exit_time)
        steps += [step] * k
        total += k
    return sids, list(range(cid0, cid0 + total)), list(range(seq0, seq0 + total)), steps, enters, exits


def first_break(cycle: Cycle, sids: Sequence[int]) -> int:
    """Where ``sids`` (taking up where ``cycle`` left off) first part from it."""
    turned = cycle.sids[cycle.phase :] + cycle.sids[: cycle.phase]
    p = len(turned)
    for i, sid in enumerate(sids):
        if sid != turned[i % p]:
            return i
    return len(sids)


def past(cycle: Cycle, skip: int, call_id: int, seq: int, step: int) -> Cycle:
    """``cycle``, ``skip`` calls on, taken up by the call ``call_id`` at ``seq``: after a call
    that parted from it, the cycle goes on with the call it replaced (``skip`` 1), after it
    (an extra call: 0), or past the one it skipped (2)."""
    return dataclasses.replace(
        cycle, call_id=call_id, seq=seq, step=min(cycle.step, step), phase=(cycle.phase + skip) % len(cycle.sids)
    )


#: No columns left: nine, as ``Folder.take`` hands them on.
NONE_LEFT: tuple[Sequence[Any], ...] = ((),) * 9


def _rest(columns: tuple[Sequence[Any], ...], m: int, n: int) -> tuple[Sequence[Any], ...]:
    """The columns from entry ``m`` of ``n`` on."""
    return NONE_LEFT if m == n else tuple(col[m:] for col in columns)


class Folder:
    """One rank session's folding (``signatures.CallDecoder``): the cycle its last fold ended
    in, or its last calls that did not fold, for the next batch to take up."""

    def __init__(self) -> None:
        self.cycle: Cycle | None = None
        #: right after a call that parted from the cycle at a batch's end: the ways it may go on
        #: (the call replaced one, was an extra, or one was skipped), for the next batch to try
        self.guesses: tuple[Cycle, ...] = ()
        self.recent: Recent | None = None
        #: each cycle's templates (by its ids in their least turn) as found once (None: it does
        #: not fold), so that a rank's runs of one cycle, whatever call they start at, share one
        #: ``records.Shape`` and what the job state derives from it (``state.facts.facts_of``); emptied
        #: when the signature table changes
        self.known: dict[tuple[int, ...], r.Shape | None] = {}
        #: a sender's runs' signatures, from their first call, to their cycle and turn (``shape``)
        self.turned: dict[tuple[int, ...], tuple[r.Shape, int, tuple[r.CallRecord, ...]] | None] = {}

    def forget(self) -> None:
        """The signature table changed: templates found before may be another's now."""
        self.known.clear()
        self.turned.clear()

    def shape(
        self, table: dict[int, r.CallRecord], sids: tuple[int, ...]
    ) -> tuple[r.Shape, int, tuple[r.CallRecord, ...]] | None:
        """The rank's cycle of a run whose calls are of ``sids`` from its first on (a sender's
        fold), the run's turn in it, and its templates from the run's first call, as ``fold``
        finds them; None where a run may not be of them."""
        made = self.turned.get(sids, _UNKNOWN)
        if made is not _UNKNOWN:
            return made  # type: ignore[return-value]
        p = len(sids)
        start = _STARTS.get(sids)
        if start is None:  # (the same ids for every rank whose sender defined them in one order)
            start = min(range(p), key=lambda j: sids[j:] + sids[:j]) if p > 1 else 0
            if len(_STARTS) >= MAX_STARTS:
                _STARTS.clear()
            _STARTS[sids] = start
        one = sids[start:] + sids[:start]
        if len(self.known) >= MAX_KNOWN or len(self.turned) >= MAX_KNOWN:
            self.forget()
        found = self.known[one] if one in self.known else templates_of(table, one)
        self.known[one] = found
        turn = (p - start) % p
        made = None if found is None else (found, turn, found.templates[turn:] + found.templates[:turn])
        self.turned[sids] = made
        return made

    def take(
        self,
        rank: int,
        table: dict[int, r.CallRecord],
        columns: tuple[Sequence[Any], ...],
        run_enter: Sequence[float],
        run_exit: Sequence[float],
        run_signature: Sequence[int],
        extra: bool,
    ) -> tuple[list[r.CallRun], tuple[Sequence[Any], ...], r.CallRun | None, int]:
        """A batch's columns (signature, call id, seq, step, enter, exit, count, run, cycle;
        every count one; ``extra``: some entries are runs) folded where they repeat a cycle: the
        runs before the columns left to go one by one, those columns, the run after them, and
        the calls folded. A batch that begins with an async call is not tried (they never fold)."""
        first = table.get(columns[0][0])
        if first is not None and first.async_op:
            return [], columns, None, 0
        n = len(columns[0])
        befores = self.guesses or (self.cycle,)
        for m in (n, n - 1) if not extra or columns[7][-1] == 1 else (n,):
            picked: Sequence[Sequence[Any]] | None = (
                expand(m, columns, run_enter, run_exit, run_signature) if extra else [col[:m] for col in columns[:6]]
            )
            if picked is None:
                continue
            sids, cids, seqs, steps, enters, exits = picked
            if len(self.known) >= MAX_KNOWN:
                self.forget()
            for before in befores:
                cold = before is None  # no cycle to take up: calls each another call are a run of their own
                made = fold(
                    rank, table, sids, cids, seqs, steps, enters, exits, before, self.recent, self.known, whole=cold
                )
                if made is not None and cold and len(made[1].sids) == len(sids):
                    # (a job's first calls, every rank's at once: each a slot all others fill, where
                    # they come one by one) the next batch finds the cycle with these leading in
                    self.cycle, self.guesses = None, ()
                    self.recent = recent(self.recent, columns[0], columns[1], columns[2])
                    return [made[0]], _rest(columns, m, n), None, len(sids)
                if made is not None:  # the last may be under way, left out
                    left = _rest(columns, m, n)
                    self.cycle, self.recent = passed(made[1], left[0], left[1], left[2], left[3]), None
                    self.guesses = ()
                    if m < n and self.cycle is made[1]:  # it parts from the cycle: the next batch tries each way on
                        after = (left[1][0] + 1, left[2][0] + 1, left[3][0])
                        self.cycle, self.guesses = None, tuple(past(made[1], skip, *after) for skip in (1, 0, 2))
                    return [made[0]], left, None, len(sids)
        self.guesses = ()
        if not extra:
            for before in befores:
                found = self._around(rank, table, columns, before) if before is not None else None
                if found is not None:
                    return found
        self.cycle = None  # the next batch does not take up where a fold left off
        self.recent = recent(self.recent, columns[0], columns[1], columns[2])  # these may lead in
        return [], columns, None, 0

    def _around(
        self, rank: int, table: dict[int, r.CallRecord], columns: tuple[Sequence[Any], ...], cycle: Cycle
    ) -> tuple[list[r.CallRun], tuple[Sequence[Any], ...], r.CallRun | None, int] | None:
        """Calls that take up ``cycle`` and part from it at one call (another shape, an extra
        call, a skipped one): the calls before it as a run (two or more; else alone), that call
        alone, and the calls after it as a run where they go on with the cycle. Where too few
        come after it to tell how, the next batch tries each way (``guesses``). One rank parting
        from its cycle then costs a slot, not one at every seq of its batches (each of which
        every other rank's run would fill). None where the batch does not take up ``cycle`` or
        the calls before the one that parts do not fold."""
        n = len(columns[0])
        cids, seqs, steps = columns[1], columns[2], columns[3]
        if n < FOLD_MIN or (cycle.call_id, cycle.seq) != (cids[0], seqs[0]) or cycle.step > steps[0]:
            return None
        j = first_break(cycle, columns[0])
        if j >= n:
            return None
        runs: list[r.CallRun] = []
        at = dataclasses.replace(
            cycle,
            call_id=cycle.call_id + j,
            seq=cycle.seq + j,
            step=steps[j - 1] if j else cycle.step,
            phase=(cycle.phase + j) % len(cycle.sids),
        )
        if j >= 2:
            sids, head_cids, head_seqs, head_steps, enters, exits = (col[:j] for col in columns[:6])
            head = fold(rank, table, sids, head_cids, head_seqs, head_steps, enters, exits, cycle, None, self.known)
            if head is None:
                return None
            runs.append(head[0])
            at = head[1]
        lone = j if runs else 0  # the first call that goes alone
        self.recent = None
        rest = [col[j + 1 :] for col in columns[:6]]
        if len(rest[0]) >= 2:
            for skip in (1, 0, 2):
                guess = past(at, skip, rest[1][0], rest[2][0], rest[3][0])
                tail = fold(rank, table, rest[0], rest[1], rest[2], rest[3], rest[4], rest[5], guess, None, self.known)
                if tail is not None:
                    self.cycle, self.guesses = tail[1], ()
                    return runs, tuple(col[lone : j + 1] for col in columns), tail[0], n - j - 1 + lone
        # too few calls after it (or they do not fold): the next batch tries each way on
        after = (rest[1][0], rest[2][0], rest[3][0]) if rest[0] else (cids[-1] + 1, seqs[-1] + 1, steps[-1])
        self.cycle = None
        self.guesses = tuple(passed(past(at, skip, *after), rest[0], rest[1], rest[2], rest[3]) for skip in (1, 0, 2))
        return runs, tuple(col[lone:] for col in columns), None, lone
