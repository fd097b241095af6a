"""Turns a ``torch.distributed`` call into records, on the calling thread, in a few microseconds.

Only cheap work happens here: reading shapes and dtypes, the process group's own sequence
number, and the caller's frame (cached per code location). Records go into a bounded deque
that the sender thread drains; when it is full the record is dropped and counted, never waited
for. Serialisation and the network live in ``sender``.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

from hangwatch import records as r
from hangwatch.client.ops import OpSpec

_now = time.time

#: How many distinct call signatures a rank flushes before issuing (see :meth:`Recorder.is_novel`).
MAX_NOVEL_SIGNATURES = 256

#: Frames from these paths are library code: the call site is the first frame outside them.
_LIBRARY_MARKERS = (
    os.sep + "torch" + os.sep,
    os.sep + "hangwatch" + os.sep + "client" + os.sep,
    os.sep + "accelerate" + os.sep,
    os.sep + "contextlib.py",
    os.sep + "functools.py",
    os.sep + "typing_extensions.py",  # torch's @deprecated wrappers (all_reduce_coalesced, ...)
)


def _is_library(filename: str) -> bool:
    return any(marker in filename for marker in _LIBRARY_MARKERS)


class EventQueue:
    """A bounded, lock-free (deque-based) queue that drops and counts instead of blocking."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: collections.deque[r.RankEvent] = collections.deque()
        self.dropped = 0

    def put(self, event: r.RankEvent) -> None:
        if len(self.items) >= self.capacity:
            self.dropped += 1
            return
        self.items.append(event)

    def drain(self, limit: int) -> list[r.RankEvent]:
        out: list[r.RankEvent] = []
        pop = self.items.popleft
        try:
            for _ in range(limit):
                out.append(pop())
        except IndexError:
            pass
        return out

    def __len__(self) -> int:
        return len(self.items)


class GroupTable:
    """What the hook knows about each process group: name, members, creation order."""

    def __init__(self) -> None:
        self.by_id: dict[int, r.GroupInfo] = {}
        self.by_name: dict[str, r.GroupInfo] = {}
        self.p2p_ops: dict[str, int] = {}  # group -> p2p ops issued (not counted as collectives)
        self._next_index = 0

    def info(self, pg: Any, c10d: Any) -> r.GroupInfo | None:
        """The cached info of ``pg``, or None if it has not been seen (call ``learn``)."""
        return self.by_id.get(id(pg))

    def learn(self, pg: Any, c10d: Any) -> tuple[r.GroupInfo, bool]:
        """Info for ``pg``, computing and caching it when new; the flag says it was new."""
        known = self.by_id.get(id(pg))
        if known is not None:
            return known, False
        try:
            name = str(pg.group_name)
        except Exception:
            name = str(id(pg))
        try:
            members = tuple(sorted(c10d._world.pg_group_ranks[pg].keys()))
        except Exception:
            members = ()
        try:
            backend = str(c10d.get_backend(pg))
        except Exception:
            backend = ""
        try:
            desc = str(getattr(pg, "group_desc", "") or "")
        except Exception:
            desc = ""
        info = r.GroupInfo(name=name, ranks=members, backend=backend, index=self._next_index, desc=desc)
        self._next_index += 1
        self.by_id[id(pg)] = info
        self.by_name[name] = info
        return info, True

    def forget(self, pg: Any) -> r.GroupInfo | None:
        info = self.by_id.pop(id(pg), None)
        if info is not None:
            self.by_name.pop(info.name, None)
        return info


class Recorder:
    """Per-process recording state shared by every wrapped call."""

    def __init__(self, rank: int, queue: EventQueue, c10d: Any) -> None:
        self.rank = rank
        self.queue = queue
        self.c10d = c10d
        self.groups = GroupTable()
        self.step = 0
        self._ids = itertools.count(1)
        self._pairs: dict[tuple[str, int, int], int] = {}
        self._sites: dict[tuple[CodeType, int], str] = {}
        # collective seqs covered by Python calls, so Flight Recorder does not report them twice
        self.python_seqs: dict[str, collections.deque[tuple[int, int]]] = {}
        self.in_progress: dict[str, int] = {}  # group -> first seq of the Python call under way
        # async works not yet complete: appended by the caller, polled by the sender thread
        self.pending: collections.deque[tuple[r.CallRecord, list[Any]]] = collections.deque()
        self.lock = threading.Lock()  # only for rare paths (groups); never held by the hot path
        self._signatures: set[tuple[Any, ...]] = set()
        self.flush_novel = True  # turned off when such a flush times out

    # ---- helpers ------------------------------------------------------------------------

    def call_site(self, depth: int = 2) -> str:
        """``file:line in function`` of the first frame outside torch/hangwatch, cached."""
        return self.call_site_of(sys._getframe(depth))

    def call_site_of(self, frame: FrameType | None) -> str:
        for _ in range(12):
            if frame is None:
                break
            code = frame.f_code
            key = (code, frame.f_lineno)
            site = self._sites.get(key)
            if site is not None:
                return site
            if not _is_library(code.co_filename):
                site = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
                if len(self._sites) < 65536:
                    self._sites[key] = site
                return site
            frame = frame.f_back
        return ""

    def user_frame_of(self, tb: Any) -> str:
        """The innermost user frame of a traceback (for exceptions)."""
        site = ""
        while tb is not None:
            code = tb.tb_frame.f_code
            if not _is_library(code.co_filename):
                site = f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
            tb = tb.tb_next
        return site

    def resolve_group(self, group: Any) -> Any:
        return group if group is not None else self.c10d._get_default_group()

    def group_info(self, pg: Any) -> r.GroupInfo:
        info = self.groups.by_id.get(id(pg))
        if info is None:
            with self.lock:
                info, new = self.groups.learn(pg, self.c10d)
            if new:
                self.queue.put(r.GroupEvent(self.rank, r.GroupEventKind.CREATED, info, _now()))
        return info

    # ---- the hot path --------------------------------------------------------------------

    def enter(self, spec: OpSpec, params: dict[str, Any]) -> tuple[r.CallRecord, Any, int]:
        """Record a call about to be issued. Returns the record, its group and the op count."""
        pg = self.resolve_group(params.get("group"))
        info = self.group_info(pg)
        ops_before = pg._get_sequence_number_for_group()
        root = peer = None
        if spec.p2p:
            peer = self._peer(spec, params, pg)
            if spec.name in r.SEND_OPS:
                pair = (info.name, self.rank, peer if peer is not None else -1)
            else:
                pair = (info.name, peer if peer is not None else -1, self.rank)
            seq = self._pairs.get(pair, 0) + 1
            self._pairs[pair] = seq
        else:
            seq = ops_before - self.groups.p2p_ops.get(info.name, 0) + 1
            self.in_progress[info.name] = seq
            if spec.root is not None:
                root = self._root(spec, params, pg)
        reduce_op = None
        if spec.reduce is not None:
            red = params.get(spec.reduce)
            reduce_op = "sum" if red is None else _reduce_name(red)
        extra: dict[str, str] = {}
        if spec.splits:
            for key in ("input_split_sizes", "output_split_sizes"):
                sizes = params.get(key)
                if sizes:
                    extra[key] = ",".join(str(int(s)) for s in sizes)
        if spec.name == "batch_isend_irecv":
            extra["p2p_ops"] = _batch_ops(params.get("p2p_op_list"))
        if spec.name == "all_to_all" or spec.splits:
            try:
                extra["group_rank"] = str(self.c10d.get_group_rank(pg, self.rank))
            except Exception:
                pass
        record = r.CallRecord(
            rank=self.rank,
            call_id=next(self._ids),
            op=spec.name,
            group=info.name,
            seq=seq,
            inputs=_metas(spec, spec.inputs, params),
            outputs=_metas(spec, spec.outputs, params),
            reduce_op=reduce_op,
            root=root,
            peer=peer,
            async_op=bool(params.get("async_op", False)) or spec.name in ("isend", "irecv"),
            step=self.step,
            call_site=self.call_site(3),
            enter_time=_now(),
            extra=extra,
        )
        self.queue.put(record)
        return record, pg, ops_before

    def is_novel(self, record: r.CallRecord) -> bool:
        """True the first time this rank makes a call with this signature (op, group, root, reduce
        op, shapes and dtypes), for the first :data:`MAX_NOVEL_SIGNATURES` signatures. Such a call
        is flushed to the coordinator before the backend sees it: a mismatched call is nearly
        always a new signature, and gloo may kill the process inside it (10 vs 20 floats, float32
        vs float64) before the sender thread's next batch. Steady loops repeat signatures and pay
        nothing."""
        if not self.flush_novel or len(self._signatures) >= MAX_NOVEL_SIGNATURES:
            return False
        sig = (
            record.op,
            record.group,
            record.root,
            record.peer,
            record.reduce_op,
            tuple((m.shape, m.dtype) for m in record.inputs),
            tuple((m.shape, m.dtype) for m in record.outputs),
        )
        if sig in self._signatures:
            return False
        self._signatures.add(sig)
        return True

    def exit(
        self, record: r.CallRecord, pg: Any, ops_before: int, error: BaseException | None, result: Any = None
    ) -> None:
        """Record the return of a call (for async calls: its issue; completion comes later)."""
        try:
            issued = pg._get_sequence_number_for_group() - ops_before
        except Exception:
            issued = 1
        if issued < 1:
            issued = 1
        if record.kind is r.OpKind.P2P:
            self.groups.p2p_ops[record.group] = self.groups.p2p_ops.get(record.group, 0) + issued
        else:
            self.in_progress.pop(record.group, None)
            seqs = self.python_seqs.get(record.group)
            if seqs is None:
                seqs = self.python_seqs[record.group] = collections.deque(maxlen=4096)
            seqs.append((record.seq, record.seq + issued - 1))
        err = None if error is None else f"{type(error).__name__}: {error}"
        if record.async_op and error is None and result is not None:
            # The work object completes later; the sender polls it and records completion.
            record.seq_count = issued
            works = result if isinstance(result, list) else [result]
            self.pending.append((record, [w for w in works if w is not None]))
            return
        self.queue.put(r.CallExit(self.rank, record.call_id, _now(), err, issued))

    def poll_pending(self) -> None:
        """Record completion of async works that finished (called from the sender thread)."""
        if not self.pending:
            return
        for _ in range(len(self.pending)):
            record, works = self.pending.popleft()
            try:
                done = all(w.is_completed() for w in works)
            except Exception:
                done = True
            if done:
                self.queue.put(r.CallExit(self.rank, record.call_id, _now(), None, record.seq_count))
            else:
                self.pending.append((record, works))

    # ---- argument helpers ----------------------------------------------------------------

    def _root(self, spec: OpSpec, params: dict[str, Any], pg: Any) -> int | None:
        value = params.get(spec.root) if spec.root else None
        if value is not None:
            return int(value)
        local = params.get(spec.group_root) if spec.group_root else None
        if local is not None:
            try:
                return int(self.c10d.get_global_rank(pg, int(local)))
            except Exception:
                return int(local)
        return 0 if spec.root in ("src", "dst") else None

    def _peer(self, spec: OpSpec, params: dict[str, Any], pg: Any) -> int | None:
        value = params.get(spec.peer) if spec.peer else None
        if value is not None:
            return int(value)
        local = params.get(spec.group_peer) if spec.group_peer else None
        if local is not None:
            try:
                return int(self.c10d.get_global_rank(pg, int(local)))
            except Exception:
                return int(local)
        return None


def _batch_ops(ops: Any) -> str:
    """``isend:1,irecv:1``: each P2POp of a batch and its peer (global rank)."""
    out: list[str] = []
    for op in ops or ():
        name = getattr(getattr(op, "op", None), "__name__", "?")
        out.append(f"{name}:{getattr(op, 'peer', '?')}")
    return ",".join(out)


def _reduce_name(red: Any) -> str:
    name = getattr(red, "name", None)
    if isinstance(name, str):
        return name.lower()
    text = str(red)
    return text.rsplit(".", 1)[-1].lower()


def _meta(t: Any) -> r.TensorMeta:
    try:
        dtype = str(t.dtype)
        if dtype.startswith("torch."):
            dtype = dtype[6:]
        return r.TensorMeta(tuple(t.shape), dtype, t.device.type)
    except Exception:
        return r.TensorMeta((), type(t).__name__, "")


def _metas(spec: OpSpec, names: tuple[str, ...], params: dict[str, Any]) -> tuple[r.TensorMeta, ...]:
    out: list[r.TensorMeta] = []
    for name in names:
        value = params.get(name)
        if value is None:
            continue
        if spec.objects:
            if isinstance(value, (list, tuple)):
                out.append(r.TensorMeta((len(value),), "object", ""))
            else:
                out.append(r.TensorMeta((), "object", ""))
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, (list, tuple)):
                    out.extend(_meta(x) for x in item)
                elif hasattr(item, "shape"):
                    out.append(_meta(item))
                elif hasattr(item, "tensor"):  # P2POp
                    out.append(_meta(item.tensor))
        else:
            out.append(_meta(value))
    return tuple(out)
