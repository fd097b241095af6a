"""Op-aware comparison rules: do the calls ranks made at one slot disagree, and how?

Pure functions on :class:`~hangwatch.records.CallRecord` values. The coordinator aligns calls
across ranks per (process group, sequence number) and hands each slot to
:func:`compare_collective`; point-to-point calls go to :func:`match_p2p` (a send and the recv
that pairs with it) and :func:`unmatched_p2p` (blocked sends/recvs whose peer is busy with
something else). :func:`explain_extra_call` recognises the common "one rank made one extra
collective and everything after it is shifted" pattern.

Rules (the first that finds a disagreement wins; one :class:`Mismatch` per slot):

1. ``op`` (spellings normalised, e.g. ``_allgather_base`` == ``all_gather_into_tensor``;
   async and sync are the same op) -> ``op_mismatch``.
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
   ``shape_mismatch``.
8. reduce op -> ``arg_mismatch``.

Which tensors are compared depends on the op: e.g. only the root of ``gather`` has an output
list and only the root of ``scatter`` has an input list, so those are never compared across
ranks; ``all_to_all`` inputs legitimately differ across ranks and are checked pairwise.

Culprits: the ranks are grouped by the value the rule looks at; the largest group is the
reference and every other rank is a culprit. Ties (e.g. two ranks) go, for rooted ops, to the
side that contains the root (when comparing roots: the side whose claimed root is one of its
own ranks) and otherwise to the side holding the lowest rank. Ranks whose record lacks the
value (no tensors recorded, no root, ...) are left out of that rule rather than guessed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hangwatch.coordinator.incidents import IncidentKind
from hangwatch.records import RECV_OPS, SEND_OPS, CallRecord, TensorMeta

OP_MISMATCH = IncidentKind.OP_MISMATCH
SHAPE_MISMATCH = IncidentKind.SHAPE_MISMATCH
DTYPE_MISMATCH = IncidentKind.DTYPE_MISMATCH
ARG_MISMATCH = IncidentKind.ARG_MISMATCH
P2P_MISMATCH = IncidentKind.P2P_MISMATCH

INPUT_SPLITS = "input_split_sizes"
OUTPUT_SPLITS = "output_split_sizes"
GROUP_RANK = "group_rank"
GROUP_RANKS = "group_ranks"

#: How many tensors :func:`describe_call` shows before "… (+N)".
_SHOW_TENSORS = 3


@dataclass(frozen=True)
class Mismatch:
    """A disagreement between ranks, worded for a person."""

    kind: IncidentKind  # one of the five *_mismatch kinds
    culprit_ranks: tuple[int, ...]  # the ranks that disagree with the rest
    agreeing_ranks: tuple[int, ...]
    summary: str  # one line
    details: dict[int, str]  # rank -> how that rank called it (describe_call)
    hint: str  # what to do


# --------------------------------------------------------------------------------------------
# Op names


#: Other spellings of the same collective -> the name used in these rules.
_OP_ALIASES: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "_allgather_base": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "all_gather_base": "all_gather_into_tensor",
    "allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reducescatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_base": "reduce_scatter_tensor",
    "_reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_base": "all_to_all_single",
    "alltoall_single": "all_to_all_single",
}


def canonical_op(op: str) -> str:
    """The rules' name for ``op``: lower case, without a backend prefix (Flight Recorder's
    ``gloo:all_reduce``), a module prefix, peer annotations (``nccl:send 0->1``) or an
    ``_async`` suffix, and with aliases resolved (``_allgather_base`` ->
    ``all_gather_into_tensor``)."""
    name = op.strip().lower()
    name = name.rsplit(":", 1)[-1].strip()
    name = name.split()[0] if name.split() else name
    name = name.rsplit(".", 1)[-1]
    name = name.removesuffix("_async")
    if name in _OP_ALIASES:
        return _OP_ALIASES[name]
    stripped = name.lstrip("_")
    return _OP_ALIASES.get(stripped, stripped)


def _norm_reduce(reduce_op: str) -> str:
    """``ReduceOp.SUM`` / ``<RedOpType.SUM: 0>`` / ``sum`` -> ``SUM``."""
    text = reduce_op.strip().strip("<>").split(":")[0].strip()
    return text.rsplit(".", 1)[-1].upper()


# --------------------------------------------------------------------------------------------
# Formatting


def format_shape(shape: tuple[int, ...]) -> str:
    """``(1, 2, 5)`` -> ``"[1, 2, 5]"``; a scalar ``()`` -> ``"[]"``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"`` (sorted, duplicates dropped, runs collapsed)."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j == i:
            parts.append(str(ordered[i]))
        elif j == i + 1:
            parts.append(f"{ordered[i]}, {ordered[j]}")
        else:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


def _ranks_label(ranks: Iterable[int]) -> str:
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {format_ranks(ordered)}"


def _conj(verb: str, ranks: Sequence[int]) -> str:
    """``verb`` agreeing with ``ranks``: ``"rank 0 uses"`` / ``"ranks 0, 1 use"``."""
    if len(set(ranks)) != 1:
        return verb
    return verb + ("es" if verb.endswith(("s", "sh", "ch")) else "s")


def _listing(shown: Mapping[int, str]) -> str:
    """``{0: "[1, 5]", 1: "[1, 5]", 2: "[2]"}`` -> ``"ranks 0, 1: [1, 5]; rank 2: [2]"``."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(shown):
        by_text.setdefault(shown[rank], []).append(rank)
    groups = sorted(by_text.items(), key=lambda item: item[1][0])
    return "; ".join(f"{_ranks_label(ranks)}: {text}" for text, ranks in groups)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _is_objects(meta: TensorMeta) -> bool:
    return meta.dtype == "object"


def _format_objects(meta: TensorMeta) -> str:
    if len(meta.shape) == 1:
        n = meta.shape[0]
        return f"{n} object" if n == 1 else f"{n} objects"
    return f"{format_shape(meta.shape)} object"


def _format_metas(metas: Sequence[TensorMeta], limit: int = _SHOW_TENSORS) -> str:
    """Compact tensors: ``"[1, 5] float32"``, ``"[2], [2], [3] … (+5) float32"``."""
    if not metas:
        return ""
    if all(_is_objects(m) for m in metas):
        return ", ".join(_format_objects(m) for m in metas[:limit]) + _more(len(metas), limit)
    shown = metas[:limit]
    dtypes = {m.dtype for m in metas}
    if len(dtypes) == 1:
        text = ", ".join(format_shape(m.shape) for m in shown) + _more(len(metas), limit)
        return f"{text} {metas[0].dtype}"
    return ", ".join(f"{format_shape(m.shape)} {m.dtype}" for m in shown) + _more(len(metas), limit)


def _more(total: int, limit: int) -> str:
    return f" … (+{total - limit})" if total > limit else ""


def _format_shapes(metas: Sequence[TensorMeta]) -> str:
    """Shapes only: ``"[1, 5]"`` for one tensor, ``"[1, 5], [2] … (+3)"`` for a list."""
    if len(metas) == 1 and _is_objects(metas[0]):
        return _format_objects(metas[0])
    return ", ".join(format_shape(m.shape) for m in metas[:_SHOW_TENSORS]) + _more(len(metas), _SHOW_TENSORS)


def _format_dtypes(dtypes: Sequence[str]) -> str:
    if len(dtypes) == 1:
        return dtypes[0]
    if len(set(dtypes)) == 1:
        return f"{len(dtypes)} x {dtypes[0]}"
    return "[" + ", ".join(dtypes[:_SHOW_TENSORS]) + _more(len(dtypes), _SHOW_TENSORS) + "]"


def _tensors_word(n: int) -> str:
    return "1 tensor" if n == 1 else f"{n} tensors"


# --------------------------------------------------------------------------------------------
# Op specs


@dataclass(frozen=True)
class _Problem:
    """Something wrong with one rank's call on its own (against the group size)."""

    kind: IncidentKind
    text: str  # completes "rank 3 ..."
    hint: str


_Intrinsic = Callable[[CallRecord, "int | None"], "list[_Problem]"]


@dataclass(frozen=True)
class _Spec:
    root: str | None = None  # name of the root argument ("src"/"dst") of rooted ops
    reduce: bool = False  # reduce_op must match
    full: tuple[str, ...] = ()  # CallRecord fields every rank must agree on (length, dtypes, shapes)
    dtypes: tuple[str, ...] = ()  # fields whose dtypes (only) every rank must agree on
    lengths: tuple[str, ...] = ()  # fields whose list lengths (only) every rank must agree on
    intrinsic: _Intrinsic | None = None
    pairwise: str | None = None  # "single" (all_to_all_single) | "list" (all_to_all)
    note: str = ""  # what the tensors are, for hints


def _check_list(
    op: str, lst: Sequence[TensorMeta], ref: TensorMeta | None, gs: int | None, name: str, ref_name: str
) -> list[_Problem]:
    """A per-rank tensor list (``name``) against the group size and the rank's own ``ref``."""
    problems: list[_Problem] = []
    if gs is not None and len(lst) != gs:
        problems.append(
            _Problem(
                SHAPE_MISMATCH,
                f"passes {_tensors_word(len(lst))} in its {name} list, but the group has {gs} ranks",
                f"{op} needs exactly one {name} tensor per rank in the group ({gs})",
            )
        )
    if ref is not None:
        for k, meta in enumerate(lst):
            if meta.dtype != ref.dtype:
                problems.insert(
                    0,
                    _Problem(
                        DTYPE_MISMATCH,
                        f"has {name} tensor {k} of dtype {meta.dtype}, but its {ref_name} is {ref.dtype}",
                        f"{op} needs every {name} tensor to have the {ref_name}'s dtype",
                    ),
                )
                break
            if meta.shape != ref.shape:
                problems.append(
                    _Problem(
                        SHAPE_MISMATCH,
                        f"has {name} tensor {k} of shape {format_shape(meta.shape)}, "
                        f"but its {ref_name} has shape {format_shape(ref.shape)}",
                        f"{op} needs every {name} tensor to have the {ref_name}'s shape",
                    )
                )
                break
    return problems


def _single(metas: Sequence[TensorMeta]) -> TensorMeta | None:
    return metas[0] if len(metas) == 1 else None


def _intr_all_gather(c: CallRecord, gs: int | None) -> list[_Problem]:
    if not c.outputs:
        return []
    return _check_list("all_gather", c.outputs, _single(c.inputs), gs, "output", "input")


def _intr_gather(c: CallRecord, gs: int | None) -> list[_Problem]:
    if c.root is None or c.rank != c.root or not c.outputs:
        return []  # only the root has a gather list
    return _check_list("gather", c.outputs, _single(c.inputs), gs, "gather", "input")


def _intr_scatter(c: CallRecord, gs: int | None) -> list[_Problem]:
    if c.root is None or c.rank != c.root or not c.inputs:
        return []  # only the root has a scatter list
    return _check_list("scatter", c.inputs, _single(c.outputs), gs, "scatter", "output")


def _intr_reduce_scatter(c: CallRecord, gs: int | None) -> list[_Problem]:
    if not c.inputs:
        return []
    return _check_list("reduce_scatter", c.inputs, _single(c.outputs), gs, "input", "output")


def _numel_ratio(
    op: str, small: Sequence[TensorMeta], big: Sequence[TensorMeta], gs: int | None, small_name: str
) -> list[_Problem]:
    """``big`` must hold group size x ``small`` elements (element-wise for coalesced lists)."""
    if not small or len(small) != len(big):
        return []
    big_name = "output" if small_name == "input" else "input"
    for k, (s, b) in enumerate(zip(small, big, strict=True)):
        which = f" {k}" if len(small) > 1 else ""
        if s.dtype != b.dtype:
            return [
                _Problem(
                    DTYPE_MISMATCH,
                    f"has {big_name}{which} of dtype {b.dtype}, but its {small_name}{which} is {s.dtype}",
                    f"{op} needs the input and output tensors to have the same dtype",
                )
            ]
        n_small, n_big = _numel(s.shape), _numel(b.shape)
        if gs is not None and n_big != gs * n_small:
            return [
                _Problem(
                    SHAPE_MISMATCH,
                    f"has {big_name}{which} {format_shape(b.shape)} ({n_big} elements), but its "
                    f"{small_name}{which} {format_shape(s.shape)} x {gs} ranks needs {gs * n_small}",
                    f"{op} needs the {big_name} to hold group size x the {small_name}'s elements",
                )
            ]
        if gs is None and n_small and n_big % n_small:
            return [
                _Problem(
                    SHAPE_MISMATCH,
                    f"has {big_name}{which} {format_shape(b.shape)} ({n_big} elements), not a multiple "
                    f"of its {small_name}{which} {format_shape(s.shape)} ({n_small} elements)",
                    f"{op} needs the {big_name} to hold group size x the {small_name}'s elements",
                )
            ]
    return []


def _intr_all_gather_into_tensor(c: CallRecord, gs: int | None) -> list[_Problem]:
    return _numel_ratio(canonical_op(c.op), c.inputs, c.outputs, gs, "input")


def _intr_reduce_scatter_tensor(c: CallRecord, gs: int | None) -> list[_Problem]:
    return _numel_ratio(canonical_op(c.op), c.outputs, c.inputs, gs, "output")


def _intr_all_to_all(c: CallRecord, gs: int | None) -> list[_Problem]:
    problems: list[_Problem] = []
    if gs is None:
        return problems
    for name, lst in (("input", c.inputs), ("output", c.outputs)):
        if lst and len(lst) != gs:
            problems.append(
                _Problem(
                    SHAPE_MISMATCH,
                    f"passes {_tensors_word(len(lst))} in its {name} list, but the group has {gs} ranks",
                    f"all_to_all needs exactly one {name} tensor per rank in the group ({gs})",
                )
            )
    return problems


def _parse_ints(text: str | None) -> tuple[int, ...] | None:
    """``"3,1,2"`` / ``"[3, 1, 2]"`` -> ``(3, 1, 2)``; absent, empty or unreadable -> None."""
    if text is None:
        return None
    body = text.strip().strip("[]()").replace(",", " ").split()
    if not body:
        return None
    try:
        return tuple(int(x) for x in body)
    except ValueError:
        return None


def _intr_all_to_all_single(c: CallRecord, gs: int | None) -> list[_Problem]:
    problems: list[_Problem] = []
    for key, name, metas in ((INPUT_SPLITS, "input", c.inputs), (OUTPUT_SPLITS, "output", c.outputs)):
        meta = _single(metas)
        if meta is None or not meta.shape:
            continue
        dim0 = meta.shape[0]
        splits = _parse_ints(c.extra.get(key))
        if splits is None:
            if gs and dim0 % gs:
                problems.append(
                    _Problem(
                        SHAPE_MISMATCH,
                        f"has {name} {format_shape(meta.shape)} with no {key}, but dim 0 ({dim0}) "
                        f"does not divide evenly over {gs} ranks",
                        f"without {key}, all_to_all_single splits dim 0 evenly over the group",
                    )
                )
            continue
        if gs is not None and len(splits) != gs:
            problems.append(
                _Problem(
                    SHAPE_MISMATCH,
                    f"passes {len(splits)} {key}, but the group has {gs} ranks",
                    f"{key} needs one entry per rank in the group ({gs})",
                )
            )
        elif sum(splits) != dim0:
            problems.append(
                _Problem(
                    SHAPE_MISMATCH,
                    f"has {key} {list(splits)} summing to {sum(splits)}, but its {name} "
                    f"{format_shape(meta.shape)} has {dim0} rows",
                    f"{key} must add up to dim 0 of the {name} tensor",
                )
            )
    return problems


_SPECS: dict[str, _Spec] = {
    "all_reduce": _Spec(reduce=True, full=("inputs",), note="a tensor of the same shape"),
    "all_reduce_coalesced": _Spec(reduce=True, full=("inputs",), note="the same list of tensors"),
    "broadcast": _Spec(root="src", full=("inputs",), note="a tensor of the same shape"),
    "reduce": _Spec(root="dst", reduce=True, full=("inputs",), note="a tensor of the same shape"),
    "all_gather": _Spec(full=("inputs", "outputs"), intrinsic=_intr_all_gather, note="a tensor of the same shape"),
    "all_gather_coalesced": _Spec(full=("inputs", "outputs"), note="the same list of tensors"),
    "all_gather_into_tensor": _Spec(
        full=("inputs", "outputs"),
        intrinsic=_intr_all_gather_into_tensor,
        note="input and output tensors of the same shapes",
    ),
    "all_gather_into_tensor_coalesced": _Spec(
        full=("inputs", "outputs"),
        intrinsic=_intr_all_gather_into_tensor,
        note="input and output tensors of the same shapes",
    ),
    "gather": _Spec(root="dst", full=("inputs",), intrinsic=_intr_gather, note="a tensor of the same shape"),
    "scatter": _Spec(root="src", full=("outputs",), intrinsic=_intr_scatter, note="an output tensor of the same shape"),
    "reduce_scatter": _Spec(
        reduce=True,
        full=("inputs", "outputs"),
        intrinsic=_intr_reduce_scatter,
        note="output tensors of the same shape",
    ),
    "reduce_scatter_tensor": _Spec(
        reduce=True,
        full=("inputs", "outputs"),
        intrinsic=_intr_reduce_scatter_tensor,
        note="input and output tensors of the same shapes",
    ),
    "reduce_scatter_tensor_coalesced": _Spec(
        reduce=True,
        full=("inputs", "outputs"),
        intrinsic=_intr_reduce_scatter_tensor,
        note="input and output tensors of the same shapes",
    ),
    "all_to_all_single": _Spec(dtypes=("inputs", "outputs"), intrinsic=_intr_all_to_all_single, pairwise="single"),
    "all_to_all": _Spec(
        dtypes=("inputs", "outputs"),
        lengths=("inputs", "outputs"),
        intrinsic=_intr_all_to_all,
        pairwise="list",
        note="lists of the same length",
    ),
    "barrier": _Spec(),
    "monitored_barrier": _Spec(),
    "broadcast_object_list": _Spec(root="src", full=("inputs",), note="an object list of the same length"),
    "all_gather_object": _Spec(),
    "gather_object": _Spec(root="dst"),
    "scatter_object_list": _Spec(root="src"),
}

#: Unknown collectives: compare what is recorded about arguments, never tensors.
_UNKNOWN = _Spec(root="root", reduce=True)


def _spec(canon: str) -> _Spec:
    return _SPECS.get(canon, _UNKNOWN)


# --------------------------------------------------------------------------------------------
# describe_call


def describe_call(c: CallRecord) -> str:
    """``"broadcast(src=0) [1, 2, 5] float32 at train.py:42 in step"``: the op as recorded, its
    relevant arguments, its tensors (a few, then "… (+N)") and the call site."""
    args: list[str] = []
    if c.op in SEND_OPS and c.peer is not None:
        args.append(f"dst={c.peer}")
    elif c.op in RECV_OPS and c.peer is not None:
        args.append(f"src={c.peer}")
    elif c.root is not None:
        args.append(f"{_spec(canonical_op(c.op)).root or 'root'}={c.root}")
    if c.reduce_op and _spec(canonical_op(c.op)).reduce:
        args.append(f"op={_norm_reduce(c.reduce_op)}")
    for key, label in ((INPUT_SPLITS, "in_splits"), (OUTPUT_SPLITS, "out_splits")):
        splits = _parse_ints(c.extra.get(key))
        if splits is not None:
            args.append(f"{label}={list(splits)}")
    if c.async_op:
        args.append("async")
    text = f"{c.op}({', '.join(args)})"
    inputs = _format_metas(c.inputs)
    if inputs:
        text += f" {inputs}"
    if c.outputs and c.outputs != c.inputs:
        text += f" -> {_format_metas(c.outputs)}"
    if c.call_site:
        text += f" at {c.call_site}"
    return text


# --------------------------------------------------------------------------------------------
# compare_collective


def _reference(sigs: Mapping[int, Hashable], prefer: Callable[[Hashable, list[int]], bool] | None) -> set[int]:
    """The ranks of the largest agreeing group (ties: ``prefer``red side, then lowest rank)."""
    groups: dict[Hashable, list[int]] = {}
    for rank in sorted(sigs):
        groups.setdefault(sigs[rank], []).append(rank)

    def key(item: tuple[Hashable, list[int]]) -> tuple[int, int, int]:
        sig, ranks = item
        preferred = prefer is not None and prefer(sig, ranks)
        return (-len(ranks), 0 if preferred else 1, ranks[0])

    return set(min(groups.items(), key=key)[1])


def _group_ranks(c: CallRecord) -> tuple[int, ...] | None:
    return _parse_ints(c.extra.get(GROUP_RANKS))


class _Slot:
    """The calls of one (group, seq) slot and the helpers every rule uses."""

    def __init__(self, calls: Mapping[int, CallRecord], group_size: int | None) -> None:
        self.calls = dict(sorted(calls.items()))
        first = next(iter(self.calls.values()))
        self.group = first.group
        self.seq = min(c.seq for c in self.calls.values())
        self.op = canonical_op(first.op)
        self.spec = _spec(self.op)
        if group_size is None:
            sizes = {len(g) for c in self.calls.values() if (g := _group_ranks(c)) is not None}
            group_size = sizes.pop() if len(sizes) == 1 else None
        self.gs = group_size
        roots = {c.root for c in self.calls.values() if c.root is not None}
        self.root = roots.pop() if len(roots) == 1 else None

    def where(self, ranks: Sequence[int]) -> str:
        """``"the code at train.py:42 on rank 1"`` (grouped by call site)."""
        by_site: dict[str, list[int]] = {}
        for rank in ranks:
            by_site.setdefault(self.calls[rank].call_site, []).append(rank)
        parts = [
            f"at {site} on {_ranks_label(rs)}" if site else f"on {_ranks_label(rs)}" for site, rs in by_site.items()
        ]
        return "the code " + " and ".join(parts)

    def sites(self, ranks: Sequence[int]) -> str:
        """``" at train.py:42"`` (the distinct call sites of ``ranks``), or ``""``."""
        found = list(dict.fromkeys(self.calls[r].call_site for r in ranks if self.calls[r].call_site))
        if not found:
            return ""
        return " at " + ", ".join(found[:3]) + _more(len(found), 3)

    def which(self, ranks: Sequence[int], verb: str) -> str:
        """``"check the code at x.py:3 on rank 1, which builds"``: ``verb`` (base form) agrees."""
        return f"check {self.where(ranks)}, which {_conj(verb, ranks)}"

    def mismatch(self, kind: IncidentKind, culprits: Iterable[int], summary: str, hint: str) -> Mismatch:
        bad = tuple(sorted(set(culprits)))
        return Mismatch(
            kind=kind,
            culprit_ranks=bad,
            agreeing_ranks=tuple(r for r in self.calls if r not in bad),
            summary=summary,
            details={r: describe_call(c) for r, c in self.calls.items()},
            hint=hint,
        )

    def head(self, what: str, op: str | None = None) -> str:
        return f"{op or self.op} {what} in group {self.group} seq {self.seq}"

    def cross(
        self,
        sigs: Mapping[int, Hashable],
        kind: IncidentKind,
        what: str,
        show: Callable[[int], str],
        hint: Callable[[list[int], list[int]], str],
        prefer: Callable[[Hashable, list[int]], bool] | None = None,
    ) -> Mismatch | None:
        """Compare one value across the ranks that have it; the minority are the culprits."""
        if len(set(sigs.values())) < 2:
            return None
        if prefer is None and self.spec.root is not None and self.root is not None:
            root = self.root

            def prefer(_sig: Hashable, ranks: list[int]) -> bool:
                return root in ranks

        ref = _reference(sigs, prefer)
        culprits = [r for r in sigs if r not in ref]
        summary = f"{self.head(what)}: {_listing({r: show(r) for r in sigs})}"
        return self.mismatch(kind, culprits, summary, hint(sorted(ref), culprits))


def _rule_op(s: _Slot) -> Mismatch | None:
    sigs = {r: canonical_op(c.op) for r, c in s.calls.items()}
    if len(set(sigs.values())) < 2:
        return None
    ref = _reference(sigs, None)
    culprits = [r for r in sigs if r not in ref]
    ref_op = sigs[min(ref)]
    bad_ops = sorted({sigs[r] for r in culprits})
    summary = f"op mismatch in group {s.group} seq {s.seq}: {_listing(sigs)}"
    hint = (
        f"every rank of group {s.group} must call the same collectives in the same order; "
        f"{_ranks_label(culprits)} called {' / '.join(bad_ops)}{s.sites(culprits)} where "
        f"{_ranks_label(ref)} called {ref_op}{s.sites(sorted(ref))}; look for a collective "
        "inside a rank-dependent branch, an early exit, or a loop that runs a different number "
        "of times on some ranks"
    )
    return s.mismatch(OP_MISMATCH, culprits, summary, hint)


def _rule_group_ranks(s: _Slot) -> Mismatch | None:
    sigs = {r: tuple(sorted(g)) for r, c in s.calls.items() if (g := _group_ranks(c)) is not None}
    return s.cross(
        sigs,
        ARG_MISMATCH,
        "group membership mismatch",
        lambda r: "{" + format_ranks(sigs[r]) + "}",
        lambda ref, bad: (
            f"ranks disagree on which ranks form group {s.group}; every rank must create its "
            "process groups with the same ranks and in the same order (new_group is collective "
            f"even for non-members); {s.which(bad, 'create')} a different group"
        ),
        prefer=lambda _sig, _ranks: False,
    )


def _rule_root(s: _Slot) -> Mismatch | None:
    name = s.spec.root
    if name is None:
        return None
    sigs = {r: c.root for r, c in s.calls.items() if c.root is not None}
    if len(set(sigs.values())) < 2:
        return None

    def hint(ref: list[int], bad: list[int]) -> str:
        ref_root = sigs[ref[0]]
        return (
            f"every rank must pass the same {name} to {s.op}; "
            f"{_ranks_label(ref)} {_conj('pass', ref)} {name}={ref_root}; "
            f"{s.which(bad, 'pass')} a different one ({name} is a global rank, even in a subgroup: "
            "use group_src/group_dst or get_global_rank to convert)"
        )

    return s.cross(
        sigs,
        ARG_MISMATCH,
        f"{name} mismatch",
        lambda r: f"{name}={sigs[r]}",
        hint,
        prefer=lambda sig, ranks: sig in ranks,
    )


def _field_label(field: str) -> str:
    return "output " if field == "outputs" else ""


def _present(s: _Slot, field: str) -> dict[int, tuple[TensorMeta, ...]]:
    """Each rank's tensors in ``field``, leaving out ranks that recorded none."""
    out: dict[int, tuple[TensorMeta, ...]] = {}
    for r, c in s.calls.items():
        metas: tuple[TensorMeta, ...] = getattr(c, field)
        if metas:
            out[r] = metas
    return out


def _rule_dtypes(s: _Slot) -> Mismatch | None:
    for field in (*s.spec.full, *s.spec.dtypes):
        found = _dtype_field(s, field)
        if found:
            return found
    return None


def _dtype_field(s: _Slot, field: str) -> Mismatch | None:
    metas = _present(s, field)
    if len({len(m) for m in metas.values()}) <= 1:
        sigs = {r: tuple(m.dtype for m in ms) for r, ms in metas.items()}
    else:  # lengths differ (reported as a shape mismatch): compare the dtypes used
        sigs = {r: tuple(dict.fromkeys(m.dtype for m in ms)) for r, ms in metas.items()}
    label = _field_label(field)

    def show(r: int) -> str:
        return _format_dtypes(sigs[r])

    def hint(ref: list[int], bad: list[int]) -> str:
        return (
            f"every rank must pass {label}tensors of the same dtype to {s.op} "
            f"({_ranks_label(ref)} {_conj('use', ref)} {_format_dtypes(sigs[ref[0]])}); "
            f"{s.which(bad, 'use')} a different dtype (a missing .to(dtype), autocast, or "
            "a dtype taken from rank-dependent data)"
        )

    return s.cross(sigs, DTYPE_MISMATCH, f"{label}dtype mismatch", show, hint)


def _intrinsic(s: _Slot, kind: IncidentKind) -> Mismatch | None:
    """Ranks whose call is inconsistent in itself (against the group size) in the way ``kind``."""
    check = s.spec.intrinsic
    if check is None:
        return None
    first: dict[int, _Problem] = {}
    for r, c in s.calls.items():
        problem = next((p for p in check(c, s.gs) if p.kind == kind), None)
        if problem is not None:
            first[r] = problem
    if not first:
        return None
    culprits = sorted(first)
    what = "dtype mismatch" if kind == DTYPE_MISMATCH else "shape mismatch"
    summary = f"{s.head(what)}: " + "; ".join(f"rank {r} {p.text}" for r, p in first.items())
    hint = f"{first[culprits[0]].hint}; check {s.where(culprits)}"
    return s.mismatch(kind, culprits, summary, hint)


def _rule_intrinsic_dtype(s: _Slot) -> Mismatch | None:
    return _intrinsic(s, DTYPE_MISMATCH)


def _rule_intrinsic_shape(s: _Slot) -> Mismatch | None:
    return _intrinsic(s, SHAPE_MISMATCH)


def _rule_lengths(s: _Slot) -> Mismatch | None:
    for field in (*s.spec.full, *s.spec.lengths):
        found = _length_field(s, field)
        if found:
            return found
    return None


def _length_field(s: _Slot, field: str) -> Mismatch | None:
    metas = _present(s, field)
    if any(_is_objects(m) for ms in metas.values() for m in ms):
        return None  # an object list's length is its shape: compared by _rule_shapes
    sigs = {r: len(ms) for r, ms in metas.items()}
    label = _field_label(field)

    def show(r: int) -> str:
        return _tensors_word(sigs[r])

    def hint(ref: list[int], bad: list[int]) -> str:
        return (
            f"every rank must pass {label}lists of the same length to {s.op} "
            f"({_ranks_label(ref)} {_conj('pass', ref)} {sigs[ref[0]]}); "
            f"{s.which(bad, 'pass')} a different number"
        )

    return s.cross(sigs, SHAPE_MISMATCH, f"{label}list length mismatch", show, hint)


def _rule_shapes(s: _Slot) -> Mismatch | None:
    for field in s.spec.full:
        found = _shape_field(s, field)
        if found:
            return found
    return None


def _shape_field(s: _Slot, field: str) -> Mismatch | None:
    metas = _present(s, field)
    sigs = {r: tuple(m.shape for m in ms) for r, ms in metas.items()}
    objects = any(_is_objects(m) for ms in metas.values() for m in ms)
    label = _field_label(field)
    what = "list length mismatch" if objects else f"{label}shape mismatch"
    needs = s.spec.note if s.spec.note and field == s.spec.full[0] else f"{label}tensors of the same shape"

    def show(r: int) -> str:
        return _format_shapes(metas[r])

    def hint(ref: list[int], bad: list[int]) -> str:
        if objects:
            return f"every rank must pass {needs} to {s.op}; {s.which(bad, 'pass')} a different length"
        return f"every rank must pass {needs} to {s.op}; {s.which(bad, 'build')} a different shape"

    return s.cross(sigs, SHAPE_MISMATCH, what, show, hint)


def _group_index(s: _Slot) -> dict[int, int] | None:
    """rank -> its index in the group: ``extra["group_rank"]``, else its position in
    ``extra["group_ranks"]``, else the order of the ranks present (only if all are present)."""
    index: dict[int, int] = {}
    for r, c in s.calls.items():
        parsed = _parse_ints(c.extra.get(GROUP_RANK))
        if parsed is None or len(parsed) != 1:
            break
        index[r] = parsed[0]
    else:
        if len(set(index.values())) == len(index):
            return index
    for c in s.calls.values():
        members = _group_ranks(c)
        if members is not None and all(r in members for r in s.calls):
            return {r: members.index(r) for r in s.calls}
    if s.gs is None or s.gs == len(s.calls):
        return {r: i for i, r in enumerate(s.calls)}
    return None


@dataclass(frozen=True)
class _Pair:
    receiver: int
    sender: int
    expects: str  # what the receiver expects, e.g. "3 rows (output_split_sizes[1] = 3)"
    sends: str


def _pair_culprits(pairs: Sequence[_Pair]) -> list[int]:
    """The ranks in the most disagreeing pairs; a tie among all of them spares the lowest rank."""
    counts: dict[int, int] = {}
    for p in pairs:
        for r in {p.receiver, p.sender}:
            counts[r] = counts.get(r, 0) + 1
    top = max(counts.values())
    culprits = sorted(r for r, n in counts.items() if n == top)
    if len(culprits) == len(counts) and len(culprits) > 1:
        culprits = culprits[1:]
    return culprits


def _pairs_mismatch(s: _Slot, pairs: list[_Pair], hint: str, what: str) -> Mismatch:
    p = pairs[0]
    text = (
        f"rank {p.receiver} expects {p.expects} from rank {p.sender}, "
        f"but rank {p.sender} sends {p.sends} to rank {p.receiver}"
    )
    if len(pairs) > 1:
        more = len(pairs) - 1
        text += f" ({more} more pair{'s disagree' if more > 1 else ' disagrees'})"
    culprits = _pair_culprits(pairs)
    return s.mismatch(
        SHAPE_MISMATCH,
        culprits,
        f"{s.head(what)}: {text}",
        f"{hint}; check {s.where(culprits)}",
    )


@dataclass(frozen=True)
class _Chunks:
    """One side (input or output) of one rank's all_to_all_single, per peer index."""

    meta: TensorMeta
    key: str  # INPUT_SPLITS / OUTPUT_SPLITS
    splits: tuple[int, ...] | None  # None: an even split
    n: int

    @property
    def row(self) -> int:
        return _numel(self.meta.shape[1:])

    def __len__(self) -> int:
        return len(self.splits) if self.splits is not None else self.n

    def elements(self, j: int) -> int:
        if self.splits is not None:
            return self.splits[j] * self.row
        return _numel(self.meta.shape) // self.n

    def describe(self, j: int) -> str:
        if self.splits is None:
            return f"{self.elements(j)} elements (an even split of {format_shape(self.meta.shape)})"
        k = self.splits[j]
        if len(self.meta.shape) == 1:
            amount = f"{k} element{'' if k == 1 else 's'}"
        else:
            amount = f"{k} row{'' if k == 1 else 's'} of {self.row} element{'' if self.row == 1 else 's'}"
        return f"{amount} ({self.key}[{j}] = {k})"


def _chunks(metas: Sequence[TensorMeta], key: str, splits: tuple[int, ...] | None, n: int) -> _Chunks | None:
    meta = _single(metas)
    if meta is None or not meta.shape:
        return None
    if splits is None and (n <= 0 or _numel(meta.shape) % n):
        return None  # reported by the intrinsic rule
    return _Chunks(meta, key, splits, n)


def _even_numel_field(s: _Slot, field: str) -> Mismatch | None:
    metas = {r: m for r, ms in _present(s, field).items() if (m := _single(ms)) is not None}
    sigs = {r: _numel(m.shape) for r, m in metas.items()}
    what = "output tensor" if field == "outputs" else "input tensor"

    def show(r: int) -> str:
        return f"{format_shape(metas[r].shape)} ({sigs[r]} elements)"

    def hint(ref: list[int], bad: list[int]) -> str:
        return (
            f"without split sizes, every rank must pass an {what} with the same number of elements "
            f"to all_to_all_single; {s.which(bad, 'pass')} a different size (or pass "
            "input_split_sizes/output_split_sizes)"
        )

    return s.cross(sigs, SHAPE_MISMATCH, f"{_field_label(field)}size mismatch", show, hint)


def _rule_pairwise_single(s: _Slot) -> Mismatch | None:
    in_splits = {r: _parse_ints(c.extra.get(INPUT_SPLITS)) for r, c in s.calls.items()}
    out_splits = {r: _parse_ints(c.extra.get(OUTPUT_SPLITS)) for r, c in s.calls.items()}
    explicit = [v for v in (*in_splits.values(), *out_splits.values()) if v is not None]
    if not explicit:
        # Even splits everywhere: every rank must pass the same number of elements.
        for field in ("inputs", "outputs"):
            found = _even_numel_field(s, field)
            if found:
                return found
        return None
    index = _group_index(s)
    if index is None:
        return None
    n = s.gs or max(len(v) for v in explicit)
    at = {i: r for r, i in index.items()}
    sends: dict[int, _Chunks] = {}
    recvs: dict[int, _Chunks] = {}
    for r, c in s.calls.items():
        snd = _chunks(c.inputs, INPUT_SPLITS, in_splits[r], n)
        rcv = _chunks(c.outputs, OUTPUT_SPLITS, out_splits[r], n)
        if snd is not None:
            sends[r] = snd
        if rcv is not None:
            recvs[r] = rcv
    pairs: list[_Pair] = []
    for i_rank, rcv in recvs.items():
        i = index[i_rank]
        for j in range(len(rcv)):
            j_rank = at.get(j)
            if j_rank is None or j_rank not in sends or i >= len(sends[j_rank]):
                continue
            snd = sends[j_rank]
            if rcv.elements(j) != snd.elements(i):
                pairs.append(_Pair(i_rank, j_rank, rcv.describe(j), snd.describe(i)))
    if not pairs:
        return None
    return _pairs_mismatch(
        s,
        pairs,
        "rank i's output_split_sizes[j] must equal rank j's input_split_sizes[i]; compute the split "
        "sizes from the same data on every rank (e.g. exchange counts with an all_to_all_single first)",
        "split mismatch",
    )


def _rule_pairwise_list(s: _Slot) -> Mismatch | None:
    index = _group_index(s)
    if index is None:
        return None
    at = {i: r for r, i in index.items()}
    pairs: list[_Pair] = []
    for i_rank, c in s.calls.items():
        for j, out in enumerate(c.outputs):
            j_rank = at.get(j)
            if j_rank is None or j_rank not in s.calls:
                continue
            ins = s.calls[j_rank].inputs
            if index[i_rank] >= len(ins):
                continue
            sent = ins[index[i_rank]]
            if sent.shape != out.shape:
                pairs.append(
                    _Pair(
                        i_rank,
                        j_rank,
                        f"{format_shape(out.shape)} (output {j})",
                        f"{format_shape(sent.shape)} (input {index[i_rank]})",
                    )
                )
    if not pairs:
        return None
    return _pairs_mismatch(
        s,
        pairs,
        "rank i's output tensor j must have the shape of rank j's input tensor i in all_to_all",
        "shape mismatch",
    )


def _rule_pairwise(s: _Slot) -> Mismatch | None:
    if s.spec.pairwise == "single":
        return _rule_pairwise_single(s)
    if s.spec.pairwise == "list":
        return _rule_pairwise_list(s)
    return None


def _rule_reduce_op(s: _Slot) -> Mismatch | None:
    if not s.spec.reduce:
        return None
    sigs = {r: _norm_reduce(c.reduce_op) for r, c in s.calls.items() if c.reduce_op}
    return s.cross(
        sigs,
        ARG_MISMATCH,
        "reduce op mismatch",
        lambda r: sigs[r],
        lambda ref, bad: (
            f"every rank must use the same reduce op for {s.op} ({_ranks_label(ref)} {_conj('use', ref)} "
            f"{sigs[ref[0]]}); {s.which(bad, 'use')} a different one"
        ),
    )


_RULES: tuple[Callable[[_Slot], Mismatch | None], ...] = (
    _rule_op,
    _rule_group_ranks,
    _rule_root,
    _rule_intrinsic_dtype,
    _rule_dtypes,
    _rule_intrinsic_shape,
    _rule_lengths,
    _rule_shapes,
    _rule_pairwise,
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
    slot = _Slot(calls, group_size)
    for rule in _RULES:
        found = rule(slot)
        if found is not None:
            return found
    return None


# --------------------------------------------------------------------------------------------
# Point-to-point


def _p2p_metas(c: CallRecord) -> tuple[TensorMeta, ...]:
    return c.inputs or c.outputs


def match_p2p(send: CallRecord, recv: CallRecord) -> Mismatch | None:
    """A send and the recv paired with it (same group, src, dst and pair seq, matched by the
    caller) must carry the same number of elements of the same dtype (object lists: the same
    length). Which side is wrong cannot be told, so both are culprits."""
    s_metas, r_metas = _p2p_metas(send), _p2p_metas(recv)
    if not s_metas or not r_metas:
        return None
    s_dtypes = tuple(dict.fromkeys(m.dtype for m in s_metas))
    r_dtypes = tuple(dict.fromkeys(m.dtype for m in r_metas))
    s_numel = sum(_numel(m.shape) for m in s_metas)
    r_numel = sum(_numel(m.shape) for m in r_metas)
    if s_dtypes == r_dtypes and s_numel == r_numel:
        return None
    objects = "object" in s_dtypes or "object" in r_dtypes
    if s_dtypes != r_dtypes and not objects:
        problem = "dtypes differ"
        fix = "the same dtype"
    else:
        problem = "lengths differ" if objects else "sizes differ"
        fix = "lists of the same length" if objects else "the same number of elements"
    send_desc = _format_metas(s_metas)
    recv_desc = _format_metas(r_metas)
    if not objects:
        send_desc += f" ({s_numel} elements)"
        recv_desc += f" ({r_numel} elements)"
    summary = (
        f"p2p mismatch in group {send.group} (pair seq {send.seq}): rank {send.rank} sends "
        f"{send_desc} to rank {recv.rank}, but rank {recv.rank} receives {recv_desc} ({problem})"
    )
    sites = " and ".join(
        f"{what} at {c.call_site} on rank {c.rank}" if c.call_site else f"{what} on rank {c.rank}"
        for what, c in (("the send", send), ("the recv", recv))
    )
    hint = f"a send and its matching recv must carry {fix}; check {sites}"
    return Mismatch(
        kind=P2P_MISMATCH,
        culprit_ranks=tuple(sorted({send.rank, recv.rank})),
        agreeing_ranks=(),
        summary=summary,
        details={send.rank: describe_call(send), recv.rank: describe_call(recv)},
        hint=hint,
    )


def _p2p_doing(p: CallRecord, me: CallRecord) -> str:
    """What the peer's blocked call ``p`` does, seen from ``me``: ``"receiving from rank 0"``,
    ``"also sending to rank 1"``."""
    sending = p.op in SEND_OPS
    verb = "sending to" if sending else "receiving from"
    if p.peer == me.rank and sending == (me.op in SEND_OPS):
        verb = "also " + verb
    text = f"{verb} rank {p.peer}"
    if p.group != me.group:
        text += f" in group {p.group}"
    return text


def unmatched_p2p(open_calls: Sequence[CallRecord], now: float, grace_s: float) -> list[Mismatch]:
    """Blocked sends/recvs whose peer is itself blocked in p2p, but not in the matching call.

    Only open calls (``exit_time is None``) of a SEND_OPS/RECV_OPS op with a known peer, open
    for at least ``grace_s`` at ``now``, are considered, on both sides. A send from a to b is
    fine when b has such a recv from a in the same group (in flight); a send whose peer is not
    blocked in p2p at all is not reported here. Each disagreement is reported once, with both
    ranks as culprits (which side has the calls in the wrong order cannot be told).
    """
    blocked: dict[int, list[CallRecord]] = {}
    for c in open_calls:
        if c.exit_time is not None or c.peer is None:
            continue
        if c.op not in SEND_OPS and c.op not in RECV_OPS:
            continue
        if now - c.enter_time < grace_s:
            continue
        blocked.setdefault(c.rank, []).append(c)
    found: list[Mismatch] = []
    seen: set[frozenset[tuple[int, int]]] = set()
    for rank in sorted(blocked):
        for c in sorted(blocked[rank], key=lambda c: (c.enter_time, c.call_id)):
            assert c.peer is not None
            peer_calls = sorted(blocked.get(c.peer, []), key=lambda p: (p.enter_time, p.call_id))
            if not peer_calls or c.peer == c.rank:
                continue
            sending = c.op in SEND_OPS
            wanted = RECV_OPS if sending else SEND_OPS
            if any(p.peer == c.rank and p.group == c.group and p.op in wanted for p in peer_calls):
                continue
            key = frozenset({(c.rank, c.call_id)} | {(p.rank, p.call_id) for p in peer_calls})
            if key in seen:
                continue
            seen.add(key)
            found.append(_unmatched(c, peer_calls, now))
    return found


def _unmatched(c: CallRecord, peer_calls: Sequence[CallRecord], now: float) -> Mismatch:
    assert c.peer is not None
    sending = c.op in SEND_OPS
    mine = f"rank {c.rank} {'sends to' if sending else 'receives from'} rank {c.peer}"
    theirs = " and ".join(_p2p_doing(p, c) for p in peer_calls)
    waited = now - c.enter_time
    summary = f"p2p mismatch in group {c.group}: {mine}, but rank {c.peer} is {theirs} (for {waited:.0f} s)"
    both_send = sending and any(p.op in SEND_OPS and p.peer == c.rank for p in peer_calls)
    both_recv = not sending and any(p.op in RECV_OPS and p.peer == c.rank for p in peer_calls)
    sites = " and ".join(
        f"{x.call_site} on rank {x.rank}" if x.call_site else f"rank {x.rank}" for x in (c, peer_calls[0])
    )
    if both_send:
        hint = (
            f"ranks {c.rank} and {c.peer} both send first and wait for the other to receive: order the "
            "calls so one side receives first (e.g. even ranks send first, odd ranks receive first) "
            f"or use batch_isend_irecv; check {sites}"
        )
    elif both_recv:
        hint = (
            f"ranks {c.rank} and {c.peer} both wait to receive from each other: one side must send first; check {sites}"
        )
    else:
        hint = (
            "every send needs a matching recv on the peer, in the same group and in the same order; "
            f"check the order of the send/recv calls at {sites}"
        )
    details = {c.rank: describe_call(c), c.peer: "; ".join(describe_call(p) for p in peer_calls)}
    return Mismatch(
        kind=P2P_MISMATCH,
        culprit_ranks=tuple(sorted({c.rank, c.peer})),
        agreeing_ranks=(),
        summary=summary,
        details=details,
        hint=hint,
    )


# --------------------------------------------------------------------------------------------
# Extra calls


def _fingerprint(c: CallRecord) -> tuple[Hashable, ...]:
    """What must agree between ranks' calls at the same slot (None: unknown, matches anything)."""
    canon = canonical_op(c.op)
    spec = _spec(canon)
    parts: list[Hashable] = [canon]
    parts.append(c.root if spec.root else None)
    parts.append(_norm_reduce(c.reduce_op) if spec.reduce and c.reduce_op else None)
    for field in spec.full:
        metas: tuple[TensorMeta, ...] = getattr(c, field)
        parts.append(tuple((m.shape, m.dtype) for m in metas) or None)
    for field in spec.dtypes:
        metas = getattr(c, field)
        parts.append(tuple(dict.fromkeys(m.dtype for m in metas)) or None)
    for field in spec.lengths:
        metas = getattr(c, field)
        parts.append(len(metas) or None)
    return tuple(parts)


def _alike(a: CallRecord, b: CallRecord) -> bool:
    fa, fb = _fingerprint(a), _fingerprint(b)
    return len(fa) == len(fb) and all(x is None or y is None or x == y for x, y in zip(fa, fb, strict=True))


def _extra_at(mine: Sequence[CallRecord], others: Mapping[int, list[CallRecord]], seq: int) -> int | None:
    """The seq of ``mine``'s extra call, if inserting one call at (or shortly before) ``seq``
    explains how ``mine`` differs from ``others`` (which must agree among themselves)."""
    by_seq = {c.seq: c for c in mine}
    for slot in others.values():
        if not all(_alike(slot[0], o) for o in slot[1:]):
            return None
    ref_seqs = sorted(others)
    for i in sorted((s for s in by_seq if s <= seq), reverse=True):
        if i not in others:
            continue
        before = all(_alike(by_seq[s], others[s][0]) for s in by_seq if s < i and s in others)
        if not before:
            continue
        after_mine = [c for c in mine if c.seq > i]
        after_ref = [others[s][0] for s in ref_seqs if s >= i]
        compared = list(zip(after_mine, after_ref, strict=False))
        if not compared or not all(_alike(x, r) for x, r in compared):
            continue
        if all(_alike(by_seq[s], others[s][0]) for s in by_seq if s >= i and s in others):
            continue  # nothing the shift needs to explain
        return i
    return None


MAX_BEHAVIOURS = 16  # distinct rank histories explain_extra_call compares
EXTRA_CALL_WINDOW = (16, 4)  # the calls it looks at: this many seqs before and after the slot


def explain_extra_call(history: Mapping[int, Sequence[CallRecord]], seq: int) -> str | None:
    """``"rank 1 made an extra all_reduce at train.py:30 (seq 12); every later call on rank 1 is
    shifted by one"`` when one rank's calls in a group (``history``: rank -> its recent calls,
    ordered by seq) equal the others' with one call inserted at ``seq`` (or, where the calls
    look alike, shortly before it). Needs at least one later call on that rank to confirm the
    shift; None when no single rank is explained that way."""
    window = range(seq - EXTRA_CALL_WINDOW[0], seq + EXTRA_CALL_WINDOW[1] + 1)
    ordered = {r: sorted((c for c in calls if c.seq in window), key=lambda c: c.seq) for r, calls in history.items()}
    ordered = {r: calls for r, calls in ordered.items() if calls}
    if len(ordered) < 2:
        return None
    # Ranks with the same calls behave alike: compare one of each kind (a job of thousands of
    # ranks has two kinds here, the culprit's and everyone else's), counting how many share it.
    kinds: dict[tuple[Hashable, ...], list[int]] = {}
    for rank, calls in ordered.items():
        kinds.setdefault(tuple((c.seq, _fingerprint(c)) for c in calls), []).append(rank)
    if len(kinds) > MAX_BEHAVIOURS:
        return None  # too many different histories for one rank's extra call to explain them
    reps = {ranks[0]: len(ranks) for ranks in kinds.values()}
    found: list[tuple[int, CallRecord]] = []
    for rank, count in reps.items():
        mine = ordered[rank]
        others: dict[int, list[CallRecord]] = {}
        for other in sorted(reps):
            if other != rank or count > 1:  # ranks that share this history are "others" too
                for c in ordered[other]:
                    others.setdefault(c.seq, []).append(c)
        at = _extra_at(mine, others, seq)
        if at is not None:
            found.extend([(rank, next(c for c in mine if c.seq == at))] * count)
    if len(found) != 1:
        return None
    rank, extra = found[0]
    where = f" at {extra.call_site}" if extra.call_site else ""
    text = (
        f"rank {rank} made an extra {canonical_op(extra.op)}{where} (seq {extra.seq}); "
        f"every later call on rank {rank} is shifted by one"
    )
    if len(ordered) == 2:
        other = next(r for r in ordered if r != rank)
        text += f" (with two ranks this is the same as rank {other} skipping it)"
    return text
