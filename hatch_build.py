"""Build hook: compiles the hook's fast path in C (``hangwatch/client/_fastpath.c``) into the wheel.

Optional by design. Where the interpreter's headers or a C compiler are missing, or
``HANGWATCH_BUILD_NATIVE=0`` is set, the package installs pure Python and the hook records every
call through its Python fast path (same records, more CPU per call: BENCHMARKS.md). The compiler
is the one the interpreter was built with (``sysconfig``), so the extension matches it; nothing is
downloaded.

Editable installs (``pip install -e .``, the Makefile's) put the repository root on ``sys.path``;
there the extension is written next to its source, as an in-place build would (git ignores it),
and rebuilt by the next ``make`` when the source changes (the Makefile's install depends on it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "hangwatch/client/_fastpath.c"
MODULE = "hangwatch/client/_fastpath"


def compile_extension(root: str, out_dir: str) -> Path | None:
    """Compile the extension into ``out_dir``; its path, or None (why is printed) if it cannot be."""
    if os.environ.get("HANGWATCH_BUILD_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        print("hangwatch: HANGWATCH_BUILD_NATIVE=0, the hook's fast path stays in Python")
        return None
    include = sysconfig.get_paths().get("include", "")
    if not include or not Path(include, "Python.h").exists():
        print(f"hangwatch: no Python.h under {include!r}: the hook's fast path stays in Python")
        return None
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(compiler[0]) is None:
        print(f"hangwatch: no C compiler ({compiler[0]}): the hook's fast path stays in Python")
        return None
    target = Path(out_dir, Path(MODULE).name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    cmd = [
        *compiler,
        "-O2",
        "-fPIC",
        "-shared",
        "-Wall",
        "-fvisibility=hidden",
        f"-I{include}",
        str(Path(root, SOURCE)),
        "-o",
        str(target),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"hangwatch: compiling the fast path failed ({exc}): it stays in Python")
        return None
    if done.returncode != 0:
        print(f"hangwatch: compiling the fast path failed: it stays in Python\n{done.stderr[-2000:]}")
        return None
    return target


class NativeBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if version == "editable":
            built = compile_extension(self.root, str(Path(self.root, MODULE).parent))
            if built is not None:
                print(f"hangwatch: built {built.relative_to(self.root)} in place")
            return
        self._tmp = tempfile.mkdtemp(prefix="hangwatch-build-")
        built = compile_extension(self.root, self._tmp)
        if built is None:
            return
        build_data["force_include"][str(built)] = f"{Path(MODULE).parent}/{built.name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
