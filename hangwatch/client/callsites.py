"""Which frames are the program's own: a call site is the innermost frame outside torch, the
hook, a framework's wrappers and the interpreter's launch machinery, else outside installed code.
"""

from __future__ import annotations

import os
import sys
import sysconfig

#: Frames from these paths are library code: the call site is the first frame outside them.
_LIBRARY_MARKERS = (
    os.sep + "torch" + os.sep,
    os.sep + "hangwatch" + os.sep + "client" + os.sep,
    os.sep + "accelerate" + os.sep,
    os.sep + "contextlib.py",
    os.sep + "functools.py",
    os.sep + "typing_extensions.py",  # torch's @deprecated wrappers (all_reduce_coalesced, ...)
    os.sep + "multiprocessing" + os.sep,  # how a spawned rank's function is called, never its code
    os.sep + "runpy.py",
    os.sep + "threading.py",
    "<frozen ",  # python -m's runpy, importlib
)
#: Frames walked outwards looking for the program's own (a framework's helpers can be deep).
MAX_FRAMES = 48
#: Code that lives inside those libraries and is the user's program all the same: their test
#: harnesses and example scripts (a training script installed as a package is not under them).
_USER_MARKERS = (
    os.sep + "torch" + os.sep + "testing" + os.sep,
    os.sep + "accelerate" + os.sep + "test_utils" + os.sep,
    os.sep + "accelerate" + os.sep + "examples" + os.sep,
)


def is_library(filename: str) -> bool:
    """Plumbing between the program and the collective (torch, hangwatch's hook, Accelerate's
    wrappers, decorators, the interpreter's launch machinery), not the program itself."""
    return any(marker in filename for marker in _LIBRARY_MARKERS) and not any(
        marker in filename for marker in _USER_MARKERS
    )


def _installed_dirs() -> tuple[str, ...]:
    """Where installed code lives: the standard library and every site-packages folder."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    dirs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


_INSTALLED = _installed_dirs()
_PACKAGES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def is_installed(filename: str) -> bool:
    """Installed code, the standard library's or a package's (a framework's helper, Lightning's
    or a data loader's), rather than the program's own; a training script installed as a package
    is too, which is why a call site falls back to the first frame outside the plumbing."""
    return filename.startswith(_INSTALLED) or any(marker in filename for marker in _PACKAGES)
