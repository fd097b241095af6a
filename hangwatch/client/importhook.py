"""Run a callback right after a module is first imported (a post-import hook).

A meta-path finder that, for the watched name only, finds the real spec through the other
finders and wraps its loader so the callback runs once the module has executed.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

# Deliberately no importlib.abc and no logging here: this module is imported at interpreter start
# in every process that has HANGWATCH_ADDR set, and those two cost tens of milliseconds.

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}


def _run(name: str, module: ModuleType) -> None:
    for callback in _callbacks.pop(name, []):
        try:
            callback(module)
        except Exception as exc:
            import logging

            logging.getLogger("hangwatch.client").warning("hangwatch: hook for %s failed: %s", name, exc)


class _Loader:
    def __init__(self, name: str, inner: Any) -> None:
        self.name = name
        self.inner = inner

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        result: ModuleType | None = self.inner.create_module(spec)
        return result

    def exec_module(self, module: ModuleType) -> None:
        # Give the module its real loader back before running it.
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        module.__loader__ = self.inner
        self.inner.exec_module(module)
        _run(self.name, module)


class _Finder:
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(fullname, spec.loader)  # type: ignore[assignment]  # duck-typed
                return spec
        return None


_finder = _Finder()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
