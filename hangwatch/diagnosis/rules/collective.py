"""The cross-rank rule chain: do the calls ranks made at one (group, seq) slot disagree, and how?

The coordinator aligns calls across ranks per (process group, sequence number) and hands each
slot to :func:`compare_collective`. Rules (the first that finds a disagreement wins; one
:class:`~hangwatch.diagnosis.rules.slot.Mismatch` per slot):

1. ``op`` (spellings normalised by the catalogue, e.g. ``_allgather_base`` ==
   ``all_gather_into_tensor``; async and sync are the same op) -> ``op_mismatch``.
2. group membership (``extra["group_ranks"]`` where recorded) -> ``arg_mismatch``.
3. root (``src``/``dst``) of rooted ops -> ``arg_mismatch``.
4. dtypes: first each rank's own consistency (e.g. all_gather outputs must have the input's
   dtype), then the dtypes every rank must agree on -> ``dtype_mismatch``.
5. each rank's own consistency against the group size (output list length, output numel
   = group size x input numel, split sizes summing to dim 0, ...) -> ``shape_mismatch``.
   These come before the cross-rank comparisons because they need no majority: with two
   ranks, the one whose call contradicts the group size is the culprit.
6. list lengths, then shapes, of the tensors every rank must agree on -> ``shape_mismatch``.
7. all-to-all pairing (rank i's output chunk j against rank j's input chunk i) ->
   ``shape_mismatch`` (:mod:`~hangwatch.diagnosis.rules.alltoall`).
8. reduce op -> ``arg_mismatch``.

Which tensors are compared depends on the op (its catalogue row's ``Agree``): e.g. only the
root of ``gather`` has an output list and only the root of ``scatter`` has an input list, so
those are never compared across ranks; ``all_to_all`` inputs legitimately differ across ranks
and are checked pairwise. Culprits and ties: see :mod:`~hangwatch.diagnosis.rules.slot`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hangwatch.catalogue import canonical_op, norm_reduce
from hangwatch.diagnosis.incidents import IncidentKind
from hangwatch.diagnosis.rules.alltoall import rule_pairwise
from hangwatch.diagnosis.rules.checks import Problem
from hangwatch.diagnosis.rules.slot import (
    ARG_MISMATCH,
    DTYPE_MISMATCH,
    OP_MISMATCH,
    SHAPE_MISMATCH,
    Mismatch,
    SlotCalls,
    field_label,
    group_ranks,
    reference,
)
from hangwatch.records import CallRecord
from hangwatch.wording import (
    conj,
    format_dtypes,
    format_ranks,
    format_shapes,
    is_objects,
    listing,
    ranks_label,
    tensors_word,
)
from hangwatch.wording import mismatches as words


def _rule_op(s: SlotCalls) -> Mismatch | None:
    sigs = {r: canonical_op(c.op) for r, c in s.calls.items()}
    if len(set(sigs.values())) < 2:
        return None
    ref = reference(sigs, None)
    culprits = [r for r in sigs if r not in ref]
    ref_op = sigs[min(ref)]
    bad_ops = sorted({sigs[r] for r in culprits})
    summary = words.op_summary(s.group, s.seq, listing(sigs))
    hint = words.op_hint(
        s.group,
        ranks_label(culprits),
        " / ".join(bad_ops),
        s.sites(culprits),
        ranks_label(ref),
        ref_op,
        s.sites(sorted(ref)),
    )
    return s.mismatch(OP_MISMATCH, culprits, summary, hint)


def _rule_group_ranks(s: SlotCalls) -> Mismatch | None:
    sigs = {r: tuple(sorted(g)) for r, c in s.calls.items() if (g := group_ranks(c)) is not None}
    return s.cross(
        sigs,
        ARG_MISMATCH,
        "group membership mismatch",
        lambda r: "{" + format_ranks(sigs[r]) + "}",
        lambda ref, bad: words.group_ranks_hint(s.group, s.which(bad, "create")),
        prefer=lambda _sig, _ranks: False,
    )


def _rule_root(s: SlotCalls) -> Mismatch | None:
    name = s.spec.root
    if name is None:
        return None
    sigs = {r: c.root for r, c in s.calls.items() if c.root is not None}
    if len(set(sigs.values())) < 2:
        return None

    def hint(ref: list[int], bad: list[int]) -> str:
        root = sigs[ref[0]]
        return words.root_hint(name, s.op, ranks_label(ref), conj("pass", ref), root, s.which(bad, "pass"))

    return s.cross(
        sigs,
        ARG_MISMATCH,
        f"{name} mismatch",
        lambda r: f"{name}={sigs[r]}",
        hint,
        prefer=lambda sig, ranks: sig in ranks,
    )


def _rule_dtypes(s: SlotCalls) -> Mismatch | None:
    for field in (*s.spec.full, *s.spec.dtypes):
        found = _dtype_field(s, field)
        if found:
            return found
    return None


def _dtype_field(s: SlotCalls, field: str) -> Mismatch | None:
    metas = s.present(field)
    if len({len(m) for m in metas.values()}) <= 1:
        sigs = {r: tuple(m.dtype for m in ms) for r, ms in metas.items()}
    else:  # lengths differ (reported as a shape mismatch): compare the dtypes used
        sigs = {r: tuple(dict.fromkeys(m.dtype for m in ms)) for r, ms in metas.items()}
    label = field_label(field)

    def show(r: int) -> str:
        return format_dtypes(sigs[r])

    def hint(ref: list[int], bad: list[int]) -> str:
        dtypes = format_dtypes(sigs[ref[0]])
        return words.dtype_hint(label, s.op, ranks_label(ref), conj("use", ref), dtypes, s.which(bad, "use"))

    return s.cross(sigs, DTYPE_MISMATCH, f"{label}dtype mismatch", show, hint)


def _intrinsic(s: SlotCalls, kind: IncidentKind) -> Mismatch | None:
    """Ranks whose call is inconsistent in itself (against the group size) in the way ``kind``."""
    check = s.spec.intrinsic
    if check is None:
        return None
    first: dict[int, Problem] = {}
    for r, c in s.calls.items():
        problem = next((p for p in check(c, s.gs) if p.kind == kind), None)
        if problem is not None:
            first[r] = problem
    if not first:
        return None
    culprits = sorted(first)
    what = "dtype mismatch" if kind == DTYPE_MISMATCH else "shape mismatch"
    summary = words.intrinsic_summary(s.head(what), {r: p.text for r, p in first.items()})
    hint = words.check_where(first[culprits[0]].hint, s.where(culprits))
    return s.mismatch(kind, culprits, summary, hint)


def _rule_intrinsic_dtype(s: SlotCalls) -> Mismatch | None:
    return _intrinsic(s, DTYPE_MISMATCH)


def _rule_intrinsic_shape(s: SlotCalls) -> Mismatch | None:
    return _intrinsic(s, SHAPE_MISMATCH)


def _rule_lengths(s: SlotCalls) -> Mismatch | None:
    for field in (*s.spec.full, *s.spec.lengths):
        found = _length_field(s, field)
        if found:
            return found
    return None


def _length_field(s: SlotCalls, field: str) -> Mismatch | None:
    metas = s.present(field)
    if any(is_objects(m) for ms in metas.values() for m in ms):
        return None  # an object list's length is its shape: compared by _rule_shapes
    sigs = {r: len(ms) for r, ms in metas.items()}
    label = field_label(field)

    def show(r: int) -> str:
        return tensors_word(sigs[r])

    def hint(ref: list[int], bad: list[int]) -> str:
        return words.length_hint(label, s.op, ranks_label(ref), conj("pass", ref), sigs[ref[0]], s.which(bad, "pass"))

    return s.cross(sigs, SHAPE_MISMATCH, f"{label}list length mismatch", show, hint)


def _rule_shapes(s: SlotCalls) -> Mismatch | None:
    for field in s.spec.full:
        found = _shape_field(s, field)
        if found:
            return found
    return None


def _shape_field(s: SlotCalls, field: str) -> Mismatch | None:
    metas = s.present(field)
    sigs = {r: tuple(m.shape for m in ms) for r, ms in metas.items()}
    objects = any(is_objects(m) for ms in metas.values() for m in ms)
    label = field_label(field)
    what = "list length mismatch" if objects else f"{label}shape mismatch"
    needs = s.spec.note if s.spec.note and field == s.spec.full[0] else f"{label}tensors of the same shape"

    def show(r: int) -> str:
        return format_shapes(metas[r])

    def hint(ref: list[int], bad: list[int]) -> str:
        return words.shape_hint(needs, s.op, s.which(bad, "pass" if objects else "build"), objects)

    return s.cross(sigs, SHAPE_MISMATCH, what, show, hint)


def _rule_reduce_op(s: SlotCalls) -> Mismatch | None:
    if not s.spec.reduce:
        return None
    sigs = {r: norm_reduce(c.reduce_op) for r, c in s.calls.items() if c.reduce_op}
    return s.cross(
        sigs,
        ARG_MISMATCH,
        "reduce op mismatch",
        lambda r: sigs[r],
        lambda ref, bad: words.reduce_hint(s.op, ranks_label(ref), conj("use", ref), sigs[ref[0]], s.which(bad, "use")),
    )


_RULES: tuple[Callable[[SlotCalls], Mismatch | None], ...] = (
    _rule_op,
    _rule_group_ranks,
    _rule_root,
    _rule_intrinsic_dtype,
    _rule_dtypes,
    _rule_intrinsic_shape,
    _rule_lengths,
    _rule_shapes,
    rule_pairwise,
    _rule_reduce_op,
)


def compare_collective(calls: Mapping[int, CallRecord], group_size: int | None = None) -> Mismatch | None:
    """The first disagreement among the calls (keyed by rank) that members of one group made at
    the same seq, or None if they agree. ``group_size`` (else the length of
    ``extra["group_ranks"]``) enables the checks against the group size.

    Culprits are the ranks outside the largest group that agrees on the value a rule looks at.
    Ties: for rooted ops the side containing the root is the reference (for a root mismatch,
    the side whose claimed root is one of its own ranks); otherwise the side with the lowest
    rank. See the module docstring for the order of the rules.
    """
    if not calls:
        return None
    slot = SlotCalls(calls, group_size)
    for rule in _RULES:
        found = rule(slot)
        if found is not None:
            return found
    return None
