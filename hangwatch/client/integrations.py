"""Framework integrations: Accelerate's synchronised-stop API recorded as markers.

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
