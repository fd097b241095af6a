"""Every kind of incident in one table, checked at import.

A row names the kind, its report title, the key families its incidents take, whether the job
hangs on it (a straggler only warns), whether its ranks wait in it (a later death of one is its
aftermath), what it is in the model (an edit of a rank's trace or a sink of the wait-for graph),
and the advice given when a detector knows nothing more specific.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class IncidentKind(str, enum.Enum):
    """What an incident is about. A ``str`` enum: its values are the JSON contract's ``kind``."""

    OP_MISMATCH = "op_mismatch"
    SHAPE_MISMATCH = "shape_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    ARG_MISMATCH = "arg_mismatch"
    P2P_MISMATCH = "p2p_mismatch"
    STUCK_COLLECTIVE = "stuck_collective"
    EARLY_EXIT = "early_exit"
    RANK_DIED = "rank_died"
    RANK_FROZEN = "rank_frozen"
    TRANSPORT_STALL = "transport_stall"
    STRAGGLER = "straggler"

    def __str__(self) -> str:
        return self.value


class KeyFamily(str, enum.Enum):
    """The first part of an incident key: which root cause it names."""

    MISMATCH = "mismatch"  # a slot whose calls disagree (group, seq)
    GROUP = "group"  # a group whose membership differs between ranks (group)
    P2P = "p2p"  # a send/recv that do not match (group, pair seq or direction, ranks)
    STUCK = "stuck"  # hangs at a slot (group, seq)
    EARLY = "early"  # a rank that left the loop, seen at a slot (group, seq)
    STALL = "stall"  # a slot every member is in and none leaves (group, seq)
    DIED = "died"  # a rank's session ended (session)
    EARLY_END = "early-end"  # a rank that ended while the others wait (session)
    FROZEN = "frozen"  # a rank silent (session, since)
    STRAGGLER = "straggler"  # (group, rank)


class Model(str, enum.Enum):
    """Where a kind sits in the model (``docs/architecture.md``)."""

    DIFFERENT = "edit: the call differs"
    EDIT = "edit: a call skipped or extra, or the trace ended"
    ENDED = "edit: the trace ended"
    SINK = "sink: the rank waits for nobody, and others wait for it"
    CYCLE = "cycle or sink: p2p calls that cannot pair"
    DEVICE = "sink on the device: every member is in the call and none completes"
    NONE = "no hang: a rank slow at every call"


@dataclass(frozen=True)
class KindRow:
    kind: IncidentKind
    title: str
    families: tuple[KeyFamily, ...]
    hang: bool
    holds: bool  # its ranks wait in it until torch's watchdog aborts them
    model: Model
    hint: str


_SAME = (
    "Every rank of a group must make the same collective, with the same arguments, at the same point "
    "of its program: compare the call sites named above."
)

_EARLY = (
    "Stop every rank at the same step: make the stop decision collectively (all_reduce the stop "
    "flag with ReduceOp.MAX and break on the result), or with Accelerate use "
    "accelerator.set_trigger() on the rank that wants to stop and accelerator.check_trigger() in "
    "every rank's loop."
)
_GIL = (
    "Look at the native stack of the frozen rank: a C extension or ctypes call that holds the "
    "GIL while it blocks must release it (Py_BEGIN_ALLOW_THREADS / ctypes.CDLL instead of "
    "PyDLL); a stopped process must be continued (kill -CONT) or killed; a D-state process "
    "points at storage or a driver."
)
_P2P = (
    "Every send must meet a recv of the same size from its peer: two stages that both send first "
    "deadlock; post one side's recv first, or use batch_isend_irecv."
)
_STALL = (
    "Every rank is in the same call and none completes: look at the network and the device "
    "(NCCL_DEBUG=INFO, the NIC and NVLink counters, a GPU that is lost or hung)."
)
_SLOW = (
    "Not a hang: look for uneven work on that rank (data loading, a slower host, logging or "
    "evaluation done only there)."
)
_STUCK = "Look at what the culprit does instead of the collective: its stack is attached."
_DIED = "Look at the rank's own error in its log; a SIGKILL with no error is most often the OOM killer."

F, K, M = KeyFamily, IncidentKind, Model
# fmt: off
KINDS: tuple[KindRow, ...] = (
    #       kind                title                        families              hang   holds  model        hint
    KindRow(K.OP_MISMATCH,      "Operation mismatch",        (F.MISMATCH,),          True,  False, M.DIFFERENT, _SAME),
    KindRow(K.SHAPE_MISMATCH,   "Shape mismatch",            (F.MISMATCH,),          True,  False, M.DIFFERENT, _SAME),
    KindRow(K.DTYPE_MISMATCH,   "Dtype mismatch",            (F.MISMATCH,),          True,  False, M.DIFFERENT, _SAME),
    KindRow(K.ARG_MISMATCH,     "Argument mismatch",         (F.MISMATCH, F.GROUP),  True,  False, M.DIFFERENT, _SAME),
    KindRow(K.P2P_MISMATCH,     "Point-to-point mismatch",   (F.P2P,),               True,  True,  M.CYCLE,     _P2P),
    KindRow(K.STUCK_COLLECTIVE, "Stuck collective",          (F.STUCK, F.EARLY_END), True,  True,  M.EDIT,      _STUCK),
    KindRow(K.EARLY_EXIT,       "Unsynchronised early exit", (F.EARLY, F.EARLY_END), True,  True,  M.ENDED,     _EARLY),
    KindRow(K.RANK_DIED,        "Rank died",                 (F.DIED,),              True,  False, M.SINK,      _DIED),
    KindRow(K.RANK_FROZEN,      "Rank frozen",               (F.FROZEN,),            True,  False, M.SINK,      _GIL),
    KindRow(K.TRANSPORT_STALL,  "Transport stall",           (F.STALL,),             True,  True,  M.DEVICE,    _STALL),
    KindRow(K.STRAGGLER,        "Straggler (warning)",       (F.STRAGGLER,),         False, False, M.NONE,      _SLOW),
)
# fmt: on
del F, K, M

ROWS = {row.kind: row for row in KINDS}
#: Kinds that warn about a healthy-but-slow job.
WARNING_KINDS = frozenset(row.kind for row in KINDS if not row.hang)
#: Families whose ranks wait in the hang they name: a later death of one is its aftermath.
HOLDING_FAMILIES = tuple(sorted({f.value for row in KINDS if row.holds for f in row.families}))


def hint(kind: IncidentKind) -> str:
    """The advice for ``kind`` when nothing more specific is known."""
    return ROWS[kind].hint


def severity(kind: IncidentKind) -> str:
    return "error" if ROWS[kind].hang else "warning"


def _check() -> None:
    """Every kind has one row; titles differ; a warning holds nothing; a family holds its ranks or
    never does; every family keys some kind."""
    kinds = [row.kind for row in KINDS]
    assert sorted(kinds) == sorted(IncidentKind), f"kinds without one row: {set(IncidentKind) ^ set(kinds)}"
    assert len({row.title for row in KINDS}) == len(KINDS), "two kinds share a title"
    for row in KINDS:
        assert row.title and row.hint.endswith("."), f"{row.kind}: a title and a whole hint"
        assert row.hang or not row.holds, f"{row.kind}: a warning holds no rank"
        assert row.hang == (row.model is not Model.NONE), f"{row.kind}: only a warning is outside the model"
    holding = {f for row in KINDS if row.holds for f in row.families}
    loose = {f for row in KINDS if not row.holds for f in row.families}
    assert not holding & loose, f"families both holding and not: {holding & loose}"
    assert holding | loose == set(KeyFamily), f"families keying no kind: {set(KeyFamily) - holding - loose}"


_check()
