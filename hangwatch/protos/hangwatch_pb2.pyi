from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("shape", "dtype", "device")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class Call(_message.Message):
    __slots__ = ("call_id", "op", "group", "seq", "inputs", "outputs", "reduce_op", "root", "peer", "async_op", "step", "call_site", "enter_time", "exit_time", "source", "error", "seq_count", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ASYNC_OP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CALL_SITE_FIELD_NUMBER: _ClassVar[int]
    ENTER_TIME_FIELD_NUMBER: _ClassVar[int]
    EXIT_TIME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    op: str
    group: str
    seq: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    reduce_op: str
    root: int
    peer: int
    async_op: bool
    step: int
    call_site: str
    enter_time: float
    exit_time: float
    source: str
    error: str
    seq_count: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., op: _Optional[str] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., reduce_op: _Optional[str] = ..., root: _Optional[int] = ..., peer: _Optional[int] = ..., async_op: _Optional[bool] = ..., step: _Optional[int] = ..., call_site: _Optional[str] = ..., enter_time: _Optional[float] = ..., exit_time: _Optional[float] = ..., source: _Optional[str] = ..., error: _Optional[str] = ..., seq_count: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CallDone(_message.Message):
    __slots__ = ("call_id", "exit_time", "error", "seq_count")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EXIT_TIME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_COUNT_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    exit_time: float
    error: str
    seq_count: int
    def __init__(self, call_id: _Optional[int] = ..., exit_time: _Optional[float] = ..., error: _Optional[str] = ..., seq_count: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("name", "ranks", "backend", "index", "desc")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DESC_FIELD_NUMBER: _ClassVar[int]
    name: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    backend: str
    index: int
    desc: str
    def __init__(self, name: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., backend: _Optional[str] = ..., index: _Optional[int] = ..., desc: _Optional[str] = ...) -> None: ...

class GroupChange(_message.Message):
    __slots__ = ("kind", "group", "time", "call_site")
    KIND_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    CALL_SITE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    group: Group
    time: float
    call_site: str
    def __init__(self, kind: _Optional[str] = ..., group: _Optional[_Union[Group, _Mapping]] = ..., time: _Optional[float] = ..., call_site: _Optional[str] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("step", "time")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: float
    def __init__(self, step: _Optional[int] = ..., time: _Optional[float] = ...) -> None: ...

class Marker(_message.Message):
    __slots__ = ("name", "time", "detail", "call_site", "step")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CALL_SITE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    name: str
    time: float
    detail: str
    call_site: str
    step: int
    def __init__(self, name: _Optional[str] = ..., time: _Optional[float] = ..., detail: _Optional[str] = ..., call_site: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("kind", "time", "detail", "call_site", "exit_code", "step")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CALL_SITE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    kind: str
    time: float
    detail: str
    call_site: str
    exit_code: int
    step: int
    def __init__(self, kind: _Optional[str] = ..., time: _Optional[float] = ..., detail: _Optional[str] = ..., call_site: _Optional[str] = ..., exit_code: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("group", "enqueued", "started", "completed", "time", "completed_time", "timeout_ms", "started_time")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_TIME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STARTED_TIME_FIELD_NUMBER: _ClassVar[int]
    group: str
    enqueued: int
    started: int
    completed: int
    time: float
    completed_time: float
    timeout_ms: int
    started_time: float
    def __init__(self, group: _Optional[str] = ..., enqueued: _Optional[int] = ..., started: _Optional[int] = ..., completed: _Optional[int] = ..., time: _Optional[float] = ..., completed_time: _Optional[float] = ..., timeout_ms: _Optional[int] = ..., started_time: _Optional[float] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("call", "done", "group", "step", "marker", "end", "progress")
    CALL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MARKER_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    call: Call
    done: CallDone
    group: GroupChange
    step: Step
    marker: Marker
    end: End
    progress: Progress
    def __init__(self, call: _Optional[_Union[Call, _Mapping]] = ..., done: _Optional[_Union[CallDone, _Mapping]] = ..., group: _Optional[_Union[GroupChange, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., marker: _Optional[_Union[Marker, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class Signature(_message.Message):
    __slots__ = ("id", "call")
    ID_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    id: int
    call: Call
    def __init__(self, id: _Optional[int] = ..., call: _Optional[_Union[Call, _Mapping]] = ...) -> None: ...

class CallColumns(_message.Message):
    __slots__ = ("signature", "call_id", "seq", "step", "enter_time", "exit_time", "seq_count", "run", "run_enter", "run_exit", "run_cycle", "run_signature", "run_per_step", "run_lead")
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENTER_TIME_FIELD_NUMBER: _ClassVar[int]
    EXIT_TIME_FIELD_NUMBER: _ClassVar[int]
    SEQ_COUNT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RUN_ENTER_FIELD_NUMBER: _ClassVar[int]
    RUN_EXIT_FIELD_NUMBER: _ClassVar[int]
    RUN_CYCLE_FIELD_NUMBER: _ClassVar[int]
    RUN_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RUN_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    RUN_LEAD_FIELD_NUMBER: _ClassVar[int]
    signature: _containers.RepeatedScalarFieldContainer[int]
    call_id: _containers.RepeatedScalarFieldContainer[int]
    seq: _containers.RepeatedScalarFieldContainer[int]
    step: _containers.RepeatedScalarFieldContainer[int]
    enter_time: _containers.RepeatedScalarFieldContainer[float]
    exit_time: _containers.RepeatedScalarFieldContainer[float]
    seq_count: _containers.RepeatedScalarFieldContainer[int]
    run: _containers.RepeatedScalarFieldContainer[int]
    run_enter: _containers.RepeatedScalarFieldContainer[float]
    run_exit: _containers.RepeatedScalarFieldContainer[float]
    run_cycle: _containers.RepeatedScalarFieldContainer[int]
    run_signature: _containers.RepeatedScalarFieldContainer[int]
    run_per_step: _containers.RepeatedScalarFieldContainer[int]
    run_lead: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, signature: _Optional[_Iterable[int]] = ..., call_id: _Optional[_Iterable[int]] = ..., seq: _Optional[_Iterable[int]] = ..., step: _Optional[_Iterable[int]] = ..., enter_time: _Optional[_Iterable[float]] = ..., exit_time: _Optional[_Iterable[float]] = ..., seq_count: _Optional[_Iterable[int]] = ..., run: _Optional[_Iterable[int]] = ..., run_enter: _Optional[_Iterable[float]] = ..., run_exit: _Optional[_Iterable[float]] = ..., run_cycle: _Optional[_Iterable[int]] = ..., run_signature: _Optional[_Iterable[int]] = ..., run_per_step: _Optional[_Iterable[int]] = ..., run_lead: _Optional[_Iterable[int]] = ...) -> None: ...

class RankIdentity(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "host", "pid", "local_rank", "start_time", "session", "backend", "torch_version", "hook_version", "pid_namespace", "launch", "attempt", "phase")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOOK_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    host: str
    pid: int
    local_rank: int
    start_time: float
    session: str
    backend: str
    torch_version: str
    hook_version: str
    pid_namespace: str
    launch: str
    attempt: int
    phase: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ..., start_time: _Optional[float] = ..., session: _Optional[str] = ..., backend: _Optional[str] = ..., torch_version: _Optional[str] = ..., hook_version: _Optional[str] = ..., pid_namespace: _Optional[str] = ..., launch: _Optional[str] = ..., attempt: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("token", "identity", "via")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    token: str
    identity: RankIdentity
    via: str
    def __init__(self, token: _Optional[str] = ..., identity: _Optional[_Union[RankIdentity, _Mapping]] = ..., via: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("coordinator_id", "server_time", "report_interval_s", "last_call_id", "takes_runs", "takes_cycles", "takes_steps", "steady_read_s")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TAKES_RUNS_FIELD_NUMBER: _ClassVar[int]
    TAKES_CYCLES_FIELD_NUMBER: _ClassVar[int]
    TAKES_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEADY_READ_S_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    server_time: float
    report_interval_s: float
    last_call_id: int
    takes_runs: bool
    takes_cycles: bool
    takes_steps: bool
    steady_read_s: float
    def __init__(self, coordinator_id: _Optional[str] = ..., server_time: _Optional[float] = ..., report_interval_s: _Optional[float] = ..., last_call_id: _Optional[int] = ..., takes_runs: _Optional[bool] = ..., takes_cycles: _Optional[bool] = ..., takes_steps: _Optional[bool] = ..., steady_read_s: _Optional[float] = ...) -> None: ...

class ReportBatch(_message.Message):
    __slots__ = ("token", "job_id", "rank", "session", "batch_seq", "sent_time", "queued", "dropped", "events", "where", "where_user", "signatures", "calls", "urgent", "relay_held_s", "alive_time", "mono_time", "budget_note", "flight_read_time", "flight_unseen", "where_stack", "folded", "step_number", "step_time", "unread")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_TIME_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    WHERE_USER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    URGENT_FIELD_NUMBER: _ClassVar[int]
    RELAY_HELD_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    MONO_TIME_FIELD_NUMBER: _ClassVar[int]
    BUDGET_NOTE_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_READ_TIME_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_UNSEEN_FIELD_NUMBER: _ClassVar[int]
    WHERE_STACK_FIELD_NUMBER: _ClassVar[int]
    FOLDED_FIELD_NUMBER: _ClassVar[int]
    STEP_NUMBER_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    UNREAD_FIELD_NUMBER: _ClassVar[int]
    token: str
    job_id: str
    rank: int
    session: str
    batch_seq: int
    sent_time: float
    queued: int
    dropped: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    where: str
    where_user: str
    signatures: _containers.RepeatedCompositeFieldContainer[Signature]
    calls: CallColumns
    urgent: bool
    relay_held_s: float
    alive_time: float
    mono_time: float
    budget_note: str
    flight_read_time: float
    flight_unseen: _containers.RepeatedScalarFieldContainer[str]
    where_stack: _containers.RepeatedScalarFieldContainer[str]
    folded: bool
    step_number: _containers.RepeatedScalarFieldContainer[int]
    step_time: _containers.RepeatedScalarFieldContainer[float]
    unread: bool
    def __init__(self, token: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., session: _Optional[str] = ..., batch_seq: _Optional[int] = ..., sent_time: _Optional[float] = ..., queued: _Optional[int] = ..., dropped: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., where: _Optional[str] = ..., where_user: _Optional[str] = ..., signatures: _Optional[_Iterable[_Union[Signature, _Mapping]]] = ..., calls: _Optional[_Union[CallColumns, _Mapping]] = ..., urgent: _Optional[bool] = ..., relay_held_s: _Optional[float] = ..., alive_time: _Optional[float] = ..., mono_time: _Optional[float] = ..., budget_note: _Optional[str] = ..., flight_read_time: _Optional[float] = ..., flight_unseen: _Optional[_Iterable[str]] = ..., where_stack: _Optional[_Iterable[str]] = ..., folded: _Optional[bool] = ..., step_number: _Optional[_Iterable[int]] = ..., step_time: _Optional[_Iterable[float]] = ..., unread: _Optional[bool] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("reregister", "server_time", "accepted")
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    server_time: float
    accepted: int
    def __init__(self, reregister: _Optional[bool] = ..., server_time: _Optional[float] = ..., accepted: _Optional[int] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("token", "relay_host", "reports")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RELAY_HOST_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    token: str
    relay_host: str
    reports: _containers.RepeatedCompositeFieldContainer[ReportBatch]
    def __init__(self, token: _Optional[str] = ..., relay_host: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[ReportBatch, _Mapping]]] = ...) -> None: ...

class RelayReply(_message.Message):
    __slots__ = ("replies", "server_time")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[ReportReply]
    server_time: float
    def __init__(self, replies: _Optional[_Iterable[_Union[ReportReply, _Mapping]]] = ..., server_time: _Optional[float] = ...) -> None: ...

class AgentIdentity(_message.Message):
    __slots__ = ("host", "pid", "version", "embedded", "can_ptrace", "ptrace_note")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_FIELD_NUMBER: _ClassVar[int]
    CAN_PTRACE_FIELD_NUMBER: _ClassVar[int]
    PTRACE_NOTE_FIELD_NUMBER: _ClassVar[int]
    host: str
    pid: int
    version: str
    embedded: bool
    can_ptrace: bool
    ptrace_note: str
    def __init__(self, host: _Optional[str] = ..., pid: _Optional[int] = ..., version: _Optional[str] = ..., embedded: _Optional[bool] = ..., can_ptrace: _Optional[bool] = ..., ptrace_note: _Optional[str] = ...) -> None: ...

class AgentRegisterRequest(_message.Message):
    __slots__ = ("token", "agent")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    token: str
    agent: AgentIdentity
    def __init__(self, token: _Optional[str] = ..., agent: _Optional[_Union[AgentIdentity, _Mapping]] = ...) -> None: ...

class AgentRegisterReply(_message.Message):
    __slots__ = ("agent_id", "coordinator_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    coordinator_id: str
    def __init__(self, agent_id: _Optional[str] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class Target(_message.Message):
    __slots__ = ("rank", "pid", "start_time", "pid_namespace", "link")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    start_time: float
    pid_namespace: str
    link: str
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., start_time: _Optional[float] = ..., pid_namespace: _Optional[str] = ..., link: _Optional[str] = ...) -> None: ...

class ProcStatus(_message.Message):
    __slots__ = ("pid", "state", "time", "start_time", "cpu_percent", "rss_bytes", "num_threads", "exit_code", "signal", "oom_killed", "gpus")
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    state: str
    time: float
    start_time: float
    cpu_percent: float
    rss_bytes: int
    num_threads: int
    exit_code: int
    signal: int
    oom_killed: bool
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStatus]
    def __init__(self, pid: _Optional[int] = ..., state: _Optional[str] = ..., time: _Optional[float] = ..., start_time: _Optional[float] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., num_threads: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., oom_killed: _Optional[bool] = ..., gpus: _Optional[_Iterable[_Union[GpuStatus, _Mapping]]] = ...) -> None: ...

class GpuStatus(_message.Message):
    __slots__ = ("index", "uuid", "name", "utilization", "memory_used", "memory_total", "process_memory", "ecc_uncorrected", "xid", "xid_time")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROCESS_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    XID_TIME_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    utilization: int
    memory_used: int
    memory_total: int
    process_memory: int
    ecc_uncorrected: int
    xid: int
    xid_time: float
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., utilization: _Optional[int] = ..., memory_used: _Optional[int] = ..., memory_total: _Optional[int] = ..., process_memory: _Optional[int] = ..., ecc_uncorrected: _Optional[int] = ..., xid: _Optional[int] = ..., xid_time: _Optional[float] = ...) -> None: ...

class FrameMsg(_message.Message):
    __slots__ = ("function", "filename", "line", "native")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    function: str
    filename: str
    line: int
    native: bool
    def __init__(self, function: _Optional[str] = ..., filename: _Optional[str] = ..., line: _Optional[int] = ..., native: _Optional[bool] = ...) -> None: ...

class ThreadStackMsg(_message.Message):
    __slots__ = ("thread_id", "name", "frames", "active", "owns_gil")
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    OWNS_GIL_FIELD_NUMBER: _ClassVar[int]
    thread_id: int
    name: str
    frames: _containers.RepeatedCompositeFieldContainer[FrameMsg]
    active: bool
    owns_gil: bool
    def __init__(self, thread_id: _Optional[int] = ..., name: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[FrameMsg, _Mapping]]] = ..., active: _Optional[bool] = ..., owns_gil: _Optional[bool] = ...) -> None: ...

class StackDumpMsg(_message.Message):
    __slots__ = ("pid", "rank", "time", "threads", "text", "native", "error", "children")
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    pid: int
    rank: int
    time: float
    threads: _containers.RepeatedCompositeFieldContainer[ThreadStackMsg]
    text: str
    native: bool
    error: str
    children: _containers.RepeatedCompositeFieldContainer[StackDumpMsg]
    def __init__(self, pid: _Optional[int] = ..., rank: _Optional[int] = ..., time: _Optional[float] = ..., threads: _Optional[_Iterable[_Union[ThreadStackMsg, _Mapping]]] = ..., text: _Optional[str] = ..., native: _Optional[bool] = ..., error: _Optional[str] = ..., children: _Optional[_Iterable[_Union[StackDumpMsg, _Mapping]]] = ...) -> None: ...

class DumpCommand(_message.Message):
    __slots__ = ("targets", "native", "timeout_s")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[Target]
    native: bool
    timeout_s: float
    def __init__(self, targets: _Optional[_Iterable[_Union[Target, _Mapping]]] = ..., native: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AbortCommand(_message.Message):
    __slots__ = ("targets", "grace_s")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[Target]
    grace_s: float
    def __init__(self, targets: _Optional[_Iterable[_Union[Target, _Mapping]]] = ..., grace_s: _Optional[float] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "dump", "abort")
    ID_FIELD_NUMBER: _ClassVar[int]
    DUMP_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    id: int
    dump: DumpCommand
    abort: AbortCommand
    def __init__(self, id: _Optional[int] = ..., dump: _Optional[_Union[DumpCommand, _Mapping]] = ..., abort: _Optional[_Union[AbortCommand, _Mapping]] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("id", "stacks", "error", "aborted_pids", "refused")
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ABORTED_PIDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    id: int
    stacks: _containers.RepeatedCompositeFieldContainer[StackDumpMsg]
    error: str
    aborted_pids: _containers.RepeatedScalarFieldContainer[int]
    refused: _containers.ScalarMap[int, str]
    def __init__(self, id: _Optional[int] = ..., stacks: _Optional[_Iterable[_Union[StackDumpMsg, _Mapping]]] = ..., error: _Optional[str] = ..., aborted_pids: _Optional[_Iterable[int]] = ..., refused: _Optional[_Mapping[int, str]] = ...) -> None: ...

class AgentPollRequest(_message.Message):
    __slots__ = ("token", "agent_id", "processes", "results", "wait_s")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    token: str
    agent_id: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcStatus]
    results: _containers.RepeatedCompositeFieldContainer[CommandResult]
    wait_s: float
    def __init__(self, token: _Optional[str] = ..., agent_id: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcStatus, _Mapping]]] = ..., results: _Optional[_Iterable[_Union[CommandResult, _Mapping]]] = ..., wait_s: _Optional[float] = ...) -> None: ...

class AgentPollReply(_message.Message):
    __slots__ = ("watch", "commands", "reregister")
    WATCH_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    watch: _containers.RepeatedCompositeFieldContainer[Target]
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    reregister: bool
    def __init__(self, watch: _Optional[_Iterable[_Union[Target, _Mapping]]] = ..., commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., reregister: _Optional[bool] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("token", "id", "native", "limit", "job")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NATIVE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    token: str
    id: str
    native: bool
    limit: int
    job: str
    def __init__(self, token: _Optional[str] = ..., id: _Optional[str] = ..., native: _Optional[bool] = ..., limit: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class ImportRequest(_message.Message):
    __slots__ = ("token", "job", "dumps")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    DUMPS_FIELD_NUMBER: _ClassVar[int]
    token: str
    job: str
    dumps: bytes
    def __init__(self, token: _Optional[str] = ..., job: _Optional[str] = ..., dumps: _Optional[bytes] = ...) -> None: ...

class JsonReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
