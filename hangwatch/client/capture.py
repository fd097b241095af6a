"""Wrapping ``torch.distributed``: idempotent ``instrument()`` / ``uninstrument()``.

Every public collective and p2p function is replaced, in both ``torch.distributed`` and
``torch.distributed.distributed_c10d``, by a wrapper that records enter and exit around the
original. Nested calls (an object collective calling ``all_gather`` inside) are recorded once,
at the outermost level. Any failure inside the hook disables the hook and is logged once; the
user's call always runs, and its own exceptions pass through untouched. So do the program's
exceptions that arrive while the hook's code runs (what a signal handler raises, a
``KeyboardInterrupt``: ``native.foreign``): they reach the program unchanged, a call whose
entry was written gets its exit (with that error), and capture stays on.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

from hangwatch import catalogue, config, native
from hangwatch.client import joining
from hangwatch.client.ops import OPS, OpSpec
from hangwatch.client.recorder import _ENTER, _EXIT, _now
from hangwatch.native import foreign
from hangwatch.ring import HEADER_SIZE

log = logging.getLogger("hangwatch.client")

#: the fast path in C, where it was built at install (``_fastpath.c``) and may be loaded; Python otherwise
_native: ModuleType | None = native.module()

#: The longest a call with a new signature waits for its record to reach the coordinator.
NOVEL_FLUSH_TIMEOUT_S = 0.5

_tls = threading.local()
_originals: dict[str, Callable[..., Any]] = {}
_active: Any = None  # the Session that receives records, or None


_natives: list[Any] = []  # the C wrappers made: each holds the session it last served


def _enter_python(tls: Any) -> None:
    tls.depth = 1


def _leave_python(tls: Any) -> None:
    tls.depth = 0


#: A thread enters and leaves a call the Python wrapper records (``_tls.depth`` set): the C fast
#: path reads ``depth``, a threading.local lookup that was a tenth of its cost, only while some
#: thread is inside one (counted in C, in the same step as ``depth`` is set: nothing can come
#: between them). Leaving twice is leaving once.
_general_enter: Callable[[Any], None] = _native.general_enter if _native is not None else _enter_python
_general_leave: Callable[[Any], None] = _native.general_leave if _native is not None else _leave_python


def set_session(session: Any) -> None:
    global _active
    _active = session
    for fast in _natives:
        fast.forget()  # the session that ends is not kept alive by a wrapper


def active_session() -> Any:
    return _active


def _param_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def fast_tensors(spec: OpSpec, names: tuple[str, ...]) -> int | None:
    """How many leading positional parameters of ``spec``'s function hold its tensors, where
    the fast path may serve it: a collective of single tensors (no lists, objects, splits or
    p2p), numbered alike on every rank, whose tensor parameters come first. None otherwise."""
    if spec.p2p or spec.objects or spec.extra or spec.splits or spec.always_async or catalogue.uneven_seqs(spec.op):
        return None
    tensors = (*spec.inputs, *spec.outputs)
    k = len(tensors)
    if set(names[:k]) != set(tensors) or any(name.endswith("_list") or name.endswith("s") for name in tensors):
        return None
    return k


def _wrap_op(spec: OpSpec, original: Callable[..., Any]) -> Callable[..., Any]:
    names = _param_names(original)
    k = fast_tensors(spec, names)
    getframe = sys._getframe
    put: Any = None  # the fast path's: its session's ring, bound on first use
    positions: Any = None
    mm: Any = None
    capacity = 1

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal put, positions, mm, capacity
        session = _active
        depth: int = getattr(_tls, "depth", 0)
        if session is None or depth:
            return original(*args, **kwargs)
        frame: FrameType | None = None
        call_id = -1
        if k is not None and len(args) >= k:
            # The fast path. A call site that makes the same call again (same other arguments,
            # tensors of the same shapes, dtypes and devices, same group) is recorded from what
            # was remembered of it (``Recorder.remember``), without reading its arguments again:
            # the same two slots ``Recorder.enter`` and ``exit`` write. Every operation here is
            # paid cold, right after the previous collective (measured 4-10x its cost in a warm
            # loop, docs/benchmarks-history.md, "The whole bill"), so it does as few as it can: no thread-local
            # writes (these ops never call another wrapped function), no second read of the
            # group's counter (each issues exactly one collective).
            try:
                frame = getframe(1)
                recorder = session.recorder
                code = frame.f_code
                memo = recorder.memo.get(id(code) << 16 | frame.f_lasti)  # ``recorder.memo_key``
                if (
                    memo is not None
                    and memo[0] is spec
                    and memo[8] is code
                    and not memo[7]  # async calls: the general path (their work is polled)
                    and not recorder.covers  # Flight Recorder read in the rank: the general path
                    and args[k:] == memo[1]
                    and kwargs == memo[2]
                    and _same_tensors(args, memo[3])
                ):
                    sink = recorder.sink
                    if sink.mm is not mm:
                        put, positions, mm, capacity = sink.put_slot, sink.positions, sink.mm, sink.capacity
                    seq = memo[9]() - recorder.groups.p2p_ops.get(memo[5], 0) + 1
                    call_id = next(recorder._ids)
                    put(mm, positions, capacity, _ENTER, 0, 0, memo[6], call_id, seq, recorder.step, 0, _now())
                else:
                    memo = None
            except BaseException as exc:  # the hook's own error: the general path copes, or fails once
                if foreign(exc):
                    _abandon(session, call_id, exc)
                    raise
                memo = None
            if memo is not None:
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    _fast_error(session, spec, memo, call_id, seq, exc)
                    raise
                try:
                    put(mm, positions, capacity, _EXIT, 0, 1, 0, call_id, 0, 0, 0, _now())
                except BaseException as exc:
                    if foreign(exc):
                        _abandon(session, call_id, exc)
                        raise
                    session.fail("recording a call's exit", exc)
                return result
        try:
            params = dict(zip(names, args, strict=False))
            if kwargs:
                params.update(kwargs)
            recorder = session.recorder
            call_id = recorder.next_id()
            entered = recorder.enter(spec, params, call_id)
            if frame is not None:
                recorder.remember(frame, entered[0], entered[1], args, kwargs, k)
            # Where the rank ships its own records (no agent reads its ring), the backend may kill
            # the process inside a mismatched call before the next batch: ship a new kind of
            # call's record before issuing it. A slow coordinator turns this off rather than slow
            # the job. Linked ranks skip all of it (``flush_novel`` is off).
            if (
                recorder.flush_novel
                and session.sender.registered
                and recorder.is_novel(entered[0])
                and not session.sender.flush(NOVEL_FLUSH_TIMEOUT_S)
            ):
                recorder.flush_novel = False
        except BaseException as exc:
            if foreign(exc):
                _abandon(session, call_id, exc)
                raise
            session.fail("recording a call", exc)
            return original(*args, **kwargs)
        try:
            _general_enter(_tls)
            result = original(*args, **kwargs)
        except BaseException as exc:
            _general_leave(_tls)
            try:
                session.recorder.exit(*entered, exc)
            except Exception as inner:
                if foreign(inner):
                    raise
                session.fail("recording a call's exit", inner)
            raise
        try:
            _general_leave(_tls)
            session.recorder.exit(*entered, None, result)
        except BaseException as exc:
            if foreign(exc):
                _general_leave(_tls)
                _abandon(session, call_id, exc)
                raise
            session.fail("recording a call's exit", exc)
        return result

    wrapper.__hangwatch_original__ = original  # type: ignore[attr-defined]
    if k is None or _native is None or not native_enabled():
        return wrapper
    try:
        fast: Callable[..., Any] = _native.FastOp(
            spec, k, original, wrapper, globals(), _tls, _fast_error, _fast_exit_error, HEADER_SIZE
        )
        for name in functools.WRAPPER_ASSIGNMENTS:
            if hasattr(wrapper, name):
                setattr(fast, name, getattr(wrapper, name))
        fast.__dict__.update(wrapper.__dict__)  # __wrapped__, __hangwatch_original__
        fast.__hangwatch_python__ = wrapper  # type: ignore[attr-defined]
        _natives.append(fast)
    except Exception as exc:  # never: the Python wrapper serves
        log.debug("hangwatch: native fast path unavailable for %s: %s", spec.name, exc)
        return wrapper
    return fast


def native_enabled() -> bool:
    """Whether new wrappers take the C fast path: built, and not turned off by ``HANGWATCH_NATIVE=0``."""
    return _native is not None and config.env_flag(config.ENV_NATIVE, True)


def _abandon(session: Any, call_id: int, exc: BaseException) -> None:
    """The program's ``exc`` came while the hook recorded call ``call_id`` (-1: none numbered
    yet): the call's exit with that error, so that no call entered stays open; ``exc`` then goes
    on to the program."""
    if call_id < 0:
        return
    try:
        session.recorder.abandon(call_id, exc)
    except Exception as inner:
        if foreign(inner):
            raise
        session.fail("recording a call's exit", inner)


def _fast_error(session: Any, spec: OpSpec, memo: Any, call_id: int, seq: int, exc: BaseException) -> None:
    """The fast path's call raised: its exit recorded with the error (both fast paths call it).
    What the program raises meanwhile goes on to it, the call's error as its context."""
    try:
        raw = (call_id, spec, memo[5], seq, None, None, None, None, None, False)
        session.recorder.exit(raw, memo[4], memo[4]._get_sequence_number_for_group() - 1, exc)
    except Exception as inner:
        if foreign(inner):
            raise
        session.fail("recording a call's exit", inner)


def _fast_exit_error(session: Any, exc: BaseException) -> None:
    session.fail("recording a call's exit", exc)


def _same_tensors(args: tuple[Any, ...], metas: Any) -> bool:
    """Whether the leading tensors of ``args`` have the remembered shapes, dtypes and devices."""
    for t, (shape, dtype, cuda) in zip(args, metas, strict=False):
        if t.shape != shape or t.dtype is not dtype or t.is_cuda is not cuda:
            return False
    return True


def _wrap_lifecycle(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    names = _param_names(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from hangwatch.client import session as session_mod

        params = dict(zip(names, args, strict=False))
        params.update(kwargs)
        before = None
        if name == "destroy_process_group":
            try:
                before = session_mod.before_destroy(params.get("group"))
            except Exception as exc:
                if foreign(exc):
                    raise
                log.debug("hangwatch: destroy hook failed: %s", exc)
        if name == "init_process_group":
            joining.entering_init()
        result = original(*args, **kwargs)
        try:
            if name == "init_process_group":
                session_mod.after_init(params)
            elif name == "new_group":
                session_mod.after_new_group(result, params)
            elif name == "destroy_process_group":
                session_mod.after_destroy(before)
        except Exception as exc:  # never into user code: the hook's own
            if foreign(exc):
                raise
            log.warning("hangwatch: %s hook failed, hook disabled for it: %s", name, exc)
        return result

    wrapper.__hangwatch_original__ = original  # type: ignore[attr-defined]
    return wrapper


LIFECYCLE = ("init_process_group", "new_group", "destroy_process_group")


def _modules() -> list[Any]:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    return [dist, c10d]


def instrument() -> bool:
    """Wrap every recorded ``torch.distributed`` function. Idempotent; False if unavailable."""
    if _originals:
        return True
    try:
        modules = _modules()
    except Exception as exc:
        log.debug("hangwatch: torch.distributed unavailable: %s", exc)
        return False
    c10d = modules[1]
    wrapped: dict[str, Callable[..., Any]] = {}
    for spec in OPS:
        original = getattr(c10d, spec.name, None)
        if original is not None:
            _originals[spec.name] = original
            wrapped[spec.name] = _wrap_op(spec, original)
    for name in LIFECYCLE:
        original = getattr(c10d, name, None)
        if original is not None:
            _originals[name] = original
            wrapped[name] = _wrap_lifecycle(name, original)
    for module in modules:
        for name, fn in wrapped.items():
            if getattr(module, name, None) is _originals[name]:
                setattr(module, name, fn)
    return True


def uninstrument() -> None:
    """Restore the original functions. Idempotent."""
    if not _originals:
        return
    try:
        modules = _modules()
    except Exception:
        _originals.clear()
        return
    for module in modules:
        for name, original in _originals.items():
            current = getattr(module, name, None)
            if getattr(current, "__hangwatch_original__", None) is original:
                setattr(module, name, original)
    _originals.clear()
    for fast in _natives:
        fast.forget()
    _natives.clear()


def is_instrumented() -> bool:
    return bool(_originals)
