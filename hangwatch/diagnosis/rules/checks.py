"""Single-call ("intrinsic") checks: is one rank's call consistent in itself, against the group
size? E.g. an all_gather output list must hold one tensor per rank, each of the input's dtype
and shape; all_to_all_single split sizes must add up to dim 0.

They need no other rank, so they run before the cross-rank comparisons: with two ranks, the
one whose call contradicts the group size is the culprit. Catalogue rows name their check
(``hangwatch.catalogue.Op.check``); :data:`CHECKS` is the registry those names refer to, and
this module refuses to import when a row names a check that is not registered here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hangwatch import catalogue
from hangwatch.catalogue import INPUT_SPLITS, OUTPUT_SPLITS, SPLITS_VARY, canonical_op, parse_ints
from hangwatch.diagnosis.incidents import IncidentKind
from hangwatch.records import CallRecord, TensorMeta
from hangwatch.wording import format_shape, tensors_word
from hangwatch.wording import mismatches as words

SHAPE_MISMATCH = IncidentKind.SHAPE_MISMATCH
DTYPE_MISMATCH = IncidentKind.DTYPE_MISMATCH


@dataclass(frozen=True)
class Problem:
    """Something wrong with one rank's call on its own (against the group size)."""

    kind: IncidentKind
    text: str  # completes "rank 3 ..."
    hint: str


#: A check: (one rank's call, the group size if known) -> its problems, dtype ones first.
Intrinsic = Callable[[CallRecord, "int | None"], "list[Problem]"]


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def single(metas: Sequence[TensorMeta]) -> TensorMeta | None:
    return metas[0] if len(metas) == 1 else None


def _check_list(
    op: str, lst: Sequence[TensorMeta], ref: TensorMeta | None, gs: int | None, name: str, ref_name: str
) -> list[Problem]:
    """A per-rank tensor list (``name``) against the group size and the rank's own ``ref``."""
    problems: list[Problem] = []
    if gs is not None and len(lst) != gs:
        problems.append(Problem(SHAPE_MISMATCH, *words.list_length(op, name, tensors_word(len(lst)), gs)))
    if ref is not None:
        for k, meta in enumerate(lst):
            if meta.dtype != ref.dtype:
                problems.insert(
                    0,
                    Problem(DTYPE_MISMATCH, *words.list_dtype(op, name, k, meta.dtype, ref_name, ref.dtype)),
                )
                break
            if meta.shape != ref.shape:
                problems.append(
                    Problem(
                        SHAPE_MISMATCH,
                        *words.list_shape(op, name, k, format_shape(meta.shape), ref_name, format_shape(ref.shape)),
                    )
                )
                break
    return problems


def _all_gather(c: CallRecord, gs: int | None) -> list[Problem]:
    if not c.outputs:
        return []
    return _check_list("all_gather", c.outputs, single(c.inputs), gs, "output", "input")


def _gather(c: CallRecord, gs: int | None) -> list[Problem]:
    if c.root is None or c.rank != c.root or not c.outputs:
        return []  # only the root has a gather list
    return _check_list("gather", c.outputs, single(c.inputs), gs, "gather", "input")


def _scatter(c: CallRecord, gs: int | None) -> list[Problem]:
    if c.root is None or c.rank != c.root or not c.inputs:
        return []  # only the root has a scatter list
    return _check_list("scatter", c.inputs, single(c.outputs), gs, "scatter", "output")


def _reduce_scatter(c: CallRecord, gs: int | None) -> list[Problem]:
    if not c.inputs:
        return []
    return _check_list("reduce_scatter", c.inputs, single(c.outputs), gs, "input", "output")


def _numel_ratio(
    op: str, small: Sequence[TensorMeta], big: Sequence[TensorMeta], gs: int | None, small_name: str
) -> list[Problem]:
    """``big`` must hold group size x ``small`` elements (element-wise for coalesced lists)."""
    if not small or len(small) != len(big):
        return []
    big_name = "output" if small_name == "input" else "input"
    for k, (s, b) in enumerate(zip(small, big, strict=True)):
        which = f" {k}" if len(small) > 1 else ""
        if s.dtype != b.dtype:
            return [Problem(DTYPE_MISMATCH, *words.ratio_dtype(op, big_name, b.dtype, small_name, s.dtype, which))]
        n_small, n_big = numel(s.shape), numel(b.shape)
        if gs is not None and n_big != gs * n_small:
            return [
                Problem(
                    SHAPE_MISMATCH,
                    *words.ratio_size(
                        op,
                        big_name,
                        format_shape(b.shape),
                        n_big,
                        small_name,
                        format_shape(s.shape),
                        which,
                        gs,
                        gs * n_small,
                    ),
                )
            ]
        if gs is None and n_small and n_big % n_small:
            return [
                Problem(
                    SHAPE_MISMATCH,
                    *words.ratio_multiple(
                        op, big_name, format_shape(b.shape), n_big, small_name, format_shape(s.shape), which, n_small
                    ),
                )
            ]
    return []


def _all_gather_into_tensor(c: CallRecord, gs: int | None) -> list[Problem]:
    return _numel_ratio(canonical_op(c.op), c.inputs, c.outputs, gs, "input")


def _reduce_scatter_tensor(c: CallRecord, gs: int | None) -> list[Problem]:
    return _numel_ratio(canonical_op(c.op), c.outputs, c.inputs, gs, "output")


def _all_to_all(c: CallRecord, gs: int | None) -> list[Problem]:
    problems: list[Problem] = []
    if gs is None:
        return problems
    for name, lst in (("input", c.inputs), ("output", c.outputs)):
        if lst and len(lst) != gs:
            problems.append(Problem(SHAPE_MISMATCH, *words.list_length("all_to_all", name, tensors_word(len(lst)), gs)))
    return problems


def _all_to_all_single(c: CallRecord, gs: int | None) -> list[Problem]:
    problems: list[Problem] = []
    for key, name, metas in ((INPUT_SPLITS, "input", c.inputs), (OUTPUT_SPLITS, "output", c.outputs)):
        meta = single(metas)
        if meta is None or not meta.shape:
            continue
        dim0 = meta.shape[0]
        if c.extra.get(key) == SPLITS_VARY:
            continue  # not recorded
        splits = parse_ints(c.extra.get(key))
        if splits is None:
            if gs and dim0 % gs:
                problems.append(
                    Problem(SHAPE_MISMATCH, *words.uneven_split(name, format_shape(meta.shape), key, dim0, gs))
                )
            continue
        if gs is not None and len(splits) != gs:
            problems.append(Problem(SHAPE_MISMATCH, *words.split_count(key, len(splits), gs)))
        elif sum(splits) != dim0:
            problems.append(
                Problem(SHAPE_MISMATCH, *words.split_sum(key, list(splits), name, format_shape(meta.shape), dim0))
            )
    return problems


#: The checks catalogue rows name (``Op.check``).
CHECKS: dict[str, Intrinsic] = {
    "all_gather": _all_gather,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
}

_named = {op.check for op in catalogue.OPS if op.check is not None}
if _named != CHECKS.keys():
    raise ValueError(f"catalogue checks and registered checks differ: {sorted(_named ^ CHECKS.keys())}")
