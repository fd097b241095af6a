"""Memory budgets in bytes: per rank, per job and for the whole coordinator (issue 15).

Counts alone do not bound memory: a cap of 16,384 groups per job, 64 calls of history per group
and 4,096 slots per group let one hostile (or broken) rank hold gigabytes, each record's strings
already cut at ingest (``wire.clip``). So ``JobState`` charges what it holds to a ``Ledger``:
each call once, however many of its tables hold it (``CallRecord.holds``), and each table entry,
slot, group, marker, device-progress entry and signature table at its estimated size, released
when it is let go. A charge that would take the rank, its job or the coordinator over its budget
is refused before anything is stored: the rank's oldest history goes first (it only feeds the
rules' explanations), then the call is dropped and counted (``status``: ``budget``;
``/metrics``: ``hangwatch_budget_*``).

The estimates are upper bounds, calibrated against ``tracemalloc``
(``tests/diagnosis/test_budget.py`` fails when one falls below what Python really allocates;
measured 1.3-2.7x above it across healthy and hostile shapes). Measured under the default
budgets, healthy jobs with world, tensor- and data-parallel groups, 80 steps of 4 collectives:
1,024 ranks are charged 245 MiB, 4,096 ranks 979 MiB, and 4,096 ranks with two more groups each
(expert and context parallel) 1,611 MiB of the 2,048 a job may hold; nothing refused or trimmed.
A job of more ranks than the default covers at ``JOB_KIB_PER_RANK`` each may hold that much a
rank, where ``--job-budget-mb`` is not given (a 16,384-rank FSDP loop was charged 1,940 MiB of
the 2,048, and refused millions of calls with device progress on); beyond, a job trims its oldest
history first, then refuses: raise ``--job-budget-mb`` for it.
"""

from __future__ import annotations

import dataclasses
import sys

from hangwatch import records as r

MIB = 1024 * 1024
DEFAULT_RANK_MB = 64
DEFAULT_JOB_MB = 2048
#: A job's budget a rank where it is not given: 2,048 MiB cover 10,922 ranks, 16,384 get 3 GiB.
JOB_KIB_PER_RANK = 192
DEFAULT_TOTAL_MB = 4096

#: A CallRecord (slots dataclass), its numbers and its ``extra`` dict, before its strings and
#: tensors (counted on top): under 400 bytes measured with tracemalloc, rounded up.
CALL_BYTES = 512
TENSOR_BYTES = 160  # one TensorMeta with its shape tuple (strings interned by the decoder or not)
#: A slot (its dataclass, its calls dict, the OrderedDict entry) and one rank's entry in it.
SLOT_BYTES = 640
SLOT_ENTRY_BYTES = 128
#: A rank's per-group tables: its history deque (64 slots), open-collectives dict, entry seq and
#: progress entries, and the job's arrivals deque for the group.
RANK_GROUP_BYTES = 1600
JOB_GROUP_BYTES = 4096
#: One open call: its entries in the rank's open-call tables and the job's p2p table.
OPEN_BYTES = 256
#: What a call may add to the tables beyond itself: its open-call entry, its slot entry, a new
#: slot (the admission check's bound).
CALL_TABLES_BYTES = OPEN_BYTES + SLOT_ENTRY_BYTES + SLOT_BYTES
#: One DDP forward pass kept (its tuple; the group's name, cut to ``wire.MAX_NAME``, on top).
FORWARD_BYTES = 256 + 4 * 256 + 80
#: One monitored-barrier renumbering kept for a group.
SHIFT_BYTES = 128
#: One group's device progress (NCCL) in a rank's table.
PROGRESS_BYTES = 512
#: A run of calls (``records.CallRun``) held whole: the object and its two lists, then each
#: call's two times (a float and its list entry, each).
RUN_BYTES = 512
RUN_CALL_BYTES = 2 * (24 + 8) + 8
#: A rank's own state before any call: its dataclass, deques and tables, markers at their cap.
#: Its latest ``where`` and ``where_user`` (cut to 1 KiB), and the groups its agent found it
#: inside an op no read showed (``RankState.unseen``: ``UNSEEN_KEPT`` names, each cut to
#: ``UNSEEN_NAME``: torch names groups "0", "1", ... unless told otherwise).
UNSEEN_KEPT = 4
UNSEEN_NAME = 128
#: The program's own frames of its latest status (``RankState.where_stack``), each cut to
#: ``STACK_FRAME`` characters (``file:line in function``).
STACK_KEPT = 6
STACK_FRAME = 128
RANK_BYTES = 8192 + 2 * (80 + 4 * 1024) + UNSEEN_KEPT * (80 + 4 * UNSEEN_NAME) + STACK_KEPT * (80 + 4 * STACK_FRAME)


def text_bytes(text: str | None) -> int:
    return 0 if text is None else sys.getsizeof(text)  # exact for a str, wide characters included


def run_bytes(calls: int) -> int:
    return RUN_BYTES + RUN_CALL_BYTES * calls


def call_bytes(call: r.CallRecord) -> int:
    """An upper bound of what ``call`` takes in memory, its strings and tensors included."""
    n = CALL_BYTES + text_bytes(call.op) + text_bytes(call.group) + text_bytes(call.call_site)
    n += text_bytes(call.error) + text_bytes(call.reduce_op) + text_bytes(call.source)
    for meta in call.inputs + call.outputs:
        n += TENSOR_BYTES + 40 * len(meta.shape) + text_bytes(meta.dtype) + text_bytes(meta.device)
    for key, value in call.extra.items():
        n += 128 + text_bytes(key) + text_bytes(value)
    return n


def marker_bytes(marker: r.MarkerEvent) -> int:
    return 256 + text_bytes(marker.name) + text_bytes(marker.detail) + text_bytes(marker.call_site)


def group_bytes(info: r.GroupInfo) -> int:
    """A group's membership as held (one tuple of ints)."""
    return 256 + 40 * len(info.ranks) + text_bytes(info.name) + text_bytes(info.backend) + text_bytes(info.desc)


@dataclasses.dataclass
class Budget:
    """What the coordinator may hold, in bytes."""

    rank: int = DEFAULT_RANK_MB * MIB
    job: int = DEFAULT_JOB_MB * MIB
    total: int = DEFAULT_TOTAL_MB * MIB
    #: a job may hold this much a rank where that is more than ``job`` (0: ``job`` alone)
    job_per_rank: int = 0

    @classmethod
    def of_mb(cls, rank: float, job: float | None, total: float) -> Budget:
        """Budgets in MiB; ``job`` None: the default, grown with the job's ranks."""
        for mb in (rank, DEFAULT_JOB_MB if job is None else job, total):
            if not (0 < mb < 1 << 40):  # NaN, infinite, zero or negative
                raise ValueError(f"memory budgets must be positive numbers of MiB, not {mb}")
        if job is None:
            return cls(int(rank * MIB), DEFAULT_JOB_MB * MIB, int(total * MIB), JOB_KIB_PER_RANK * 1024)
        return cls(int(rank * MIB), int(job * MIB), int(total * MIB))

    def job_for(self, world_size: int) -> int:
        """What a job of ``world_size`` ranks may hold."""
        return max(self.job, world_size * self.job_per_rank)


UNLIMITED = Budget(1 << 62, 1 << 62, 1 << 62)


class Ledger:
    """The coordinator's account of what every job holds, against its budget. One lock (the
    coordinator's) guards it with the job states that charge it."""

    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget or UNLIMITED
        self.held = 0  # bytes charged by every job followed
        self.refused = 0  # calls, groups or slots refused for a budget
        self.trimmed = 0  # history records let go early to make room
        self.refused_by: dict[str, int] = {"rank": 0, "job": 0, "total": 0}

    def refuse(self, which: str) -> None:
        self.refused += 1
        self.refused_by[which] = self.refused_by.get(which, 0) + 1

    def view(self) -> dict[str, object]:
        return {
            "held_bytes": self.held,
            "limit_bytes": {"rank": self.budget.rank, "job": self.budget.job, "total": self.budget.total},
            "refused": self.refused,
            "refused_by": dict(self.refused_by),
            "trimmed": self.trimmed,
        }
