"""Records and a simulated job for tests and benchmarks: one set of builders, one simulator.

Builders (defaults: rank 0's all_reduce of four float32 on the world group "0", entered at T0):

    call(rank, seq=1, op="all_reduce", *, enter_time=T0, group="0", shape=(4,), dtype=F32, ...)
    call_exit(rank, call_id, t, error=None)
    group_event(rank, name, members, t=T0, kind=CREATED)
    identity(rank, world, *, session=None, ...)

``SimJob(n)`` registers ``n`` ranks into a real ``JobState`` and drives it the way the daemon
does: ``deliver`` hands a batch to ``JobState.ingest`` (the daemon's one entry point), ``tick``
runs the real ``Engine``; ``apply``/``call``/``exit``/``end`` apply single events at the time
they name (no batch header: no heartbeat), and ``beat`` is an empty batch (a heartbeat). The
flood of ``tests/diagnosis/test_bounded_memory.py`` (and ``bench/soak_memory.py``) is a
workload on top of it; the detector tests use it with an explicit clock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from hangwatch import records as r
from hangwatch.diagnosis.detectors import Context, new_cache
from hangwatch.diagnosis.engine import Engine
from hangwatch.diagnosis.incidents import Finding, Incident
from hangwatch.diagnosis.state import IngestResult, JobState, RankState

T0 = 1_000.0
F32 = "float32"
F64 = "float64"
SITE = "train.py:42 in step"

_ids = itertools.count(1)


def identity(
    rank: int,
    world: int,
    *,
    session: str | None = None,
    job_id: str = "job",
    host: str | None = None,
    pid: int | None = None,
    start_time: float = 0.0,
    local_rank: int = -1,
    backend: str = "",
    launch: str = "",
    attempt: int = 0,
) -> r.RankIdentity:
    return r.RankIdentity(
        job_id=job_id,
        rank=rank,
        world_size=world,
        host=host if host is not None else f"node{rank // 8}",
        pid=pid if pid is not None else 4000 + rank,
        local_rank=local_rank,
        start_time=start_time,
        session=session if session is not None else f"session-{rank}",
        backend=backend,
        launch=launch,
        attempt=attempt,
    )


def call(
    rank: int = 0,
    seq: int = 1,
    op: str = "all_reduce",
    *,
    enter_time: float = T0,
    call_id: int | None = None,
    group: str = "0",
    shape: tuple[int, ...] | None = (4,),
    dtype: str = F32,
    inputs: tuple[r.TensorMeta, ...] | None = None,
    exit_time: float | None = None,
    **fields: Any,
) -> r.CallRecord:
    """A call; ``inputs`` overrides ``shape``/``dtype`` (``shape=None``: no tensors), ``fields``
    are any other ``CallRecord`` fields (``reduce_op``, ``peer``, ``root``, ``step``, ...).
    Call ids are unique across the process unless given."""
    if inputs is None:
        inputs = (r.TensorMeta(shape, dtype),) if shape is not None else ()
    fields.setdefault("call_site", SITE)
    return r.CallRecord(
        rank=rank,
        call_id=call_id if call_id is not None else next(_ids),
        op=op,
        group=group,
        seq=seq,
        inputs=inputs,
        enter_time=enter_time,
        exit_time=exit_time,
        **fields,
    )


def call_exit(rank: int, call_id: int, t: float, error: str | None = None) -> r.CallExit:
    return r.CallExit(rank, call_id, t, error)


def group_event(
    rank: int,
    name: str,
    members: tuple[int, ...],
    t: float = T0,
    kind: r.GroupEventKind = r.GroupEventKind.CREATED,
    *,
    backend: str = "gloo",
    index: int = 0,
) -> r.GroupEvent:
    return r.GroupEvent(rank, kind, r.GroupInfo(name, members, backend, index), t)


class SimJob:
    """A job of ``n`` ranks registered at ``registered`` (coordinator time) into a real
    ``JobState`` (``register_all=False``: none yet), with the real ``Engine`` (``tick_engine``,
    the one ``tick`` runs; ``engine()`` builds more, each with its own caches)."""

    def __init__(
        self,
        n: int,
        *,
        registered: float = T0,
        job_id: str = "job",
        start_time: float = 500.0,
        register_all: bool = True,
    ) -> None:
        self.job = JobState()
        self.world = n
        self.job_id = job_id
        self.ids = itertools.count(1)
        self.states: dict[int, RankState] = {}
        self.sessions_made = 0
        self.cache = new_cache()  # what an engine would keep for direct detector calls (ctx)
        self.tick_engine = Engine(self.job, threading.RLock(), request_stacks=None)
        for rk in range(n if register_all else 0):
            self.register(rk, registered, identity(rk, n, job_id=job_id, start_time=start_time + rk))

    # ---- ranks and batches ------------------------------------------------------------------

    def register(self, rank: int, now: float, ident: r.RankIdentity | None = None, via: str = "agent") -> RankState:
        """(Re-)register ``rank``: a new session unless ``ident`` names one; registered by its node
        agent (``via="agent"``, a proven rank, as on a node with an agent) unless ``via`` says not."""
        self.sessions_made += 1
        if ident is None:
            ident = identity(rank, self.world, job_id=self.job_id, session=f"session-{rank}-{self.sessions_made}")
        state = self.states[rank] = self.job.register(ident, now, via)
        return state

    def deliver(
        self, rank: int, events: Sequence[r.RankEvent], now: float, *, sent_time: float = 0.0, **header: Any
    ) -> IngestResult:
        """One batch of ``rank`` arriving at ``now``, through ``JobState.ingest`` as the daemon
        applies it (``header``: ``held_s``, ``relay``, ``queued``, ``where``, ``where_user``...)."""
        st = self.states[rank]
        result = self.job.ingest(st.identity.session, rank, events, now=now, sent_time=sent_time, **header)
        assert result is not None, f"rank {rank}'s session is not registered"
        return result

    def beat(self, t: float, ranks: list[int] | None = None, where_user: str | None = None) -> None:
        """Heartbeats sent and received at ``t``: an empty batch each (the rank still reports the
        frame it reported last unless ``where_user`` says another)."""
        for rk in ranks if ranks is not None else list(self.states):
            st = self.states[rk]
            where = st.where_user if where_user is None else where_user
            self.deliver(rk, [], t, sent_time=t, where=st.where, where_user=where)

    # ---- single events at the time they name --------------------------------------------------

    def apply(self, event: r.RankEvent, t: float) -> None:
        self.job.apply(self.states[event.rank], event, t)

    def call(self, rank: int, t: float, op: str = "all_reduce", seq: int = 1, **kw: Any) -> r.CallRecord:
        """``factories.call`` with this job's call ids, applied at ``t``. ``site=`` is ``call_site``."""
        if "site" in kw:
            kw["call_site"] = kw.pop("site")
        kw.setdefault("call_id", next(self.ids))
        record = call(rank, seq, op, enter_time=t, **kw)
        self.apply(record, t)
        return record

    def exit(self, record: r.CallRecord, t: float, error: str | None = None) -> None:
        self.apply(call_exit(record.rank, record.call_id, t, error), t)

    def collective(self, seq: int, t: float, ranks: list[int] | None = None, duration: float = 0.1) -> None:
        """A collective every listed rank enters at ``t`` and leaves ``duration`` later."""
        for rk in ranks if ranks is not None else list(self.states):
            self.exit(self.call(rk, t, seq=seq), t + duration)

    def progress(
        self,
        rank: int,
        t: float,
        *,
        enqueued: int,
        completed: int,
        started: int = -1,
        group: str = "0",
        completed_time: float = 0.0,
        timeout_ms: int = 0,
    ) -> None:
        """What the node agent read of ``rank``'s NCCL ring at ``t``: where ``group`` stands on the GPU."""
        self.apply(r.GroupProgress(rank, group, enqueued, started, completed, t, completed_time, timeout_ms), t)

    def end(self, rank: int, kind: r.EndKind, t: float, detail: str = "", site: str = "") -> None:
        self.apply(r.RankEnd(rank, kind, t, detail=detail, call_site=site), t)

    def proc(self, rank: int, state: r.ProcState, t: float, **how: Any) -> None:
        """What a node agent says of ``rank``'s process at ``t`` (``how``: ``signal``,
        ``exit_code``, ``oom_killed``: how a gone process ended)."""
        self.states[rank].proc = r.ProcessStatus(pid=self.states[rank].identity.pid, state=state, time=t, **how)

    # ---- detection ------------------------------------------------------------------------------

    def ctx(self, now: float, stuck_after: float = 10.0, silence_after: float = 5.0) -> Context:
        """A tick's context for calling one detector directly: what changed since the last one,
        and this simulator's caches (as an engine would pass them)."""
        return Context(
            now=now,
            stuck_after_s=stuck_after,
            silence_after=silence_after,
            changes=self.job.take_changes(),
            cache=self.cache,
        )

    def engine(self, **kwargs: Any) -> Engine:
        kwargs.setdefault("stuck_after", 10.0)
        return Engine(self.job, threading.RLock(), **kwargs)

    def tick(self, now: float) -> list[Incident]:
        """A tick of ``tick_engine`` (the daemon's detection loop; stacks are not requested)."""
        return self.tick_engine.tick(now)


def only(findings: list[Finding], kind: str | None = None) -> Finding:
    """The one finding (of ``kind``) a detector returned."""
    assert len(findings) == 1, [f.summary for f in findings]
    if kind is not None:
        assert findings[0].kind == kind, findings[0].summary
    return findings[0]


def open_incidents(engine: Engine) -> list[Incident]:
    return [inc for inc in engine.incidents.values() if inc.status == "open"]
