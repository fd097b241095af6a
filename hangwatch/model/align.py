"""Where two ranks' traces part: the smallest edit of one that gives the other.

A trace (:func:`trace`) is a rank's recent calls in the order it made them (its call ids), every
group together, with its DDP forward passes between them. Ranks of one program make alike calls
(:func:`alike`: the op, and what ranks must agree on for it) from the same lines, in the same
order. :func:`align` lays the culprit's trace on a reference's, cheapest first, and names the
first edit (``EditKind``):

- ``SAME``: the traces agree as far as both go.
- ``SHORT``: the culprit's trace is the reference's cut short (it ended, or stopped outside any call).
- ``SKIPPED``: the culprit lacks a call the reference made and went on: its later calls are the
  reference's later calls, or (where the reference has none yet) its next call is the one the
  program makes after the skipped one, as the reference's earlier rounds show.
- ``EXTRA``: the culprit made a call the reference did not, and its later calls line up after it.
- ``DIFFERENT``: at the same place the culprit called something else; nothing shows yet which
  of the two calls is the program's own.

Costs: a call alike but made from another line costs a little (a rank-dependent branch may issue
one collective from two lines), calls not alike cost a substitution, a call of one trace only an
insertion; moving a forward pass costs more than a call, so that where every call looks alike
(DDP's buckets), the forward pass without its backward pins the skip. The traces' ends are free:
one rank is always further on than another.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from hangwatch import catalogue
from hangwatch import records as r

#: A DDP forward pass a rank recorded: (its count of them, group, torch's seq on the group when
#: it began, step) (``RankState.forwards``).
Forward = tuple[int, str, int, int]


@dataclass(frozen=True, slots=True)
class Mark:
    """One element of a trace: a call, or a DDP forward pass (``call`` None, ``forward`` its count)."""

    call: r.CallRecord | None
    forward: int = 0
    step: int = 0


def fingerprint(c: r.CallRecord) -> tuple[Hashable, ...]:
    """What ranks' calls at one place of the program must agree on (None: not recorded)."""
    canon = catalogue.canonical_op(c.op)
    agree = catalogue.agreement(canon)
    parts: list[Hashable] = [canon, c.root if agree.root else None]
    parts.append(catalogue.norm_reduce(c.reduce_op) if agree.reduce and c.reduce_op else None)
    for name in agree.full:
        metas: tuple[r.TensorMeta, ...] = getattr(c, name)
        parts.append(tuple((m.shape, m.dtype) for m in metas) or None)
    for name in agree.dtypes:
        parts.append(tuple(dict.fromkeys(m.dtype for m in getattr(c, name))) or None)
    for name in agree.lengths:
        parts.append(len(getattr(c, name)) or None)
    return tuple(parts)


def alike(a: r.CallRecord, b: r.CallRecord) -> bool:
    """The same call as far as ranks must agree (a value one side did not record matches any)."""
    fa, fb = fingerprint(a), fingerprint(b)
    return len(fa) == len(fb) and all(x is None or y is None or x == y for x, y in zip(fa, fb, strict=True))


def same(a: r.CallRecord, b: r.CallRecord) -> bool:
    """The same call of the program: alike, and from the same line (where both say)."""
    return (not a.call_site or not b.call_site or a.call_site == b.call_site) and alike(a, b)


def in_order(calls: Iterable[r.CallRecord]) -> list[r.CallRecord]:
    """A rank's calls in the order it made them: the hook's by call id; a record made from a
    Flight Recorder entry (numbered apart) where it began among them. (Times alone would not do:
    each batch's are mapped by its own clock offset.)"""
    hooks = sorted((c for c in calls if c.source == "python"), key=lambda c: c.call_id)
    entries = sorted((c for c in calls if c.source != "python"), key=lambda c: c.enter_time)
    if not entries:
        return hooks
    out: list[r.CallRecord] = []
    k = 0
    for c in hooks:
        while k < len(entries) and entries[k].enter_time < c.enter_time:
            out.append(entries[k])
            k += 1
        out.append(c)
    out.extend(entries[k:])
    return out


def trace(calls: Iterable[r.CallRecord], forwards: Iterable[Forward] = (), ordered: bool = False) -> list[Mark]:
    """A rank's calls in the order it made them (:func:`in_order`; ``ordered``: they are), each
    DDP forward pass before the first call it was followed by on its group (at the end where
    none is yet)."""
    ordered_calls = list(calls) if ordered else in_order(calls)
    marks: list[Mark] = []
    pending = sorted(forwards)
    for c in ordered_calls:
        while pending and pending[0][1] == c.group and c.seq > pending[0][2]:
            count, _, _, step = pending.pop(0)
            marks.append(Mark(None, count, step))
        marks.append(Mark(c, step=c.step))
    marks.extend(Mark(None, count, step) for count, _, _, step in pending)
    return marks


class EditKind(enum.Enum):
    SAME = "same"
    SHORT = "short"
    SKIPPED = "skipped"
    EXTRA = "extra"
    DIFFERENT = "different"


@dataclass(frozen=True)
class Edit:
    """The first place the culprit's trace parts from the reference's, and how."""

    kind: EditKind
    mine: r.CallRecord | None = None  # the culprit's call there (EXTRA, DIFFERENT)
    theirs: r.CallRecord | None = None  # the reference's (SKIPPED, DIFFERENT; SHORT: its next)
    #: the reference's forward pass just before the edit (0: none, or not recorded)
    forward: int = 0
    #: the skip or the extra call is one of several alike calls in a row: where among them is not known
    pinned: bool = True
    #: later calls line up after the edit (or, for a skip, the program's earlier rounds show the
    #: culprit's call is the one that follows the skipped one)
    confirmed: bool = False
    #: the culprit went on to this call after a skip (its call at the place of the skipped one)
    went_on: r.CallRecord | None = None
    behind: int = 0  # calls the reference made past the culprit's end
    ahead: int = 0  # calls the culprit made past the reference's end
    #: calls alike skipped together from there (a backward's buckets)
    count: int = 1
    #: the training step of the edit's call: its own, or where it came from Flight Recorder
    #: (whose records take the step the rank was at when they were read) the forward pass's before it
    step: int = -1


#: Costs (see the module docstring).
OTHER_LINE = 0.3
SUBSTITUTE = 1.0
INDEL_CALL = 1.0
INDEL_FORWARD = 1.5
#: Two forward passes of other counts (the culprit's 8th against the reference's 7th) match at
#: this cost each: a rank that skipped a backward keeps its forwards in step with the others'
#: (the n-th of every rank), so lining its later calls up one forward off costs at every one.
OTHER_FORWARD = 0.2
#: A call of the culprit's only, from a line its loop makes calls from, costs this more: one call
#: more of a round is as well one call fewer of another (L L G against L G: the G skipped, or
#: the L made twice), and a rank skips a call of its loop (a NaN's ``continue``) far more often
#: than it makes one twice; an extra call is one of a line of its own.
EXTRA_AGAIN = 0.1
#: Elements of each trace aligned at most, from where both start (the job state keeps 64 calls a
#: group: a trace over many groups is long, and its cost grows with it times ``BAND``).
WINDOW = 2048

_MATCH, _SUB, _DEL, _INS = "match", "sub", "del", "ins"  # del: the reference's only; ins: the culprit's only


def _recurring(marks: Sequence[Mark]) -> set[str]:
    """The lines a trace made calls from more than once: its loop's."""
    seen: set[str] = set()
    again: set[str] = set()
    for mk in marks:
        if mk.call is not None:
            (again if mk.call.call_site in seen else seen).add(mk.call.call_site)
    return again


#: A trace element as the alignment compares it: None for a forward pass, else (its fingerprint's
#: index among the distinct ones, its line, whether it may stand for an alike call of another
#: line: a branch of the loop, each side's line coming back in its own trace and never in the
#: other's).
_Key = tuple[int, str, bool] | None


def _keys(marks: Sequence[Mark], other: Sequence[Mark], prints: dict[tuple[Hashable, ...], int]) -> list[_Key]:
    again = _recurring(marks)
    theirs = {mk.call.call_site for mk in other if mk.call is not None}
    out: list[_Key] = []
    for mk in marks:
        c = mk.call
        if c is None:
            out.append(None)
        else:
            fp = fingerprint(c)
            site = c.call_site
            out.append((prints.setdefault(fp, len(prints)), site, site in again and site not in theirs))
    return out


#: How far from the diagonal the alignment looks: edits more than this many calls apart in the
#: two traces are not one story.
BAND = 8


def _path(mine: Sequence[Mark], theirs: Sequence[Mark]) -> tuple[list[tuple[str, int, int]], int, int]:
    """The cheapest alignment (both starts fixed, both ends free): the operations in order, and
    where each trace's aligned part ends (what follows is past the other's end)."""
    n, m = len(mine), len(theirs)
    prints: dict[tuple[Hashable, ...], int] = {}
    km, kt = _keys(mine, theirs, prints), _keys(theirs, mine, prints)
    by_index = {index: fp for fp, index in prints.items()}
    alike_ids: dict[tuple[int, int], bool] = {}
    subs: dict[tuple[_Key, _Key], float] = {}

    def sub(a: _Key, b: _Key) -> float:
        cost = subs.get((a, b))
        if cost is not None:
            return cost
        if a is None or b is None:
            cost = 0.0 if a is None and b is None else inf  # forward passes: see ``_marks``
        else:
            pair = (a[0], b[0])
            ok = alike_ids.get(pair)
            if ok is None:
                fa, fb = by_index[a[0]], by_index[b[0]]
                ok = alike_ids[pair] = len(fa) == len(fb) and all(
                    x is None or y is None or x == y for x, y in zip(fa, fb, strict=True)
                )
            if not ok:
                cost = SUBSTITUTE
            elif not a[1] or not b[1] or a[1] == b[1]:
                cost = 0.0
            else:  # alike from other lines: a branch of the loop, where each line comes back in its trace
                cost = OTHER_LINE if a[2] and b[2] else SUBSTITUTE
        subs[(a, b)] = cost
        return cost

    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[str]] = [[""] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    again = _recurring(mine)
    ins_cost = [
        INDEL_FORWARD if mk.call is None else INDEL_CALL + (EXTRA_AGAIN if mk.call.call_site in again else 0.0)
        for mk in mine
    ]
    del_cost = [INDEL_FORWARD if k is None else INDEL_CALL for k in kt]
    for i in range(n + 1):
        row, brow = cost[i], back[i]
        up = cost[i - 1] if i else row
        for j in range(max(0, i - BAND), min(m, i + BAND) + 1):
            if i == 0 and j == 0:
                continue
            best, how = inf, ""
            if i and j:  # diagonal first: of equal costs, a match or a substitution
                s = sub(km[i - 1], kt[j - 1])
                if s == 0.0 and km[i - 1] is None and mine[i - 1].forward != theirs[j - 1].forward:
                    s = OTHER_FORWARD  # forward passes of other counts: one rank ran one more
                best, how = up[j - 1] + s, (_MATCH if s < SUBSTITUTE else _SUB)
            if j:
                c = row[j - 1] + del_cost[j - 1]
                if c < best:
                    best, how = c, _DEL
            if i:
                c = up[j] + ins_cost[i - 1]
                if c < best:
                    best, how = c, _INS
            row[j], brow[j] = best, how
    # free ends: the cheapest cell of the last row or column; of equal costs, the one that aligns
    # the most (the traces start at a place known to agree: an edit is put as late as it can be)
    ends = [(cost[n][j], -(n + j), n, j) for j in range(m + 1)] + [(cost[i][m], -(i + m), i, m) for i in range(n + 1)]
    _, _, i, j = min(ends)
    end = (0.0, i, j)
    ops: list[tuple[str, int, int]] = []
    while i or j:
        how = back[i][j]
        if how in (_MATCH, _SUB):
            i, j = i - 1, j - 1
        elif how == _DEL:
            j -= 1
        else:
            i -= 1
        ops.append((how, i, j))
    ops.reverse()
    return ops, end[1], end[2]


def align(mine: Sequence[Mark], theirs: Sequence[Mark]) -> Edit:
    """The first edit of ``mine`` (the culprit's trace) that gives ``theirs`` (a reference's),
    both starting at one place of the program."""
    mine, theirs = mine[:WINDOW], theirs[:WINDOW]
    ops, mine_end, theirs_end = _path(mine, theirs)
    ahead = sum(1 for mk in mine[mine_end:] if mk.call is not None)
    behind = sum(1 for mk in theirs[theirs_end:] if mk.call is not None)
    for k, (how, i, j) in enumerate(ops):
        if how == _MATCH:
            continue
        if (how == _DEL and theirs[j].call is None) or (how == _INS and mine[i].call is None):
            continue  # a forward pass moved: the calls around it tell
        later = sum(1 for h, a, _ in ops[k + 1 :] if h == _MATCH and mine[a].call is not None)
        forward = _forward_before(theirs, j)
        if how == _DEL:
            went_on = _next_call(mine, i)
            run = _deleted_run(ops, k, theirs)
            return Edit(
                EditKind.SKIPPED,
                theirs=theirs[j].call,
                forward=forward,
                # alone of its kind where it stands, or every one of a run of alike calls skipped
                # (a backward's buckets: the forward pass before them says which)
                pinned=_pinned(theirs, j) or run == _run_length(theirs, j),
                count=run,
                # its later calls are the reference's, or (none yet) the program's earlier rounds
                # make its next call right after the one it lacks
                confirmed=later > 0 or (went_on is not None and _follows(theirs, j, went_on)),
                went_on=went_on,
                behind=behind,
                ahead=ahead,
                step=_step_of(theirs, j, theirs[j].call),
            )
        if how == _INS:
            return Edit(
                EditKind.EXTRA,
                mine=mine[i].call,
                forward=forward,
                pinned=_pinned(mine, i),
                confirmed=later > 0,
                behind=behind,
                ahead=ahead,
                step=_step_of(mine, i, mine[i].call),
            )
        mine_call, theirs_call = mine[i].call, theirs[j].call
        assert mine_call is not None and theirs_call is not None
        if later and alike(mine_call, theirs_call):
            continue  # one collective from two lines once (a branch before the loop), then in step again
        if later == 0 and _follows(theirs, j, mine_call):
            # nothing after it yet, but the program's earlier rounds make this call right after
            # the one the culprit lacks: it skipped that one and went on
            return Edit(
                EditKind.SKIPPED,
                theirs=theirs_call,
                forward=forward,
                pinned=True,
                confirmed=True,
                went_on=mine_call,
                behind=behind,
                ahead=ahead,
                step=_step_of(theirs, j, theirs_call),
            )
        step = _step_of(theirs, j, theirs_call)
        return Edit(
            EditKind.DIFFERENT,
            mine=mine_call,
            theirs=theirs_call,
            forward=forward,
            behind=behind,
            ahead=ahead,
            step=step,
        )
    if behind:
        nxt = next(mk.call for mk in theirs[theirs_end:] if mk.call is not None)
        step = _step_of(theirs, theirs_end, nxt)
        return Edit(EditKind.SHORT, theirs=nxt, forward=_forward_before(theirs, theirs_end), behind=behind, step=step)
    return Edit(EditKind.SAME, ahead=ahead)


def _forward_before(marks: Sequence[Mark], j: int) -> int:
    mark = _marker_before(marks, j)
    return 0 if mark is None else mark.forward


def _marker_before(marks: Sequence[Mark], j: int) -> Mark | None:
    for mk in reversed(marks[:j]):
        if mk.call is None:
            return mk
    return None


def _step_of(marks: Sequence[Mark], j: int, call: r.CallRecord | None) -> int:
    if call is None:
        return -1
    if call.source == "python":
        return call.step
    mark = _marker_before(marks, j)
    return mark.step if mark is not None else -1


def _deleted_run(ops: Sequence[tuple[str, int, int]], k: int, theirs: Sequence[Mark]) -> int:
    """How many calls alike the reference made, one after another, the culprit lacks from the
    ``k``-th operation on."""
    first = theirs[ops[k][2]].call
    assert first is not None
    n = 0
    for how, _, j in ops[k:]:
        call = theirs[j].call
        if how != _DEL or call is None or not same(call, first):
            break
        n += 1
    return n


def _run_length(marks: Sequence[Mark], j: int) -> int:
    """How many calls the same as ``marks[j]`` stand in a row around it (a forward pass ends a row)."""
    call = marks[j].call
    assert call is not None
    lo = hi = j
    while lo > 0 and (c := marks[lo - 1].call) is not None and same(c, call):
        lo -= 1
    while hi + 1 < len(marks) and (c := marks[hi + 1].call) is not None and same(c, call):
        hi += 1
    return hi - lo + 1


def _next_call(marks: Sequence[Mark], i: int) -> r.CallRecord | None:
    return next((mk.call for mk in marks[i:] if mk.call is not None), None)


def _pinned(marks: Sequence[Mark], j: int) -> bool:
    """Whether the call at ``j`` is the only one of its kind where it stands: no call the same
    right before or after it (a forward pass between stops the run)."""
    call = marks[j].call
    assert call is not None
    for k in (j - 1, j + 1):
        if 0 <= k < len(marks) and (other := marks[k].call) is not None and same(other, call):
            return False
    return True


def _follows(marks: Sequence[Mark], j: int, call: r.CallRecord) -> bool:
    """Whether, earlier in ``marks``, the call the program makes right after one the same as
    ``marks[j]`` is the same as ``call``."""
    skipped = marks[j].call
    assert skipped is not None
    calls = [mk.call for mk in marks[:j] if mk.call is not None]
    return any(same(a, skipped) and same(b, call) for a, b in itertools.pairwise(calls))


def precedented(marks: Sequence[Mark], call: r.CallRecord, context: int = 2) -> bool:
    """Whether ``call`` follows the ``context`` calls before it in ``marks`` the way some earlier
    place of the trace did: the program's own rounds have made this call after those. True where
    the trace holds too little to tell (no earlier place with that context)."""
    calls = [mk.call for mk in marks if mk.call is not None]
    at = next((k for k, c in enumerate(calls) if c.call_id == call.call_id), -1)
    if at < context:
        return True
    before = calls[at - context : at]
    seen = False
    for k in range(context, at):
        if all(same(a, b) for a, b in zip(calls[k - context : k], before, strict=True)):
            seen = True
            if same(calls[k], call):
                return True
    return not seen
