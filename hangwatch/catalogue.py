"""The op catalogue: every operation hangwatch knows, one row each, with all its facts.

Shared by every stage: the hook (which ``torch.distributed`` functions to record:
``hangwatch.client.ops`` keys each of its argument-extraction rows to a row here), the
Flight Recorder reader (``profiling_name`` -> op), the records (which ops are point-to-point,
sends, receives, markers), the coordinator's rules (which tensors every rank must agree on,
the single-call check) and its detectors (which ops are barriers).

A row says:

- ``name``: the canonical name, what the rules call the op and what their texts show;
- ``kind``: a :class:`Kind` (collective, rooted, p2p, barrier, object, marker);
- ``api``: the ``torch.distributed`` functions the hook records as this op (their records
  keep the name the code called, e.g. ``_all_gather_base``);
- ``aliases``: every other spelling we meet (backend names such as ``allreduce``, Flight
  Recorder's ``_allgather_base``, functional collectives' ``_c10d_functional::all_reduce``);
  :func:`canonical_op` resolves each of them to ``name``;
- ``fr_names``: Flight Recorder ``profiling_name`` suffixes (after ``nccl:``/``gloo:``) whose
  entries are recorded as this op (coalesced entries as the op the code coalesced);
- ``direction``, ``objects``: a p2p call's side; whether the call moves Python objects;
- ``agree``: an :class:`Agree`, what the calls ranks make at one (group, seq) must agree on
  (None for p2p rows, matched send against recv, and markers);
- ``check``: the name of the single-call ("intrinsic") check in
  ``hangwatch.diagnosis.rules.checks.CHECKS``, which verifies at import that every name
  given here is registered;
- ``uneven_seqs``: the backend numbers the call differently on different ranks (gloo's
  ``monitored_barrier`` is sends and receives to and from the group's rank 0, counted as
  collectives: 2x(size-1) seqs there, 2 on the others, and torch's numbering, Flight Recorder's
  included, stays shifted after it); the coordinator lines the ranks up again
  (``JobState``'s seq shifts).

Import cost: this module imports nothing beyond the standard library (the hook imports it in
every rank). Rows are validated at import: a collective without an :class:`Agree`, a
spelling claimed by two rows, or a p2p row without its place fails loudly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an op is, for matching and wording."""

    COLLECTIVE = "collective"  # every member of the group, aligned by (group, seq)
    ROOTED = "rooted"  # a collective with a src/dst rank
    P2P = "p2p"  # two ranks, aligned by (group, src, dst, pair seq)
    BARRIER = "barrier"  # a collective that moves no data
    OBJECT = "object"  # a collective over lists of Python objects
    MARKER = "marker"  # not a communication (e.g. accelerate.set_trigger)


class Direction(str, enum.Enum):
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True, slots=True)
class Agree:
    """What every rank's call at one slot must agree on (see ``hangwatch.diagnosis.rules``)."""

    root: str | None = None  # name of the root argument ("src"/"dst") of rooted ops
    reduce: bool = False  # reduce_op must match
    full: tuple[str, ...] = ()  # CallRecord fields every rank must agree on (length, dtypes, shapes)
    dtypes: tuple[str, ...] = ()  # fields whose dtypes (only) every rank must agree on
    lengths: tuple[str, ...] = ()  # fields whose list lengths (only) every rank must agree on
    pairwise: str | None = None  # "single" (all_to_all_single) | "list" (all_to_all)
    note: str = ""  # what the tensors are, for hints


#: Unknown collectives: compare what is recorded about arguments, never tensors.
UNKNOWN = Agree(root="root", reduce=True)


@dataclass(frozen=True, slots=True)
class Op:
    """One row of the catalogue (see the module docstring for the fields)."""

    name: str
    kind: Kind
    api: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    fr_names: tuple[str, ...] = ()
    direction: Direction | None = None
    objects: bool = False
    agree: Agree | None = None
    check: str | None = None
    uneven_seqs: bool = False

    def __post_init__(self) -> None:
        p2p = self.kind is Kind.P2P
        if self.kind is not Kind.MARKER and (self.agree is None) != p2p:
            raise ValueError(f"{self.name}: collectives need an Agree, p2p rows are matched send against recv")
        if self.direction is not None and not p2p:
            raise ValueError(f"{self.name}: only p2p ops have a direction")
        if self.kind is Kind.ROOTED and (self.agree is None or self.agree.root is None):
            raise ValueError(f"{self.name}: a rooted op names its root argument")
        if self.kind is Kind.OBJECT and not self.objects:
            raise ValueError(f"{self.name}: an object collective moves objects")

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every name :func:`canonical_op` resolves to this row (its own first)."""
        return (self.name, *self.api, *self.aliases)


_SAME = "a tensor of the same shape"
_BOTH = "input and output tensors of the same shapes"
_FUNCOL = "_c10d_functional::"
_FUNCOL_AUTOGRAD = "_c10d_functional_autograd::"

OPS: tuple[Op, ...] = (
    Op(
        "all_reduce",
        Kind.COLLECTIVE,
        api=("all_reduce",),
        aliases=("allreduce", f"{_FUNCOL}all_reduce"),
        fr_names=("all_reduce", "allreduce"),
        agree=Agree(reduce=True, full=("inputs",), note=_SAME),
    ),
    Op(
        "all_reduce_coalesced",
        Kind.COLLECTIVE,
        api=("all_reduce_coalesced",),
        aliases=("allreduce_coalesced", f"{_FUNCOL}all_reduce_coalesced"),
        fr_names=("allreduce_coalesced", "all_reduce_coalesced"),
        agree=Agree(reduce=True, full=("inputs",), note="the same list of tensors"),
    ),
    Op(
        "broadcast",
        Kind.ROOTED,
        api=("broadcast",),
        aliases=("_broadcast_oop", f"{_FUNCOL}broadcast"),
        fr_names=("broadcast",),
        agree=Agree(root="src", full=("inputs",), note=_SAME),
    ),
    Op(
        "reduce",
        Kind.ROOTED,
        api=("reduce",),
        aliases=("_reduce_oop",),
        fr_names=("reduce",),
        agree=Agree(root="dst", reduce=True, full=("inputs",), note=_SAME),
    ),
    Op(
        "all_gather",
        Kind.COLLECTIVE,
        api=("all_gather",),
        aliases=("allgather",),
        fr_names=("all_gather", "allgather"),
        agree=Agree(full=("inputs", "outputs"), note=_SAME),
        check="all_gather",
    ),
    Op(
        "all_gather_coalesced",
        Kind.COLLECTIVE,
        api=("all_gather_coalesced",),
        aliases=("allgather_coalesced",),
        agree=Agree(full=("inputs", "outputs"), note="the same list of tensors"),
    ),
    Op(
        "all_gather_into_tensor",
        Kind.COLLECTIVE,
        api=("all_gather_into_tensor", "_all_gather_base"),
        aliases=(
            "_allgather_base",
            "allgather_base",
            "all_gather_base",
            "allgather_into_tensor",
            f"{_FUNCOL}all_gather_into_tensor",
            f"{_FUNCOL_AUTOGRAD}all_gather_into_tensor",
        ),
        fr_names=("_allgather_base", "all_gather_into_tensor", "allgather_into_tensor_coalesced"),
        agree=Agree(full=("inputs", "outputs"), note=_BOTH),
        check="all_gather_into_tensor",
    ),
    Op(
        "all_gather_into_tensor_coalesced",
        Kind.COLLECTIVE,
        aliases=(
            "allgather_into_tensor_coalesced",
            "_allgather_into_tensor_coalesced",
            f"{_FUNCOL}all_gather_into_tensor_coalesced",
        ),
        agree=Agree(full=("inputs", "outputs"), note=_BOTH),
        check="all_gather_into_tensor",
    ),
    Op(
        "gather",
        Kind.ROOTED,
        api=("gather",),
        fr_names=("gather",),
        agree=Agree(root="dst", full=("inputs",), note=_SAME),
        check="gather",
    ),
    Op(
        "scatter",
        Kind.ROOTED,
        api=("scatter",),
        fr_names=("scatter",),
        agree=Agree(root="src", full=("outputs",), note="an output tensor of the same shape"),
        check="scatter",
    ),
    Op(
        "reduce_scatter",
        Kind.COLLECTIVE,
        api=("reduce_scatter",),
        aliases=("reducescatter",),
        fr_names=("reduce_scatter",),
        agree=Agree(reduce=True, full=("inputs", "outputs"), note="output tensors of the same shape"),
        check="reduce_scatter",
    ),
    Op(
        "reduce_scatter_tensor",
        Kind.COLLECTIVE,
        api=("reduce_scatter_tensor", "_reduce_scatter_base"),
        aliases=(
            "reduce_scatter_base",
            f"{_FUNCOL}reduce_scatter_tensor",
            f"{_FUNCOL_AUTOGRAD}reduce_scatter_tensor",
        ),
        fr_names=("_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        agree=Agree(reduce=True, full=("inputs", "outputs"), note=_BOTH),
        check="reduce_scatter_tensor",
    ),
    Op(
        "reduce_scatter_tensor_coalesced",
        Kind.COLLECTIVE,
        aliases=(
            "_reduce_scatter_tensor_coalesced",
            "reduce_scatter_coalesced",
            f"{_FUNCOL}reduce_scatter_tensor_coalesced",
        ),
        agree=Agree(reduce=True, full=("inputs", "outputs"), note=_BOTH),
        check="reduce_scatter_tensor",
    ),
    Op(
        "all_to_all",
        Kind.COLLECTIVE,
        api=("all_to_all",),
        aliases=("alltoall",),
        fr_names=("alltoall", "all_to_all"),
        agree=Agree(
            dtypes=("inputs", "outputs"),
            lengths=("inputs", "outputs"),
            pairwise="list",
            note="lists of the same length",
        ),
        check="all_to_all",
    ),
    Op(
        "all_to_all_single",
        Kind.COLLECTIVE,
        api=("all_to_all_single",),
        aliases=(
            "alltoall_base",
            "all_to_all_base",
            "alltoall_single",
            f"{_FUNCOL}all_to_all_single",
            f"{_FUNCOL_AUTOGRAD}all_to_all_single",
        ),
        fr_names=("alltoall_base",),
        agree=Agree(dtypes=("inputs", "outputs"), pairwise="single"),
        check="all_to_all_single",
    ),
    # NCCL runs barrier as an all_reduce of one element and Flight Recorder names it so.
    Op(
        "barrier", Kind.BARRIER, api=("barrier",), aliases=("all_reduce_barrier",), fr_names=("barrier",), agree=Agree()
    ),
    Op("monitored_barrier", Kind.BARRIER, api=("monitored_barrier",), agree=Agree(), uneven_seqs=True),
    # Point-to-point: a send is matched with the recv of the same pair seq (rules.match_p2p).
    Op("send", Kind.P2P, api=("send",), fr_names=("send",), direction=Direction.SEND),
    Op("recv", Kind.P2P, api=("recv",), fr_names=("recv",), direction=Direction.RECV),
    Op("isend", Kind.P2P, api=("isend",), direction=Direction.SEND),
    Op("irecv", Kind.P2P, api=("irecv",), direction=Direction.RECV),
    # Recorded so a hang inside it has a location; its sends and recvs are not paired.
    Op("batch_isend_irecv", Kind.P2P, api=("batch_isend_irecv",)),
    Op("send_object_list", Kind.P2P, api=("send_object_list",), direction=Direction.SEND, objects=True),
    Op("recv_object_list", Kind.P2P, api=("recv_object_list",), direction=Direction.RECV, objects=True),
    Op(
        "broadcast_object_list",
        Kind.OBJECT,
        api=("broadcast_object_list",),
        objects=True,
        agree=Agree(root="src", full=("inputs",), note="an object list of the same length"),
    ),
    Op("all_gather_object", Kind.OBJECT, api=("all_gather_object",), objects=True, agree=Agree()),
    Op("gather_object", Kind.OBJECT, api=("gather_object",), objects=True, agree=Agree(root="dst")),
    Op("scatter_object_list", Kind.OBJECT, api=("scatter_object_list",), objects=True, agree=Agree(root="src")),
    # Markers arrive as MarkerEvents (hangwatch.client.integrations), never aligned with calls.
    Op("accelerate.set_trigger", Kind.MARKER),
    Op("accelerate.check_trigger", Kind.MARKER),
)

BY_NAME: dict[str, Op] = {op.name: op for op in OPS}
#: The hook's functions -> their row.
BY_API: dict[str, Op] = {api: op for op in OPS for api in op.api}


# --------------------------------------------------------------------------------------------
# Names


def _normalise(op: str) -> str:
    """Lower case, without a backend prefix (Flight Recorder's ``gloo:all_reduce``), a
    namespace (``_c10d_functional::``), a module prefix, peer annotations (``nccl:send 0->1``)
    or an ``_async`` suffix."""
    name = op.strip().lower()
    name = name.rsplit(":", 1)[-1].strip()
    name = name.split()[0] if name.split() else name
    name = name.rsplit(".", 1)[-1]
    return name.removesuffix("_async")


def _aliases() -> dict[str, str]:
    table: dict[str, str] = {}
    for op in OPS:
        for spelling in op.spellings:
            key = _normalise(spelling)
            if table.setdefault(key, op.name) != op.name:
                raise ValueError(f"{spelling!r} names both {table[key]} and {op.name}")
    return table


#: Every spelling (normalised) -> the canonical name.
ALIASES: dict[str, str] = _aliases()


def uneven_seqs(op: str) -> bool:
    """Whether the backend numbers ``op`` differently on different ranks (see ``uneven_seqs``)."""
    row = BY_NAME.get(canonical_op(op))
    return row is not None and row.uneven_seqs


def canonical_op(op: str) -> str:
    """The rules' name for ``op``: normalised (lower case, without a backend, namespace or
    module prefix, peer annotations or an ``_async`` suffix) and with aliases resolved
    (``_allgather_base`` -> ``all_gather_into_tensor``); an unknown name loses its leading
    underscores."""
    name = _normalise(op)
    if name in ALIASES:
        return ALIASES[name]
    stripped = name.lstrip("_")
    return ALIASES.get(stripped, stripped)


def agreement(canon: str) -> Agree:
    """What ranks must agree on for the canonical op ``canon`` (:data:`UNKNOWN` for ops without
    an :class:`Agree`: unknown names, p2p and markers)."""
    op = BY_NAME.get(canon)
    return op.agree if op is not None and op.agree is not None else UNKNOWN


def norm_reduce(reduce_op: str) -> str:
    """``ReduceOp.SUM`` / ``<RedOpType.SUM: 0>`` / ``sum`` -> ``SUM``."""
    text = reduce_op.strip().strip("<>").split(":")[0].strip()
    return text.rsplit(".", 1)[-1].upper()


def _fr_names() -> dict[str, str]:
    table: dict[str, str] = {}
    for op in OPS:
        for fr in op.fr_names:
            if table.setdefault(fr, op.name) != op.name:
                raise ValueError(f"Flight Recorder name {fr!r} maps to both {table[fr]} and {op.name}")
    return table


#: Flight Recorder ``profiling_name`` suffixes (after ``backend:``) -> the op their records get.
FR_OP_NAMES: dict[str, str] = _fr_names()


def record_names(kinds: Iterable[Kind], direction: Direction | None = None) -> tuple[str, ...]:
    """The op names records of these kinds carry (row names and hooked functions), in
    catalogue order; only one ``direction`` of p2p when given."""
    wanted = set(kinds)
    names: dict[str, None] = {}
    for op in OPS:
        if op.kind in wanted and (direction is None or op.direction is direction):
            names.update(dict.fromkeys((op.name, *op.api)))
    return tuple(names)


# --------------------------------------------------------------------------------------------
# Op-specific arguments (CallRecord.extra: text values, written by the hook)

INPUT_SPLITS = "input_split_sizes"  # all_to_all_single
OUTPUT_SPLITS = "output_split_sizes"
#: Said for split sizes a call site changes from call to call (an MoE layer's): they are not
#: recorded (each call would be a signature of its own), and not compared.
SPLITS_VARY = "varies"
GROUP_RANK = "group_rank"  # the caller's index in the group (all-to-all pairing)
GROUP_RANKS = "group_ranks"  # the group's members, where recorded


def parse_ints(text: str | None) -> tuple[int, ...] | None:
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
