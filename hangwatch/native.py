"""The C extension (``hangwatch/client/_fastpath.c``), where it was built and may be loaded here, and
why not where not; and which exceptions are the program's rather than the hook's own.

One place decides, for every part that uses the extension: the hook's fast path (``capture``),
the ring's writers and readers (``ring``), the agent's gathering (``ringwire``). The ring's
publication protocol goes through the extension wherever it is loaded, ``HANGWATCH_NATIVE=0``
or not: it is the ring's ordering, not a speed-up. A free-threaded interpreter never loads it
(everything in it relies on the GIL, and loading a module that does not say otherwise would turn
the GIL back on for the whole process): the hook says so once in its log and records in Python.

Imports nothing heavy, and never the extension at import time (its package imports ``ring``).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sysconfig
from pathlib import Path
from types import CodeType, ModuleType

from hangwatch import config

log = logging.getLogger("hangwatch.client")

_PACKAGE = Path(__file__).resolve().parent
_OWN = os.path.dirname(__file__) + os.sep  # the hook's own files, as its code objects name them
#: Where the build leaves why it could not build the extension (``hatch_build.WHY``).
WHY_FILE = _PACKAGE / "client" / "_fastpath.why"

_loaded = False
_module: ModuleType | None = None
_why = ""


def free_threaded() -> bool:
    """Whether this interpreter is a free-threaded build (3.13t and later)."""
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def module() -> ModuleType | None:
    """The extension, loaded on first use; None where it is not built or may not be used here."""
    global _loaded, _module, _why
    if _loaded:
        return _module
    _loaded = True
    if free_threaded():
        _why = "a free-threaded interpreter (the C fast path relies on the GIL)"
        log.warning("hangwatch: %s: the hook records in Python", _why)
        return None
    try:
        loaded = importlib.import_module("hangwatch.client._fastpath")
    except ImportError as exc:
        try:
            _why = f"not built at install: {WHY_FILE.read_text().strip()}"
        except OSError:
            _why = f"not importable ({exc})"
        return None
    loaded.set_foreign(foreign)
    _module = loaded
    return _module


def describe() -> str:
    """How this process's hook records calls: ``native``, or ``python: why`` (``hangwatch status``
    shows it per rank)."""
    if module() is None:
        return f"python: {_why}"
    if not config.env_flag(config.ENV_NATIVE, True):
        return f"python: {config.ENV_NATIVE}=0"
    return "native"


def _code_of(handler: object) -> CodeType | None:
    for _ in range(4):  # a function, a bound method, a functools.partial of either
        code = getattr(handler, "__code__", None)
        if isinstance(code, CodeType):
            return code
        handler = getattr(handler, "__func__", None) or getattr(handler, "func", None)
    return None


def _handler_codes() -> set[CodeType]:
    """The code of every signal handler installed from Python now."""
    codes: set[CodeType] = set()
    for signum in signal.valid_signals():
        try:
            code = _code_of(signal.getsignal(signum))
        except (ValueError, OSError):
            continue
        if code is not None:
            codes.add(code)
    return codes


def foreign(exc: BaseException) -> bool:
    """Whether ``exc``, caught inside the hook, is the program's and must reach it unchanged: not
    an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``), or raised by a signal handler that
    ran while the hook's code did (its frame is in the traceback). Everything else the hook's own
    code or the code it calls raised (torch's, an argument's ``__eq__``): the hook copes, or turns
    itself off and says so, and the program never sees it. Never raises."""
    try:
        if not isinstance(exc, Exception):
            return True
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            if not tb.tb_frame.f_code.co_filename.startswith(_OWN):  # a handler's is never the hook's
                frames.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        if not frames:
            return False
        codes = _handler_codes()
        return any(code in codes for code in frames)
    except Exception:
        return False


def _reset() -> None:
    """Tests: load again on next use."""
    global _loaded, _module, _why
    _loaded, _module, _why = False, None, ""
