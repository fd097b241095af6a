"""Build hook: compiles the hook's fast path in C (``hangwatch/client/_fastpath.c``) into the wheel.

Optional by design. Where the interpreter's headers or a C compiler are missing, the compile
fails, the interpreter is free-threaded, or ``HANGWATCH_BUILD_NATIVE=0`` is set, the package
installs pure Python and the hook records every call through its Python fast path (same
records, more CPU per call: BENCHMARKS.md). Such an install says so on stderr (pip shows it with
``-v``, and always when the build fails), leaves the reason in ``_fastpath.why`` beside the
module for the rank to tell (``hangwatch status``), and ``HANGWATCH_REQUIRE_NATIVE=1`` turns it
into an install error. The compiler and its flags are the interpreter's own (``sysconfig``:
``CC``, ``CFLAGS`` with ``-DNDEBUG`` and the overflow semantics CPython is built with,
``CCSHARED``, ``LDSHARED``), so the extension matches it; nothing is downloaded.

Editable installs (``pip install -e .``, the Makefile's) put the repository root on ``sys.path``;
there the extension is written next to its source, as an in-place build would (git ignores it),
and rebuilt by the next ``make`` when the source changes (the Makefile's install depends on it).

``python hatch_build.py [--strict] [--out DIR]`` compiles it with the running interpreter, no
hatchling needed: ``scripts/check_native.py`` does so on every Python the machine has.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, on an interpreter without hatchling
    BuildHookInterface = object

SOURCE = "hangwatch/client/_fastpath.c"
MODULE = "hangwatch/client/_fastpath"
#: Beside the module where it could not be built: why (the rank says so in its registration).
WHY = "hangwatch/client/_fastpath.why"
#: ``hangwatch.config.ENV_REQUIRE_NATIVE`` (this file cannot import the package it builds).
ENV_REQUIRE_NATIVE = "HANGWATCH_REQUIRE_NATIVE"
ENV_BUILD_NATIVE = "HANGWATCH_BUILD_NATIVE"


class NativeBuildError(RuntimeError):
    """The C fast path could not be built while ``HANGWATCH_REQUIRE_NATIVE=1`` asks for it."""


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ("0", "false", "no", "off", "")


def _config(name: str) -> list[str]:
    return shlex.split(str(sysconfig.get_config_var(name) or ""))


def _say(text: str) -> None:
    """Loud on purpose: a missing fast path costs every collective, so stderr, not only stdout."""
    print(f"hangwatch: {text}", file=sys.stderr, flush=True)


def command(root: str, target: Path, strict: bool = False) -> list[list[str]]:
    """The compile and link commands for ``target``, with the interpreter's own compiler and flags
    (``strict``: warnings are errors, for the check on every Python)."""
    include = sysconfig.get_paths().get("include", "")
    compiler = _config("CC") or ["cc"]
    obj = target.with_suffix(".o")
    cflags = [*_config("CFLAGS"), *_config("CCSHARED")]
    extra = ["-Wall", "-fvisibility=hidden", *(["-Werror"] if strict else [])]
    compile_ = [*compiler, *cflags, *extra, f"-I{include}", "-c", str(Path(root, SOURCE)), "-o", str(obj)]
    link = [*(_config("LDSHARED") or [*compiler, "-shared"]), str(obj), "-o", str(target)]
    return [compile_, link]


def compile_extension(root: str, out_dir: str, strict: bool = False) -> tuple[Path | None, str]:
    """Compile the extension into ``out_dir``: its path and "", or None and why not (also said
    on stderr). Raises :class:`NativeBuildError` where it cannot be built and
    ``HANGWATCH_REQUIRE_NATIVE=1`` is set."""
    required = _flag(ENV_REQUIRE_NATIVE, "0")
    why = _cannot(root, out_dir, strict)
    if isinstance(why, Path):
        return why, ""
    if required:
        raise NativeBuildError(f"hangwatch: {ENV_REQUIRE_NATIVE}=1, yet the C fast path was not built: {why}")
    _say(f"the C fast path is NOT built ({why}); the hook records every call in Python (more CPU per call)")
    return None, why


def _cannot(root: str, out_dir: str, strict: bool) -> Path | str:
    """The built extension, or why it cannot be."""
    if not _flag(ENV_BUILD_NATIVE, "1"):
        return f"{ENV_BUILD_NATIVE}=0"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return "a free-threaded interpreter: the C fast path relies on the GIL"
    include = sysconfig.get_paths().get("include", "")
    if not include or not Path(include, "Python.h").exists():
        return f"no Python.h under {include!r}"
    compiler = _config("CC") or ["cc"]
    if shutil.which(compiler[0]) is None:
        return f"no C compiler ({compiler[0]})"
    target = Path(out_dir, Path(MODULE).name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for cmd in command(root, target, strict):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                target.unlink(missing_ok=True)  # never leave an older build to be imported instead
                first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
                _say(f"compiling the C fast path failed:\n  {shlex.join(cmd)}\n{done.stderr[-4000:]}")
                return f"the compile failed: {first[:160]}"
    except (OSError, subprocess.SubprocessError) as exc:
        target.unlink(missing_ok=True)
        return f"the compile failed: {exc}"
    finally:
        target.with_suffix(".o").unlink(missing_ok=True)
    return target


def _note(root: str, why: str) -> Path:
    """Write (or, built, remove) the reason beside the module; its path."""
    path = Path(root, WHY)
    if why:
        path.write_text(why + "\n")
    else:
        path.unlink(missing_ok=True)
    return path


class NativeBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if version == "editable":
            built, why = compile_extension(self.root, str(Path(self.root, MODULE).parent))
            _note(self.root, why)
            if built is not None:
                print(f"hangwatch: built {built.relative_to(self.root)} in place")
            return
        self._tmp = tempfile.mkdtemp(prefix="hangwatch-build-")
        built, why = compile_extension(self.root, self._tmp)
        if built is None:
            note = Path(self._tmp, Path(WHY).name)
            note.write_text(why + "\n")
            build_data["force_include"][str(note)] = WHY
            return
        build_data["force_include"][str(built)] = f"{Path(MODULE).parent}/{built.name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description="Compile the hook's C fast path with this interpreter.")
    ap.add_argument("--out", help="where to write it (default: beside its source)")
    ap.add_argument("--strict", action="store_true", help="compiler warnings are errors")
    args = ap.parse_args()
    root = str(Path(__file__).resolve().parent)
    os.environ[ENV_REQUIRE_NATIVE] = "1"
    try:
        built, _ = compile_extension(root, args.out or str(Path(root, MODULE).parent), args.strict)
    except NativeBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(built)
    return 0


if __name__ == "__main__":
    sys.exit(main())
