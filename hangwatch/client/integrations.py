"""Framework integrations: Accelerate's synchronised-stop API and DDP's forward passes recorded
as markers.

DDP: every forward pass whose backward will all-reduce gradients is a ``records.DDP_FORWARD``
marker carrying torch's sequence number on the DDP group at that moment (one getter call and a
queue put per training step, not per collective). The coordinator tells from them a rank that
ran a forward without its backward (a NaN loss skipped) from one that left the loop early.

``Accelerator.set_trigger()`` (a rank wants to stop) and ``check_trigger()`` (every rank asks,
through an all_reduce, whether any did) are what a synchronised early stop looks like; recording
them lets a diagnosis tell a synchronised stop from an unsynchronised one. The patch is applied
when ``accelerate.accelerator`` is imported, and is idempotent.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hangwatch import records as r

_PATCHED = "__hangwatch_patched__"


def _marker(name: str, detail: str) -> None:
    from hangwatch.client import session as session_mod

    current = session_mod.current()
    if current is None:
        return
    rec = current.recorder
    current.sink.put(r.MarkerEvent(rec.rank, name, time.time(), detail, rec.call_site(3), rec.step))


def _wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        try:
            _marker(name, "" if result is None else f"returned {result!r}")
        except Exception:
            pass  # never into user code
        return result

    setattr(wrapper, _PATCHED, method)
    return wrapper


def patch_accelerate(module: ModuleType) -> None:
    cls = getattr(module, "Accelerator", None)
    if cls is None:
        return
    for attr in ("set_trigger", "check_trigger"):
        method = getattr(cls, attr, None)
        if method is not None and not hasattr(method, _PATCHED):
            setattr(cls, attr, _wrap(f"accelerate.{attr}", method))


def patch_ddp(module: ModuleType) -> None:
    """Record DDP's forward passes (``DistributedDataParallel._pre_forward``). Idempotent."""
    cls = getattr(module, "DistributedDataParallel", None)
    method = getattr(cls, "_pre_forward", None)
    if cls is None or method is None or hasattr(method, _PATCHED):
        return

    @functools.wraps(method)
    def pre_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _ddp_forward(self)
        except Exception:
            pass  # never into user code
        return method(self, *args, **kwargs)

    setattr(pre_forward, _PATCHED, method)
    cls._pre_forward = pre_forward


def unpatch_ddp(module: ModuleType) -> None:
    cls = getattr(module, "DistributedDataParallel", None)
    original = getattr(getattr(cls, "_pre_forward", None), _PATCHED, None)
    if cls is not None and original is not None:
        cls._pre_forward = original


def _ddp_forward(ddp: Any) -> None:
    import torch

    from hangwatch.client import session as session_mod

    current = session_mod.current()
    if current is None or not torch.is_grad_enabled() or not getattr(ddp, "require_backward_grad_sync", True):
        return  # evaluation, or accumulation under no_sync(): no all-reduce follows this forward
    rec = current.recorder
    pg = ddp.process_group
    group = rec.groups.names.get(id(pg))
    if group is None:
        return  # a group the hook has not numbered (it learns groups from their first call)
    seq = int(pg._get_sequence_number_for_group())
    current.sink.put(r.MarkerEvent(rec.rank, r.DDP_FORWARD, time.time(), f"{group}:{seq}", rec.call_site(3), rec.step))
