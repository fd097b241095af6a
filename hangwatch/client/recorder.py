"""Turns a ``torch.distributed`` call into records, on the calling thread, in a few microseconds.

Only cheap work happens here: reading shapes and dtypes, the process group's own sequence
number, and the caller's frame (cached per code location). The call's fixed part is looked up
in the rank's signature table (stored as a blob the first time it is seen) and the record is
packed into the rank's shared-memory ring (``ringsink``) before the call is issued: it is
outside the process from then on, and no Python object per record is left behind. Shipping lives
elsewhere (the node agent, or ``sender`` where no agent runs).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from hangwatch import records as r
from hangwatch.catalogue import INPUT_SPLITS, OUTPUT_SPLITS, SPLITS_VARY
from hangwatch.client.callargs import (
    batch_ops,
    cook,
    raw_metas,
    reduce_name,
)
from hangwatch.client.callsites import (
    MAX_FRAMES,
    is_installed,
    is_library,
)
from hangwatch.client.ops import OpSpec
from hangwatch.client.ringsink import RingSink
from hangwatch.native import foreign
from hangwatch.ring import Kind

_now = time.time
_SUM = "sum"  # the reduce op when the caller passes none

#: How many distinct call signatures a rank flushes before issuing (see :meth:`Recorder.is_novel`).
MAX_NOVEL_SIGNATURES = 256


class GroupTable:
    """What the hook knows about each process group: name, members, creation order."""

    def __init__(self) -> None:
        self.by_id: dict[int, r.GroupInfo] = {}
        self.by_name: dict[str, r.GroupInfo] = {}
        self.names: dict[int, str] = {}  # id(pg) -> name, for the hot path
        self.p2p_ops: dict[str, int] = {}  # group -> p2p ops issued (not counted as collectives)
        self._next_index = 0

    def learn(self, pg: Any, c10d: Any) -> tuple[r.GroupInfo, bool]:
        """Info for ``pg``, computing and caching it when new; the flag says it was new."""
        known = self.by_id.get(id(pg))
        if known is not None:
            return known, False
        try:
            name = str(pg.group_name)
        except Exception as exc:
            if foreign(exc):  # the program's (a signal handler's): never swallowed
                raise
            name = str(id(pg))
        try:
            members = tuple(sorted(c10d._world.pg_group_ranks[pg].keys()))
        except Exception as exc:
            if foreign(exc):  # the program's (a signal handler's): never swallowed
                raise
            members = ()
        try:
            backend = str(c10d.get_backend(pg))
        except Exception as exc:
            if foreign(exc):  # the program's (a signal handler's): never swallowed
                raise
            backend = ""
        try:
            desc = str(getattr(pg, "group_desc", "") or "")
        except Exception as exc:
            if foreign(exc):  # the program's (a signal handler's): never swallowed
                raise
            desc = ""
        info = r.GroupInfo(name=name, ranks=members, backend=backend, index=self._next_index, desc=desc)
        self._next_index += 1
        self.by_id[id(pg)] = info
        self.by_name[name] = info
        self.names[id(pg)] = name
        return info, True

    def forget(self, pg: Any) -> r.GroupInfo | None:
        self.names.pop(id(pg), None)
        info = self.by_id.pop(id(pg), None)
        if info is not None:
            self.by_name.pop(info.name, None)
        return info


class Recorder:
    """Per-process recording state shared by every wrapped call."""

    def __init__(self, rank: int, sink: RingSink, c10d: Any) -> None:
        self.rank = rank
        self.sink = sink
        self.c10d = c10d
        self.groups = GroupTable()
        self.step = 0
        self._ids = itertools.count(1)
        self._pairs: dict[tuple[str, int, int], int] = {}
        self._sites: dict[tuple[CodeType, int], str] = {}
        # collective seqs covered by Python calls, so Flight Recorder read from inside the rank
        # does not report them twice; kept only while ``covers`` (an agent that reads Flight
        # Recorder from outside learns the same from the ring)
        self.covers = True
        self.python_seqs: dict[str, collections.deque[tuple[int, int]]] = {}
        self.in_progress: dict[str, int] = {}  # group -> first seq of the Python call under way
        # async works not yet complete (call id, collectives issued, works): appended by the
        # caller, polled by the sender thread
        self.pending: collections.deque[tuple[int, int, list[Any]]] = collections.deque()
        #: async works recorded so far, and what wakes the sender thread (set while it sleeps
        #: past its poll interval: an async work's completion is polled for from then on)
        self.async_calls = 0
        self.on_pending: Callable[[], object] | None = None
        self._polling = threading.RLock()  # one poller of ``pending`` at a time
        self.pending_dropped = 0  # async works let go unpolled (``_shed_pending``)
        self._poll_above = MAX_PENDING
        self.default_pg: Any = None  # cached: looking it up costs more than the rest of a record
        self.lock = threading.Lock()  # only for rare paths (groups); never held by the hot path
        self.novel = 0  # signatures first seen so far (a new one is flushed where no agent reads the ring)
        self._last_novel = False
        self.flush_novel = True  # turned off when such a flush times out
        #: call sites seen making the same call again (``remember``): (caller's code, its
        #: instruction) -> (spec, other arguments, keyword arguments, tensors' (shape, dtype,
        #: is_cuda), process group, its name, signature ref, async); see ``capture``'s fast path
        self.memo: dict[int, Memo] = {}
        self.last_ref = 0  # the signature ref of the call ``enter`` recorded last
        #: call site -> the split sizes it passed first, or ``_VARIES`` once they changed there
        self._split_sites: dict[str, tuple[str | None, str | None]] = {}

    # ---- helpers ------------------------------------------------------------------------

    def call_site(self, depth: int = 2) -> str:
        """``file:line in function`` of the first frame of the program's own code, cached."""
        return self.call_site_of(sys._getframe(depth))

    def call_site_of(self, frame: FrameType | None) -> str:
        """The first frame of the program's own code from ``frame`` outwards: not the plumbing
        (torch, the hook), nor installed code (the standard library, a framework's helper: a
        metric synced by Lightning's ``_sync_ddp`` is the user's ``self.log`` line's). Where
        every frame is installed code (a training script installed as a package), the first
        outside the plumbing. Only the program's own frames are cached (``remember`` relies on it)."""
        fallback = ""
        for _ in range(MAX_FRAMES):
            if frame is None:
                break
            code = frame.f_code
            key = (code, frame.f_lineno)
            site = self._sites.get(key)
            if site is not None:
                return site
            filename = code.co_filename
            if not is_library(filename):
                site = f"{os.path.basename(filename)}:{frame.f_lineno} in {code.co_name}"
                if not is_installed(filename):
                    if len(self._sites) < 65536:
                        self._sites[key] = site
                    return site
                fallback = fallback or site
            frame = frame.f_back
        return fallback

    def program_frames(self, frame: FrameType | None, limit: int = 8) -> tuple[str, ...]:
        """The program's own frames from ``frame`` outwards (``call_site_of``'s choice), at most
        ``limit``: whether a rank busy outside any call is still in the function its loop's
        calls came from."""
        out: list[str] = []
        for _ in range(MAX_FRAMES):
            if frame is None or len(out) >= limit:
                break
            code = frame.f_code
            filename = code.co_filename
            if not is_library(filename) and not is_installed(filename):
                out.append(f"{os.path.basename(filename)}:{frame.f_lineno} in {code.co_name}")
            frame = frame.f_back
        return tuple(out)

    def user_frame_of(self, tb: Any) -> str:
        """The innermost frame of the program's own code in a traceback (for exceptions; as
        ``call_site_of`` chooses)."""
        site = fallback = ""
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if not is_library(filename):
                here = f"{os.path.basename(filename)}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
                if is_installed(filename):
                    fallback = here
                else:
                    site = here
            tb = tb.tb_next
        return site or fallback

    def group_info(self, pg: Any) -> r.GroupInfo:
        info = self.groups.by_id.get(id(pg))
        if info is None:
            with self.lock:
                info, new = self.groups.learn(pg, self.c10d)
            if new:
                self.sink.put(r.GroupEvent(self.rank, r.GroupEventKind.CREATED, info, _now()))
        return info

    # ---- the hot path --------------------------------------------------------------------

    def enter(self, spec: OpSpec, params: dict[str, Any], call_id: int | None = None) -> tuple[RawCall, Any, int]:
        """Record a call about to be issued (as ``call_id``, taken from ``next_id`` by a caller that
        must know it whatever interrupts this). Returns the raw record, its group and the op count.

        Only raw values are captured here (``torch.Size``/``torch.dtype`` objects, the code location
        of the caller); they become a :class:`CallRecord` (``materialize``) only the first time
        their signature is seen, to store its fixed part in the ring.
        """
        group = params.get("group")
        pg = group if group is not None else (self.default_pg or self.c10d._get_default_group())
        name = self.groups.names.get(id(pg))
        if name is None:
            name = self.group_info(pg).name
        ops_before = pg._get_sequence_number_for_group()
        root = peer = None
        if spec.p2p:
            peer = self._peer(spec, params, pg)
            if spec.name in r.SEND_OPS:
                pair = (name, self.rank, peer if peer is not None else -1)
            else:
                pair = (name, peer if peer is not None else -1, self.rank)
            seq = self._pairs.get(pair, 0) + 1
            self._pairs[pair] = seq
        else:
            seq = ops_before - self.groups.p2p_ops.get(name, 0) + 1
            if self.covers:
                self.in_progress[name] = seq
            if spec.root is not None:
                root = self._root(spec, params, pg)
        reduce_raw = params.get(spec.reduce, _SUM) if spec.reduce is not None else None
        extra = self._extra(spec, params, pg) if spec.extra else None
        ins = raw_metas(spec, spec.inputs, params) if spec.inputs else ()
        outs = raw_metas(spec, spec.outputs, params) if spec.outputs else ()
        async_op = spec.always_async or bool(params.get("async_op", False))
        site = self.call_site(3)
        if extra and spec.splits:
            extra = self._vary_splits(site, extra)
        if call_id is None:
            call_id = next(self._ids)
        step = self.step
        now = _now()
        raw: RawCall = (call_id, spec, name, seq, ins, outs, reduce_raw, root, peer, async_op, step, site, now, extra)
        sink = self.sink
        key = (spec, name, ins, outs, reduce_raw, root, peer, async_op, site, _frozen(extra) if extra else None)
        ref = sink.signatures.get(key)
        self._last_novel = ref is None
        if ref is None:
            self.novel += 1
            ref = sink.intern(key, self.materialize(raw))
        self.last_ref = ref
        sink.put_slot(sink.mm, sink.positions, sink.capacity, _ENTER, async_op, 0, ref, call_id, seq, step, 0, now)
        return raw, pg, ops_before

    def remember(
        self, frame: FrameType, raw: RawCall, pg: Any, args: tuple[Any, ...], kwargs: dict[str, Any], k: int
    ) -> None:
        """After ``enter`` recorded a call made directly from user code (``frame``) whose only
        tensors are its first ``k`` positional arguments: what the next call from the same
        place must repeat to be recorded without looking at it again (``capture``'s fast path:
        the same other arguments, tensors of the same shapes, dtypes and device, the same
        process group). Cleared whenever a process group is destroyed or made the default."""
        code, lasti = frame.f_code, frame.f_lasti
        if len(self.memo) >= MAX_MEMO or lasti >= MAX_LASTI or (code, frame.f_lineno) not in self._sites:
            # a library's call (``enter``'s call-site walk cached only a user frame): the user's
            # call site above it may differ each time
            return
        tensors = tuple((t.shape, t.dtype, t.is_cuda) for t in args[:k])
        self.memo[memo_key(code, lasti)] = (
            raw[1],
            args[k:],
            dict(kwargs),
            tensors,
            pg,
            raw[2],
            self.last_ref,
            raw[9],
            code,
            pg._get_sequence_number_for_group,
        )

    def is_novel(self, raw: RawCall) -> bool:
        """True when the call ``enter`` just recorded has a signature (op, group, root, reduce op,
        shapes, dtypes, call site) this rank had not made before, for the first
        :data:`MAX_NOVEL_SIGNATURES` of them. Where no agent reads the ring from outside, such a
        call is flushed to the coordinator before the backend sees it: a mismatched call is
        nearly always new on at least one side, and gloo may kill the process inside it before
        the next batch. Steady loops repeat signatures and pay nothing."""
        if not self.flush_novel or not self._last_novel:
            return False
        if self.novel > MAX_NOVEL_SIGNATURES:
            self.flush_novel = False
            return False
        return True

    def exit(self, raw: RawCall, pg: Any, ops_before: int, error: BaseException | None, result: Any = None) -> None:
        """Record the return of a call (for async calls: its issue; completion comes later)."""
        spec = raw[1]
        group = raw[2]
        try:
            issued = pg._get_sequence_number_for_group() - ops_before
        except Exception as exc:
            if foreign(exc):  # the program's (a signal handler's): never swallowed
                raise
            issued = 0 if spec.p2p else 1
        if spec.p2p:
            # what the group's counter moved by: gloo counts each send/recv there, NCCL keeps p2p
            # works on a counter of their own (0 here), and the next collective's seq nets it out
            if issued > 0:
                self.groups.p2p_ops[group] = self.groups.p2p_ops.get(group, 0) + issued
            issued = max(issued, 1)
        else:
            issued = max(issued, 1)
            self.in_progress.pop(group, None)  # always: ``covers`` may have turned off meanwhile
            if self.covers:
                seqs = self.python_seqs.get(group)
                if seqs is None:
                    seqs = self.python_seqs[group] = collections.deque(maxlen=4096)
                seqs.append((raw[3], raw[3] + issued - 1))
        if raw[9] and error is None and result is not None:
            # The work object completes later; the sender polls it and records completion.
            works = result if isinstance(result, list) else [result]
            self.pending.append((raw[0], issued, [w for w in works if w is not None]))
            self.async_calls += 1
            if len(self.pending) > self._poll_above:
                self._shed_pending()
            while len(self.pending) > 2 * MAX_PENDING:  # never complete, or not polled: let go
                self.pending.popleft()
                self.pending_dropped += 1
            wake = self.on_pending  # set while the sender thread sleeps long (after the append)
            if wake is not None:
                wake()
            return
        sink = self.sink
        ref = 0 if error is None else sink.text(f"{type(error).__name__}: {error}")
        sink.put_slot(sink.mm, sink.positions, sink.capacity, _EXIT, 0, issued, ref, raw[0], 0, 0, 0, _now())

    def next_id(self) -> int:
        return next(self._ids)

    def abandon(self, call_id: int, error: BaseException) -> None:
        """The call ``call_id`` was interrupted before or right after it was issued (a signal
        handler's exception, a KeyboardInterrupt), and ``error`` goes on to the program: its exit,
        with that error, so that no call entered stays open. Written also where the interruption
        came before its entry, or after its exit (an exit of no open call is ignored)."""
        ref = self.sink.text(f"{type(error).__name__}: {error}")
        sink = self.sink
        sink.put_slot(sink.mm, sink.positions, sink.capacity, _EXIT, 0, 1, ref, call_id, 0, 0, 0, _now())

    def poll_pending(self) -> None:
        """Record completion of async works that finished (called from the sender thread, and
        from a calling thread where too many wait: ``_shed_pending``)."""
        if not self.pending:
            return
        with self._polling:
            for _ in range(len(self.pending)):
                item = self.pending.popleft()
                call_id, issued, works = item
                try:
                    done = all(w.is_completed() for w in works)
                except Exception as exc:
                    if foreign(exc):  # the program's (a signal handler's): the work polled again
                        self.pending.appendleft(item)
                        raise
                    done = True
                if done:
                    self.sink.put(r.CallExit(self.rank, call_id, _now(), None, issued))
                else:
                    self.pending.append(item)

    def _shed_pending(self) -> None:
        """More async works wait to be polled than ``MAX_PENDING``: the sender thread is gone or
        far behind. Poll them here (unless it is polling now); again once a quarter as many more
        wait. Past twice the bound the oldest are let go (``exit``): their calls stay open where
        they are read, and their tensors are freed."""
        if self._polling.acquire(blocking=False):
            try:
                self.poll_pending()
            finally:
                self._polling.release()
        self._poll_above = max(MAX_PENDING, len(self.pending) + MAX_PENDING // 4)

    def materialize(self, item: RawCall) -> r.CallRecord:
        """Turn a raw call into a typed record (once per signature: its blob is made from it)."""
        call_id, spec, group, seq, ins, outs, reduce_raw, root, peer, async_op, step, site, when, extra = item
        return r.CallRecord(
            rank=self.rank,
            call_id=call_id,
            op=spec.name,
            group=group,
            seq=seq,
            inputs=cook(ins),
            outputs=cook(outs),
            reduce_op=None if reduce_raw is None else reduce_name(reduce_raw),
            root=root,
            peer=peer,
            async_op=async_op,
            step=step,
            call_site=site,
            enter_time=when,
            extra=extra or {},
        )

    def _extra(self, spec: OpSpec, params: dict[str, Any], pg: Any) -> dict[str, str]:
        extra: dict[str, str] = {}
        if spec.splits:
            for key in ("input_split_sizes", "output_split_sizes"):
                sizes = params.get(key)
                if sizes:
                    extra[key] = ",".join(str(int(x)) for x in sizes)
        if spec.name == "batch_isend_irecv":
            extra["p2p_ops"] = batch_ops(params.get("p2p_op_list"))
        if spec.name == "all_to_all" or spec.splits:
            try:
                extra["group_rank"] = str(self.c10d.get_group_rank(pg, self.rank))
            except Exception as exc:
                if foreign(exc):  # the program's (a signal handler's): never swallowed
                    raise
                pass
        return extra

    def _vary_splits(self, site: str, extra: dict[str, str]) -> dict[str, str]:
        """``all_to_all_single``'s split sizes stay in its signature while its call site repeats
        them; once they change there, that site's calls say they vary instead of what they are:
        sizes that change at every call (an MoE layer's) would make every call a signature of its
        own, filling the signature table (calls then go unnamed) and the blob area."""
        sizes = (extra.get(INPUT_SPLITS), extra.get(OUTPUT_SPLITS))
        if sizes == (None, None):
            return extra
        seen = self._split_sites.get(site)
        if seen is None:
            if len(self._split_sites) < MAX_MEMO:
                self._split_sites[site] = sizes
            return extra
        if seen != sizes:
            self._split_sites[site] = seen = _VARIES
        if seen is not _VARIES:
            return extra
        return {key: SPLITS_VARY if key in (INPUT_SPLITS, OUTPUT_SPLITS) else value for key, value in extra.items()}

    # ---- argument helpers ----------------------------------------------------------------

    def _root(self, spec: OpSpec, params: dict[str, Any], pg: Any) -> int | None:
        value = params.get(spec.root) if spec.root else None
        if value is not None:
            return int(value)
        local = params.get(spec.group_root) if spec.group_root else None
        if local is not None:
            try:
                return int(self.c10d.get_global_rank(pg, int(local)))
            except Exception as exc:
                if foreign(exc):  # the program's (a signal handler's): never swallowed
                    raise
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
            except Exception as exc:
                if foreign(exc):  # the program's (a signal handler's): never swallowed
                    raise
                return int(local)
        return None


_MASK = 0xFFFFFFFF
_ENTER, _EXIT = Kind.ENTER, Kind.EXIT  # module constants: no class lookup per call


def _frozen(extra: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(extra.items()))


_VARIES: tuple[str | None, str | None] = (SPLITS_VARY, SPLITS_VARY)

#: Async works waiting for the sender thread to poll them, beyond which the calling thread polls
#: them itself (the sender thread may be gone) and, past twice as many, lets the oldest go.
MAX_PENDING = 1024

#: Call sites remembered for the fast path, at most.
MAX_MEMO = 4096
#: A remembered call site (see ``Recorder.remember``).
#: What ``remember`` keeps of a call site: (spec, other arguments, keyword arguments, tensors'
#: (shape, dtype, is_cuda), process group, its name, signature ref, async, the caller's code object
#: (its key holds only its id: the memo keeps it alive and checks it), the group's seq counter).
Memo = tuple[
    Any, tuple[Any, ...], dict[str, Any], tuple[tuple[Any, Any, bool], ...], Any, str, int, bool, CodeType, Any
]
#: Instruction offsets a memo key holds (a call site further into its function is not remembered).
MAX_LASTI = 1 << 16


def memo_key(code: CodeType, lasti: int) -> int:
    """A call site's memo key: the code object's id and the call's instruction offset in one int
    (a tuple holding the code object hashes the whole code object on every lookup: measured
    about a tenth of the C fast path's warm cost). ``_fastpath.c`` computes the same."""
    return id(code) << 16 | lasti


#: A raw call as the hot path records it: (call_id, spec, group, seq, inputs, outputs, reduce op,
#: root, peer, async, step, call site, enter time, extra). See ``Recorder.materialize``.
RawCall = tuple[Any, ...]
