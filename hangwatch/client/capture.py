"""Wrapping ``torch.distributed``: idempotent ``instrument()`` / ``uninstrument()``.

Every public collective and p2p function is replaced, in both ``torch.distributed`` and
``torch.distributed.distributed_c10d``, by a wrapper that records enter and exit around the
original. Nested calls (an object collective calling ``all_gather`` inside) are recorded once,
at the outermost level. Any failure inside the hook disables the hook and is logged once; the
user's call always runs, and its own exceptions pass through untouched.
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

from hangwatch import catalogue, config
from hangwatch.client.ops import OPS, OpSpec
from hangwatch.client.recorder import _ENTER, _EXIT, _MASK, _now
from hangwatch.ring import HEADER_SIZE, SLOT_SIZE

log = logging.getLogger("hangwatch.client")

_native: ModuleType | None
try:  # the fast path in C, where it was built at install (``_fastpath.c``); Python otherwise
    from hangwatch.client import _fastpath as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

#: The longest a call with a new signature waits for its record to reach the coordinator.
NOVEL_FLUSH_TIMEOUT_S = 0.5

_tls = threading.local()
_originals: dict[str, Callable[..., Any]] = {}
_active: Any = None  # the Session that receives records, or None


_natives: list[Any] = []  # the C wrappers made: each holds the session it last served


def _nothing() -> None:
    return None


#: A thread enters and leaves a call the Python wrapper records (``_tls.depth`` set): the C fast
#: path reads ``depth``, a threading.local lookup that was a tenth of its cost, only while some
#: thread is inside one.
_general_entered: Callable[[], None] = _native.general_entered if _native is not None else _nothing
_general_left: Callable[[], None] = _native.general_left if _native is not None else _nothing


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
    positions: Any = None  # the fast path's: its session's ring, bound on first use
    pack: Any = None
    mm: Any = None
    capacity = 1

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal positions, pack, mm, capacity
        session = _active
        depth: int = getattr(_tls, "depth", 0)
        if session is None or depth:
            return original(*args, **kwargs)
        frame: FrameType | None = None
        if k is not None and len(args) >= k:
            # The fast path. A call site that makes the same call again (same other arguments,
            # tensors of the same shapes, dtypes and devices, same group) is recorded from what
            # was remembered of it (``Recorder.remember``), without reading its arguments again:
            # the same two slots ``Recorder.enter`` and ``exit`` write. Every operation here is
            # paid cold, right after the previous collective (measured 4-10x its cost in a warm
            # loop, BENCHMARKS.md "The whole bill"), so it does as few as it can: no thread-local
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
                        positions, pack, mm, capacity = sink.positions, sink.pack, sink.mm, sink.capacity
                    seq = memo[9]() - recorder.groups.p2p_ops.get(memo[5], 0) + 1
                    call_id = next(recorder._ids)
                    h = next(positions)
                    pack(mm, HEADER_SIZE + (h % capacity) * SLOT_SIZE, h + 1, _ENTER, False, 0, memo[6],
                         call_id & _MASK, seq & _MASK, recorder.step & _MASK, 0, _now(), h + 1)  # fmt: skip
                else:
                    memo = None
            except Exception:  # never into the user's code: the general path copes, or fails once
                memo = None
            if memo is not None:
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    try:
                        raw = (call_id, spec, memo[5], seq, None, None, None, None, None, False)
                        session.recorder.exit(raw, memo[4], memo[4]._get_sequence_number_for_group() - 1, exc)
                    except Exception as inner:
                        session.fail("recording a call's exit", inner)
                    raise
                try:
                    h = next(positions)
                    pack(mm, HEADER_SIZE + (h % capacity) * SLOT_SIZE, h + 1, _EXIT, 0, 1, 0,
                         call_id & _MASK, 0, 0, 0, _now(), h + 1)  # fmt: skip
                except Exception as exc:
                    session.fail("recording a call's exit", exc)
                return result
        try:
            params = dict(zip(names, args, strict=False))
            if kwargs:
                params.update(kwargs)
            recorder = session.recorder
            entered = recorder.enter(spec, params)
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
        except Exception as exc:
            session.fail("recording a call", exc)
            return original(*args, **kwargs)
        _tls.depth = 1
        _general_entered()
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            _tls.depth = 0
            _general_left()
            try:
                session.recorder.exit(*entered, exc)
            except Exception as inner:
                session.fail("recording a call's exit", inner)
            raise
        _tls.depth = 0
        _general_left()
        try:
            session.recorder.exit(*entered, None, result)
        except Exception as exc:
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


def _fast_error(session: Any, spec: OpSpec, memo: Any, call_id: int, seq: int, exc: BaseException) -> None:
    """The C fast path's call raised: its exit recorded with the error, as the Python fast path does."""
    try:
        raw = (call_id, spec, memo[5], seq, None, None, None, None, None, False)
        session.recorder.exit(raw, memo[4], memo[4]._get_sequence_number_for_group() - 1, exc)
    except Exception as inner:
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
                log.debug("hangwatch: destroy hook failed: %s", exc)
        result = original(*args, **kwargs)
        try:
            if name == "init_process_group":
                session_mod.after_init(params)
            elif name == "new_group":
                session_mod.after_new_group(result, params)
            elif name == "destroy_process_group":
                session_mod.after_destroy(before)
        except Exception as exc:  # never into user code
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
