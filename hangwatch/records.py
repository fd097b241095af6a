"""Plain typed records: the vocabulary shared by the hook, the coordinator and the detectors.

Nothing here knows about protobuf or gRPC; ``hangwatch.wire`` converts at the edges.
Times are Unix seconds (float). Ranks are global ranks.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from hangwatch import catalogue


class OpKind(str, enum.Enum):
    """How an operation's participants are matched."""

    COLLECTIVE = "collective"  # every member of the group, aligned by (group, seq)
    P2P = "p2p"  # two ranks, aligned by (group, src, dst, pair seq)
    MARKER = "marker"  # not a communication (e.g. accelerate.set_trigger)


#: Point-to-point operations (from the catalogue). Everything else recorded is a collective
#: unless a marker.
P2P_OPS = frozenset(catalogue.record_names([catalogue.Kind.P2P]))
SEND_OPS = frozenset(catalogue.record_names([catalogue.Kind.P2P], catalogue.Direction.SEND))
RECV_OPS = frozenset(catalogue.record_names([catalogue.Kind.P2P], catalogue.Direction.RECV))
MARKER_OPS = frozenset(catalogue.record_names([catalogue.Kind.MARKER]))


def op_kind(op: str) -> OpKind:
    if op in P2P_OPS:
        return OpKind.P2P
    if op in MARKER_OPS:
        return OpKind.MARKER
    return OpKind.COLLECTIVE


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype and device of one tensor argument (``dtype='object'`` for object lists)."""

    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"

    def describe(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


@dataclass(slots=True)
class CallRecord:
    """One collective or point-to-point call as one rank made it.

    ``seq`` is the process group's own collective sequence number (the first one the call
    issued; torch numbers collectives per group from 1), so calls issued from Python line up
    with collectives issued from C++ (DDP) and seen through Flight Recorder. For p2p calls
    ``seq`` counts calls between the same (src, dst) pair in that group, from 1.
    """

    rank: int
    call_id: int
    op: str
    group: str
    seq: int
    inputs: tuple[TensorMeta, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()
    reduce_op: str | None = None
    root: int | None = None  # global rank of src/dst of rooted collectives
    peer: int | None = None  # global rank of the other side of a p2p call
    async_op: bool = False
    step: int = 0
    call_site: str = ""
    enter_time: float = 0.0
    exit_time: float | None = None
    source: str = "python"  # "python" or "flight_recorder"
    error: str | None = None
    seq_count: int = 1  # collectives this call issued (object collectives issue several)
    extra: dict[str, str] = field(default_factory=dict)  # op-specific args (split sizes, ...)
    #: coordinator only: when the host thread returned from a call whose work is still under way
    #: on the device (NCCL: enqueued, not completed); the call stays open until it completes
    returned_time: float | None = None
    #: coordinator only: the bytes it is charged, once, while a table holds it (``budget``)
    cost: int = field(default=0, compare=False, repr=False)
    #: coordinator only: how many of the job state's tables hold it (charged once, while > 0)
    holds: int = field(default=0, compare=False, repr=False)
    #: coordinator only, on a signature's template: whether its calls are wrong in themselves,
    #: and against which group size (``state.facts``)
    judged: tuple[int | None, bool] | None = field(default=None, compare=False, repr=False)
    #: coordinator only, on a signature's template: what the job state derived from a run of
    #: it alone (``state.facts.facts_of``)
    facts: object = field(default=None, compare=False, repr=False)

    @property
    def kind(self) -> OpKind:
        return op_kind(self.op)

    @property
    def done(self) -> bool:
        return self.exit_time is not None


@dataclass(frozen=True, slots=True)
class CallExit:
    """Completion of a call recorded earlier (``call_id``) on the same rank."""

    rank: int
    call_id: int
    exit_time: float
    error: str | None = None
    seq_count: int = 1


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A process group as one rank sees it; ``index`` is its creation order on that rank."""

    name: str
    ranks: tuple[int, ...]
    backend: str = ""
    index: int = 0
    desc: str = ""


class GroupEventKind(str, enum.Enum):
    CREATED = "created"
    DESTROYED = "destroyed"


@dataclass(frozen=True, slots=True)
class GroupEvent:
    rank: int
    kind: GroupEventKind
    group: GroupInfo
    time: float
    call_site: str = ""


@dataclass(frozen=True, slots=True)
class StepEvent:
    rank: int
    step: int
    time: float


@dataclass(frozen=True, slots=True)
class Steps:
    """A batch's steps, each a ``StepEvent`` in order, where the batch holds no other event (a
    node agent sends them so, ``ReportBatch.step_number``): taken at once, not one by one."""

    rank: int
    steps: tuple[int, ...]
    times: tuple[float, ...]


#: The marker of a DDP forward pass whose backward will synchronise gradients (grad enabled, not
#: under ``no_sync()``); its detail is ``"<group>:<seq>"``, the DDP group and torch's sequence
#: number on it when the forward began. A rank whose forward passes keep pace with the others'
#: while its gradient all-reduces fall behind skipped a backward (``model.align``).
DDP_FORWARD = "ddp.forward"
#: Phases of a process its launcher started as a rank, before it joined (``RankIdentity.phase``):
#: started, not in ``init_process_group`` yet; inside it; ended without joining.
STARTING, IN_INIT, GONE = "starting", "init", "gone"
JOIN_PHASES = (STARTING, IN_INIT, GONE)
#: The op of a hang before the ranks joined (``diagnosis.detectors.joins``).
INIT_OP = "init_process_group"
#: Marker a rank's hook writes as it turns its call capture off after an internal error (its
#: detail: what it was doing, and the error): calls after it are not recorded.
CAPTURE_OFF = "hangwatch.capture_off"


@dataclass(frozen=True, slots=True)
class MarkerEvent:
    """Something worth knowing that is not a communication (e.g. Accelerate's set_trigger)."""

    rank: int
    name: str
    time: float
    detail: str = ""
    call_site: str = ""
    step: int = 0


class EndKind(str, enum.Enum):
    CLEAN_EXIT = "clean_exit"  # interpreter exiting normally
    EXCEPTION = "exception"  # uncaught exception
    SIGNAL = "signal"  # a fatal signal the hook could catch
    DESTROYED = "destroyed"  # destroy_process_group on the default group


@dataclass(frozen=True, slots=True)
class RankEnd:
    """The end of a rank (or of its distributed life), as reported by the rank itself."""

    rank: int
    kind: EndKind
    time: float
    detail: str = ""  # exception "Type: message", signal name, ...
    call_site: str = ""  # the user's frame where it happened
    exit_code: int | None = None
    step: int = 0


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """Who a registering rank is."""

    job_id: str
    rank: int
    world_size: int
    host: str
    pid: int
    local_rank: int = -1
    start_time: float = 0.0  # process creation time (psutil's create_time), for pid reuse
    session: str = ""  # random per process: a restart of the rank gets a new one
    backend: str = ""
    torch_version: str = ""
    hook_version: str = ""
    pid_namespace: str = ""  # e.g. "pid:[4026532451]": a rank in a container reports its own pid
    #: where its job's ranks met (the rendezvous endpoint, MASTER_ADDR:MASTER_PORT): two jobs
    #: running at once have different ones, whatever their run ids say
    launch: str = ""
    attempt: int = 0  # the launcher's restart count (TORCHELASTIC_RESTART_COUNT): a new attempt, a new run
    #: "" for a rank; for a process its launcher started as the rank, before it joined (its
    #: node agent says so): ``JOIN_PHASES``
    phase: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    rank: int
    time: float
    queued: int = 0  # events waiting in the rank's queue
    dropped: int = 0  # events dropped so far because the queue was full


@dataclass(frozen=True, slots=True)
class GroupProgress:
    """Where a process group's collectives stand on the device (NCCL): the last seq enqueued,
    started (-1: unknown, CUDA start events off) and completed, read from the rank's NCCL Flight
    Recorder ring at ``time`` (rank clock). ``completed_time``/``started_time``: when torch's
    watchdog discovered those seqs completed/started (0: unknown). ``timeout_ms``: torch's own
    timeout for the group's collectives (0: unknown)."""

    rank: int
    group: str
    enqueued: int
    started: int
    completed: int
    time: float
    completed_time: float = 0.0
    timeout_ms: int = 0
    started_time: float = 0.0


@dataclass(eq=False, slots=True)
class Shape:
    """A rank's cycle of templates on one group, in one turn (the runs of it start anywhere in
    it: ``CallRun.turn``), and what the job state derived from it once (``state.facts.facts_of``)."""

    templates: tuple[CallRecord, ...]
    facts: object = None


@dataclass(eq=False, slots=True)
class CallRun:
    """Consecutive calls of one rank that are alike but for their ids, seqs and times: the same
    collective signature (``template``: a call whose per-call fields are unset), call ids and
    seqs one apart, one training step, each returned without error having issued one
    collective. What a rank in its steady state sends most: the job state takes it whole and
    makes a call of it only where a table needs one (``CallRun.call``), so the coordinator's
    cost per call falls with the run's length (issue 16). ``enters`` and ``exits`` are the
    calls' times, on the rank's clock.

    A run may also be a repeating cycle of signatures on one group (``cycle``: the templates of
    the calls after the first in each period, so the period is ``1 + len(cycle)``): a layer that
    calls two collectives from two lines, over and over, makes A B A B...; call ``i`` is then of
    ``templates[i % period]``, everything else as above.

    A run the coordinator folded from calls sent one by one (``hangwatch.folds``) may cross
    steps: every ``per_step`` calls, ``lead`` of the first step's made before the run's first
    (a step of FSDP's layers, one period of its cycle, step after step)."""

    rank: int
    template: CallRecord
    first_call_id: int
    first_seq: int
    step: int
    enters: list[float]
    exits: list[float]
    #: coordinator only: the rank's clock offset when it was taken, so that a call made of it
    #: later has the times it would have had then
    offset: float = 0.0
    #: coordinator only: the bytes it is charged while the job state holds it, and to whom
    cost: int = 0
    holder: object = None
    #: the templates of a cycle's calls after the first in each period (empty: one signature)
    cycle: tuple[CallRecord, ...] = ()
    #: calls a step, where the run crosses steps (0: all of ``step``), and the calls of the
    #: first step made before the run's first
    per_step: int = 0
    lead: int = 0
    #: coordinator only: the rank's cycle this run is of, whatever call it starts at, and the
    #: run's first call's place in it (``folds.Folder``); None: not known
    shape: Shape | None = None
    turn: int = 0

    def __len__(self) -> int:
        return len(self.enters)

    def step_at(self, i: int) -> int:
        """The step of the ``i``-th call."""
        return self.step + (self.lead + i) // self.per_step if self.per_step else self.step

    @property
    def last_step(self) -> int:
        return self.step_at(len(self.enters) - 1)

    def tail(self, k: int) -> CallRun:
        """The run without its first ``k`` calls (its cycle turned to start at the next)."""
        templates = self.templates
        turn = k % len(templates)
        templates = templates[turn:] + templates[:turn]
        per = self.per_step
        return CallRun(
            self.rank, templates[0], self.first_call_id + k, self.first_seq + k, self.step_at(k), self.enters[k:],
            self.exits[k:], self.offset, cycle=templates[1:], per_step=per, lead=(self.lead + k) % per if per else 0,
        )  # fmt: skip

    @property
    def templates(self) -> tuple[CallRecord, ...]:
        """One template per call of a period, the first call's first."""
        return (self.template, *self.cycle)

    def template_at(self, i: int) -> CallRecord:
        """The template of the ``i``-th call."""
        cycle = self.cycle
        if not cycle:
            return self.template
        k = i % (len(cycle) + 1)
        return cycle[k - 1] if k else self.template

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.enters) - 1

    def call(self, i: int, offset: float = 0.0) -> CallRecord:
        """The ``i``-th call, as the rank would have sent it alone (times on the rank's clock,
        plus ``offset``: the coordinator's, where it passes the run's)."""
        t = self.template_at(i) if self.cycle else self.template
        return CallRecord(
            self.rank, self.first_call_id + i, t.op, t.group, self.first_seq + i, t.inputs, t.outputs, t.reduce_op,
            t.root, t.peer, t.async_op, self.step_at(i), t.call_site, self.enters[i] + offset, self.exits[i] + offset,
            t.source, None, 1, t.extra, None, t.cost,
        )  # fmt: skip

    def calls(self) -> list[CallRecord]:
        return [self.call(i) for i in range(len(self.enters))]


RankEvent = (
    CallRecord | CallExit | GroupEvent | StepEvent | Steps | MarkerEvent | RankEnd | Heartbeat | GroupProgress | CallRun
)


class ProcState(str, enum.Enum):
    """A process as the node agent sees it."""

    RUNNING = "running"
    SLEEPING = "sleeping"
    DISK_SLEEP = "disk-sleep"
    STOPPED = "stopped"
    ZOMBIE = "zombie"
    DEAD = "dead"  # gone
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One GPU a rank runs on, as NVML saw it (the agent's ``gpu`` extra). -1: unknown."""

    index: int
    uuid: str = ""
    name: str = ""
    utilization: int = -1  # percent of NVML's last sample period a kernel was running
    memory_used: int = 0  # bytes, the whole device
    memory_total: int = 0
    process_memory: int = 0  # bytes this rank holds on it
    ecc_uncorrected: int = -1  # volatile uncorrected ECC errors since the driver loaded
    xid: int = 0  # the last Xid error NVML reported on it since the agent started (0: none)
    xid_time: float = 0.0


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    """One rank's process as seen from outside by the agent on its node."""

    pid: int
    state: ProcState
    time: float
    start_time: float = 0.0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    num_threads: int = 0
    exit_code: int | None = None  # where it can be known (a zombie's exit status)
    signal: int | None = None
    oom_killed: bool = False  # its cgroup's oom_kill counter went up as it died (cgroup v2)
    gpus: tuple[GpuStatus, ...] = ()  # the GPUs it runs on (NVML; empty on CPU nodes)


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    filename: str
    line: int
    native: bool = False  # a C/C++ frame (py-spy --native)

    def describe(self) -> str:
        where = f"{self.filename}:{self.line}" if self.line else self.filename
        return f"{self.function} ({where})"


@dataclass(frozen=True, slots=True)
class ThreadStack:
    thread_id: int
    name: str
    frames: tuple[Frame, ...]  # innermost first, as py-spy prints
    active: bool = True
    owns_gil: bool = False


@dataclass(frozen=True, slots=True)
class StackDump:
    """Stacks of one process; ``error`` says why there are none (e.g. ptrace refused)."""

    pid: int
    time: float
    threads: tuple[ThreadStack, ...] = ()
    text: str = ""
    native: bool = False
    error: str | None = None
    #: its own processes' stacks (a rank's DataLoader workers, a subprocess it waits for)
    children: tuple[StackDump, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None


def link_tag(session: str) -> str:
    """What names a rank's link to an agent without giving its session away: a digest of it."""
    return hashlib.sha256(b"hangwatch-link:" + session.encode("utf-8", "replace")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Target:
    """A rank's process, identified by pid and start time so a reused pid is never mistaken."""

    rank: int
    pid: int
    start_time: float
    pid_namespace: str = ""  # the rank's pid namespace; its pid is as seen inside it
    #: ``link_tag(session)`` of the registration this target is a rank of: the agent touches the
    #: process only where its own link came with that session (empty: matches no link)
    link: str = ""
