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
import threading
from collections.abc import Callable
from typing import Any

from hangwatch.client.ops import OPS, OpSpec

log = logging.getLogger("hangwatch.client")

#: The longest a call with a new signature waits for its record to reach the coordinator.
NOVEL_FLUSH_TIMEOUT_S = 0.5

_tls = threading.local()
_originals: dict[str, Callable[..., Any]] = {}
_active: Any = None  # the Session that receives records, or None


def set_session(session: Any) -> None:
    global _active
    _active = session


def active_session() -> Any:
    return _active


def _param_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _wrap_op(spec: OpSpec, original: Callable[..., Any]) -> Callable[..., Any]:
    names = _param_names(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        session = _active
        depth: int = getattr(_tls, "depth", 0)
        if session is None or depth:
            return original(*args, **kwargs)
        try:
            params = dict(zip(names, args, strict=False))
            if kwargs:
                params.update(kwargs)
            recorder = session.recorder
            entered = recorder.enter(spec, params)
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
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            _tls.depth = 0
            try:
                session.recorder.exit(*entered, exc)
            except Exception as inner:
                session.fail("recording a call's exit", inner)
            raise
        _tls.depth = 0
        try:
            session.recorder.exit(*entered, None, result)
        except Exception as exc:
            session.fail("recording a call's exit", exc)
        return result

    wrapper.__hangwatch_original__ = original  # type: ignore[attr-defined]
    return wrapper


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


def is_instrumented() -> bool:
    return bool(_originals)
