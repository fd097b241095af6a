"""Conversion between the typed records (``hangwatch.records``) and protobuf messages.

This is the only module that knows both worlds: the hook builds records, the coordinator's
detectors consume records, and protobuf stays at the edges.
"""

from __future__ import annotations

import math

from hangwatch import records as r
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.untrusted import printable

# ---- records -> protobuf ------------------------------------------------------------------


def tensor_to_pb(t: r.TensorMeta, msg: pb.TensorMeta) -> None:
    msg.shape.extend(t.shape)
    msg.dtype = t.dtype
    msg.device = t.device


def call_to_pb(c: r.CallRecord, msg: pb.Call) -> None:
    msg.call_id = c.call_id
    msg.op = c.op
    msg.group = c.group
    msg.seq = c.seq
    for t in c.inputs:
        tensor_to_pb(t, msg.inputs.add())
    for t in c.outputs:
        tensor_to_pb(t, msg.outputs.add())
    if c.reduce_op:
        msg.reduce_op = c.reduce_op
    if c.root is not None:
        msg.root = c.root
    if c.peer is not None:
        msg.peer = c.peer
    msg.async_op = c.async_op
    msg.step = c.step
    msg.call_site = c.call_site
    msg.enter_time = c.enter_time
    if c.exit_time is not None:
        msg.exit_time = c.exit_time
    msg.source = c.source
    if c.error:
        msg.error = c.error
    msg.seq_count = c.seq_count
    if c.extra:
        msg.extra.update(c.extra)


def group_to_pb(g: r.GroupInfo, msg: pb.Group) -> None:
    msg.name = g.name
    msg.ranks.extend(g.ranks)
    msg.backend = g.backend
    msg.index = g.index
    msg.desc = g.desc


def event_to_pb(ev: r.RankEvent, msg: pb.Event) -> bool:
    """Fill ``msg`` from a rank event; False for events that are not sent as events."""
    if isinstance(ev, r.CallRecord):
        call_to_pb(ev, msg.call)
    elif isinstance(ev, r.CallExit):
        msg.done.call_id = ev.call_id
        msg.done.exit_time = ev.exit_time
        msg.done.seq_count = ev.seq_count
        if ev.error:
            msg.done.error = ev.error
    elif isinstance(ev, r.GroupEvent):
        msg.group.kind = ev.kind.value
        group_to_pb(ev.group, msg.group.group)
        msg.group.time = ev.time
        msg.group.call_site = ev.call_site
    elif isinstance(ev, r.StepEvent):
        msg.step.step = ev.step
        msg.step.time = ev.time
    elif isinstance(ev, r.MarkerEvent):
        msg.marker.name = ev.name
        msg.marker.time = ev.time
        msg.marker.detail = ev.detail
        msg.marker.call_site = ev.call_site
        msg.marker.step = ev.step
    elif isinstance(ev, r.RankEnd):
        msg.end.kind = ev.kind.value
        msg.end.time = ev.time
        msg.end.detail = ev.detail
        msg.end.call_site = ev.call_site
        msg.end.step = ev.step
        if ev.exit_code is not None:
            msg.end.exit_code = ev.exit_code
    elif isinstance(ev, r.GroupProgress):
        p = msg.progress
        p.group = ev.group
        p.enqueued = ev.enqueued
        p.started = ev.started
        p.completed = ev.completed
        p.time = ev.time
        p.completed_time = ev.completed_time
        p.timeout_ms = ev.timeout_ms
        p.started_time = ev.started_time
    else:
        return False
    return True


def identity_to_pb(i: r.RankIdentity, msg: pb.RankIdentity) -> None:
    msg.job_id = i.job_id
    msg.rank = i.rank
    msg.world_size = i.world_size
    msg.host = i.host
    msg.pid = i.pid
    msg.local_rank = i.local_rank
    msg.start_time = i.start_time
    msg.session = i.session
    msg.backend = i.backend
    msg.torch_version = i.torch_version
    msg.hook_version = i.hook_version
    msg.pid_namespace = i.pid_namespace
    msg.launch = i.launch
    msg.attempt = i.attempt
    msg.phase = i.phase


def process_status_to_pb(s: r.ProcessStatus, msg: pb.ProcStatus) -> None:
    msg.pid = s.pid
    msg.state = s.state.value
    msg.time = s.time
    msg.start_time = s.start_time
    msg.cpu_percent = s.cpu_percent
    msg.rss_bytes = s.rss_bytes
    msg.num_threads = s.num_threads
    if s.exit_code is not None:
        msg.exit_code = s.exit_code
    if s.signal is not None:
        msg.signal = s.signal
    msg.oom_killed = s.oom_killed
    for g in s.gpus:
        gpb = msg.gpus.add()
        gpb.index, gpb.uuid, gpb.name, gpb.utilization = g.index, g.uuid, g.name, g.utilization
        gpb.memory_used, gpb.memory_total, gpb.process_memory = g.memory_used, g.memory_total, g.process_memory
        gpb.ecc_uncorrected, gpb.xid, gpb.xid_time = g.ecc_uncorrected, g.xid, g.xid_time


def stack_dump_to_pb(d: r.StackDump, rank: int, msg: pb.StackDumpMsg) -> None:
    msg.pid = d.pid
    msg.rank = rank
    msg.time = d.time
    msg.text = d.text
    msg.native = d.native
    if d.error:
        msg.error = d.error
    for t in d.threads:
        tm = msg.threads.add()
        tm.thread_id = t.thread_id
        tm.name = t.name
        tm.active = t.active
        tm.owns_gil = t.owns_gil
        for f in t.frames:
            fm = tm.frames.add()
            fm.function = f.function
            fm.filename = f.filename
            fm.line = f.line
            fm.native = f.native
    for child in d.children:
        stack_dump_to_pb(child, rank, msg.children.add())


# ---- protobuf -> records ------------------------------------------------------------------


class WireError(ValueError):
    """A message that is well-formed protobuf but not a valid hangwatch message."""


#: Longest strings kept, by kind of field: a longer one is cut at ingest and ends with
#: ``TRUNCATED``, so each record the coordinator keeps is bounded in bytes, not only in count
#: (an 8 MiB call site in every batch once took it from 47 to 634 MiB in 8 s).
MAX_NAME = 256  # op, group, dtype, host, ids, versions
MAX_SITE = 1024  # call sites ("file:line in function"), a rank's current frame
MAX_TEXT = 4096  # error messages, exception details, marker details
TRUNCATED = "...[cut]"
truncated = 0  # strings cut since start (``status``' ``rejected.truncated``, /metrics)


def clip(text: str, limit: int) -> str:
    """``text`` with control characters (ANSI escapes among them) shown as U+FFFD, cut to
    ``limit`` characters with ``TRUNCATED`` after the cut. Newlines and tabs are kept in texts
    (tracebacks), not in names."""
    global truncated
    text = printable(text, lines=limit >= MAX_TEXT)
    if len(text) <= limit:
        return text
    truncated += 1
    return text[:limit] + TRUNCATED


def _finite(*times: float) -> None:
    if not math.isfinite(sum(times)):  # (NaN or infinity in any: not; nor times too large to add)
        raise WireError("a time that is not a finite number")


MAX_DIMS = 16
MAX_TENSORS = 4096
MAX_GPUS = 64  # per process status: more than any node has
MAX_CHILDREN = 8  # a rank's own processes dumped with it (its DataLoader workers)


def tensor_from_pb(msg: pb.TensorMeta) -> r.TensorMeta:
    if len(msg.shape) > MAX_DIMS:
        raise WireError(f"tensor with {len(msg.shape)} dimensions (limit {MAX_DIMS})")
    return r.TensorMeta(tuple(msg.shape), clip(msg.dtype, MAX_NAME), clip(msg.device, MAX_NAME) or "cpu")


def call_from_pb(rank: int, msg: pb.Call) -> r.CallRecord:
    if not msg.op:
        raise WireError("call without op")
    if len(msg.inputs) + len(msg.outputs) > MAX_TENSORS:
        raise WireError("call with too many tensors")
    _finite(msg.enter_time, msg.exit_time)
    return r.CallRecord(
        rank=rank,
        call_id=msg.call_id,
        op=clip(msg.op, MAX_NAME),
        group=clip(msg.group, MAX_NAME),
        seq=msg.seq,
        inputs=tuple(tensor_from_pb(t) for t in msg.inputs),
        outputs=tuple(tensor_from_pb(t) for t in msg.outputs),
        reduce_op=clip(msg.reduce_op, MAX_NAME) or None,
        root=msg.root if msg.HasField("root") else None,
        peer=msg.peer if msg.HasField("peer") else None,
        async_op=msg.async_op,
        step=msg.step,
        call_site=clip(msg.call_site, MAX_SITE),
        enter_time=msg.enter_time,
        exit_time=msg.exit_time if msg.HasField("exit_time") else None,
        source=clip(msg.source, MAX_NAME) or "python",
        error=clip(msg.error, MAX_TEXT) or None,
        seq_count=msg.seq_count or 1,
        extra={clip(k, MAX_NAME): clip(v, MAX_TEXT) for k, v in list(msg.extra.items())[:MAX_EXTRA]},
    )


MAX_EXTRA = 32  # op-specific fields of one call


def group_from_pb(msg: pb.Group) -> r.GroupInfo:
    return r.GroupInfo(
        clip(msg.name, MAX_NAME), tuple(msg.ranks), clip(msg.backend, MAX_NAME), msg.index, clip(msg.desc, MAX_NAME)
    )


def step_from_pb(rank: int, msg: pb.Step) -> r.StepEvent:
    _finite(msg.time)
    return r.StepEvent(rank, msg.step, msg.time)


def event_from_pb(rank: int, msg: pb.Event) -> r.RankEvent:
    which = msg.WhichOneof("body")
    if which == "call":
        return call_from_pb(rank, msg.call)
    if which == "done":
        d = msg.done
        _finite(d.exit_time)
        return r.CallExit(rank, d.call_id, d.exit_time, clip(d.error, MAX_TEXT) or None, d.seq_count or 1)
    if which == "group":
        g = msg.group
        try:
            kind = r.GroupEventKind(g.kind)
        except ValueError:
            raise WireError(f"unknown group event kind {g.kind!r}") from None
        _finite(g.time)
        return r.GroupEvent(rank, kind, group_from_pb(g.group), g.time, clip(g.call_site, MAX_SITE))
    if which == "step":
        return step_from_pb(rank, msg.step)
    if which == "marker":
        m = msg.marker
        _finite(m.time)
        return r.MarkerEvent(
            rank, clip(m.name, MAX_NAME), m.time, clip(m.detail, MAX_TEXT), clip(m.call_site, MAX_SITE), m.step
        )
    if which == "end":
        e = msg.end
        try:
            end_kind = r.EndKind(e.kind)
        except ValueError:
            raise WireError(f"unknown end kind {e.kind!r}") from None
        _finite(e.time)
        return r.RankEnd(
            rank,
            end_kind,
            e.time,
            clip(e.detail, MAX_TEXT),
            clip(e.call_site, MAX_SITE),
            e.exit_code if e.HasField("exit_code") else None,
            e.step,
        )
    if which == "progress":
        p = msg.progress
        times = (p.time, p.completed_time, p.started_time)
        if not all(math.isfinite(t) for t in times):
            raise WireError("progress with a time that is not a finite number")
        if not p.group:
            raise WireError("progress without a group")
        return r.GroupProgress(
            rank,
            clip(p.group, MAX_NAME),
            p.enqueued,
            p.started,
            p.completed,
            p.time,
            p.completed_time,
            p.timeout_ms,
            p.started_time,
        )
    raise WireError("empty event")


def identity_from_pb(msg: pb.RankIdentity) -> r.RankIdentity:
    return r.RankIdentity(
        job_id=clip(msg.job_id, MAX_NAME),
        rank=msg.rank,
        world_size=msg.world_size,
        host=clip(msg.host, MAX_NAME),
        pid=msg.pid,
        local_rank=msg.local_rank,
        start_time=msg.start_time,
        session=clip(msg.session, MAX_NAME),
        backend=clip(msg.backend, MAX_NAME),
        torch_version=clip(msg.torch_version, MAX_NAME),
        hook_version=clip(msg.hook_version, MAX_NAME),
        pid_namespace=clip(msg.pid_namespace, MAX_NAME),
        launch=clip(msg.launch, MAX_NAME),
        attempt=msg.attempt,
        phase=clip(msg.phase, MAX_NAME),
    )


def process_status_from_pb(msg: pb.ProcStatus) -> r.ProcessStatus:
    try:
        state = r.ProcState(msg.state)
    except ValueError:
        state = r.ProcState.UNKNOWN
    return r.ProcessStatus(
        pid=msg.pid,
        state=state,
        time=msg.time,
        start_time=msg.start_time,
        cpu_percent=msg.cpu_percent,
        rss_bytes=msg.rss_bytes,
        num_threads=msg.num_threads,
        exit_code=msg.exit_code if msg.HasField("exit_code") else None,
        signal=msg.signal if msg.HasField("signal") else None,
        oom_killed=msg.oom_killed,
        gpus=tuple(
            r.GpuStatus(
                g.index,
                g.uuid[:128],
                g.name[:128],
                g.utilization,
                g.memory_used,
                g.memory_total,
                g.process_memory,
                g.ecc_uncorrected,
                g.xid,
                g.xid_time if math.isfinite(g.xid_time) else 0.0,
            )
            for g in msg.gpus[:MAX_GPUS]
        ),
    )


def stack_dump_from_pb(msg: pb.StackDumpMsg) -> r.StackDump:
    threads = tuple(
        r.ThreadStack(
            thread_id=t.thread_id,
            name=t.name,
            frames=tuple(r.Frame(f.function, f.filename, f.line, f.native) for f in t.frames),
            active=t.active,
            owns_gil=t.owns_gil,
        )
        for t in msg.threads
    )
    children = tuple(stack_dump_from_pb(c) for c in msg.children[:MAX_CHILDREN] if not c.children)
    return r.StackDump(msg.pid, msg.time, threads, msg.text, msg.native, msg.error or None, children)
