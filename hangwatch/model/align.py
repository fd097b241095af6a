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


def trace(calls: Iterable[r.CallRecord], forwards: Iterable[Forward] = ()) -> list[Mark]:
    """A rank's calls in the order it made them, each DDP forward pass before the first call it
    was followed by on its group (at the end where none is yet)."""
    ordered = sorted(calls, key=lambda c: c.call_id)
    marks: list[Mark] = []
    pending = sorted(forwards)
    for c in ordered:
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


#: Costs (see the module docstring).
OTHER_LINE = 0.3
SUBSTITUTE = 1.0
INDEL_CALL = 1.0
INDEL_FORWARD = 1.5
#: Elements of each trace aligned at most (the newest): a few rounds of a training loop.
WINDOW = 192

_MATCH, _SUB, _DEL, _INS = "match", "sub", "del", "ins"  # del: the reference's only; ins: the culprit's only


def _recurring(marks: Sequence[Mark]) -> set[str]:
    """The lines a trace made calls from more than once: its loop's."""
    seen: set[str] = set()
    again: set[str] = set()
    for mk in marks:
        if mk.call is not None:
            (again if mk.call.call_site in seen else seen).add(mk.call.call_site)
    return again


def _sub(a: Mark, b: Mark, lines: tuple[set[str], set[str]]) -> float:
    if a.call is None or b.call is None:
        return 0.0 if a.call is None and b.call is None else float("inf")
    if not alike(a.call, b.call):
        return SUBSTITUTE
    if same(a.call, b.call):
        return 0.0
    # alike from other lines: a branch of the loop issuing it from two lines, where each line
    # comes back in its trace; a line made once is a call of its own
    return OTHER_LINE if a.call.call_site in lines[0] and b.call.call_site in lines[1] else SUBSTITUTE


def _indel(m: Mark) -> float:
    return INDEL_FORWARD if m.call is None else INDEL_CALL


def _path(mine: Sequence[Mark], theirs: Sequence[Mark]) -> tuple[list[tuple[str, int, int]], int, int]:
    """The cheapest alignment (both starts fixed, both ends free): the operations in order, and
    where each trace's aligned part ends (what follows is past the other's end)."""
    n, m = len(mine), len(theirs)
    lines = (_recurring(mine), _recurring(theirs))
    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[str]] = [[""] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    for i in range(n + 1):
        row, up = cost[i], cost[i - 1] if i else None
        for j in range(m + 1):
            if i == 0 and j == 0:
                continue
            best, how = inf, ""
            if i and j:  # diagonal first: of equal costs, a match or a substitution
                s = _sub(mine[i - 1], theirs[j - 1], lines)
                best, how = up[j - 1] + s, (_MATCH if s < SUBSTITUTE else _SUB)  # type: ignore[index]
            if j:
                c = row[j - 1] + _indel(theirs[j - 1])
                if c < best:
                    best, how = c, _DEL
            if i:
                c = up[j] + _indel(mine[i - 1])  # type: ignore[index]
                if c < best:
                    best, how = c, _INS
            row[j], back[i][j] = best, how
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
            return Edit(
                EditKind.SKIPPED,
                theirs=theirs[j].call,
                forward=forward,
                pinned=_pinned(theirs, j),
                confirmed=later > 0,
                went_on=_next_call(mine, i),
                behind=behind,
                ahead=ahead,
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
            )
        return Edit(EditKind.DIFFERENT, mine=mine_call, theirs=theirs_call, forward=forward, behind=behind, ahead=ahead)
    if behind:
        nxt = next(mk.call for mk in theirs[theirs_end:] if mk.call is not None)
        return Edit(EditKind.SHORT, theirs=nxt, forward=_forward_before(theirs, theirs_end), behind=behind)
    return Edit(EditKind.SAME, ahead=ahead)


def _forward_before(marks: Sequence[Mark], j: int) -> int:
    for mk in reversed(marks[:j]):
        if mk.call is None:
            return mk.forward
    return 0


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
