"""The hook's C fast path on every Python this machine has: built with that interpreter's own
flags (warnings as errors), loaded, and the tests that need no torch run against it.

    .venv/bin/python scripts/check_native.py             # every version (make test runs this)
    .venv/bin/python scripts/check_native.py 3.12 3.13   # some
    .venv/bin/python scripts/check_native.py --bench     # then bench/fastpath_micro.py on each: a table

The full suite runs on the project's venv (Python 3.11, with torch); torch exists for no other
version here, so what runs elsewhere is what needs none: the C fast path against a stand-in
process group, byte for byte against the Python one, the ring's ordering and stress tests, the
signal storm, the hook's bounds, the agent's gathering in C against Python's (``NATIVE_TESTS``).

Per version: a virtual environment under ``.venv/native/<version>`` with the test tools (made once);
a copy of the package in a temporary folder with the extension compiled into it by
``hatch_build.py`` under that interpreter; a check that it loads; then the tests, from this
checkout, importing that copy. A version whose interpreter is absent is skipped with the reason
printed (``hangwatch.testing.pythons``: pyenv's, then ``pythonX.Y`` on ``PATH``). Exit status 1 if
any version present failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatch import testing  # noqa: E402

NATIVE_TESTS = (
    "tests/client/test_fastpath.py",
    "tests/client/test_signals.py",
    "tests/client/test_hook_bounds.py",
    "tests/test_ring.py",
    "tests/test_ring_order.py",
    "tests/test_ringwire.py",
)
#: What the tests need beyond the package's own ``protobuf`` (no torch, no grpc).
TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "protobuf>=7.35.1,<8")
VENVS = ROOT / ".venv" / "native"


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HANGWATCH_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join((str(tree), str(ROOT)))  # the copy's package, this checkout's tests
    return env


def _venv(version: str, python: Path) -> Path:
    """The version's venv with the test tools; its interpreter."""
    home = VENVS / version
    exe = home / "bin" / "python"
    done = home / ".installed"
    if done.exists() and done.read_text() == "\n".join(TOOLS):
        return exe
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run([str(python), "-m", "venv", str(home)], check=True)
    pip = subprocess.run([str(exe), "-m", "pip", "install", "-q", *TOOLS], capture_output=True, text=True)
    if pip.returncode != 0:
        print(pip.stdout[-4000:] + pip.stderr[-4000:])
        pip.check_returncode()
    done.write_text("\n".join(TOOLS))
    return exe


def _tree(tmp: Path) -> Path:
    """A copy of the package without any build of the extension in it."""
    tree = tmp / "tree"
    shutil.copytree(
        ROOT / "hangwatch",
        tree / "hangwatch",
        ignore=shutil.ignore_patterns("__pycache__", "_fastpath*.so", "_fastpath.why"),
    )
    return tree


def check(version: str, python: Path, bench: bool) -> tuple[bool, dict[str, object] | None]:
    """Build, load and test on one interpreter: (passed, the micro-benchmark's figures)."""
    exe = _venv(version, python)
    with tempfile.TemporaryDirectory(prefix=f"hangwatch-native-{version}-") as tmp:
        tree = _tree(Path(tmp))
        env = _env(tree)
        build = [str(exe), str(ROOT / "hatch_build.py"), "--strict", "--out", str(tree / "hangwatch" / "client")]
        load = "from hangwatch import native as n; m = n.module(); assert m, n.describe(); print(m.__file__)"
        pytest = [str(exe), "-m", "pytest", "-q", "--noconftest", "-p", "no:xdist", "-m", "not soak"]
        config = ["--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml")]
        steps = [
            ("build", build),
            ("load", [str(exe), "-c", load]),
            ("tests", [*pytest, *config, *(str(ROOT / t) for t in NATIVE_TESTS)]),
        ]
        for name, cmd in steps:
            began = time.monotonic()
            # run from the copy: the folder a command runs in comes first on its path
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
            said = "ok" if done.returncode == 0 else "FAILED"
            print(f"  {version} {name}: {said} ({time.monotonic() - began:.1f} s) {tail[0]}")
            if done.returncode != 0:
                print(done.stdout[-6000:] + done.stderr[-6000:])
                return False, None
        if not bench:
            return True, None
        done = subprocess.run(
            [str(exe), str(ROOT / "bench" / "fastpath_micro.py")], cwd=tree, env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            print(done.stderr[-4000:])
            return False, None
        return True, json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows: list[dict[str, object]]) -> None:
    print("\n| Python | C fast path, µs a call | Python fast path | ratio | ring write, C | ring write, Python |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        c, py = float(row["c_fast_path_us"]), float(row["python_fast_path_us"])  # type: ignore[arg-type]
        print(
            f"| {row['python']} | {c:.2f} | {py:.2f} | {py / c:.1f}x | {row['ring_write_c_us']} | "
            f"{row['ring_write_python_us']} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help="e.g. 3.12 (default: every version it checks)")
    ap.add_argument("--bench", action="store_true", help="then the micro-benchmark on each, as a table")
    args = ap.parse_args()
    found = testing.pythons(args.versions or testing.PYTHON_VERSIONS)
    failed: list[str] = []
    rows: list[dict[str, object]] = []
    for version, python in found.items():
        if python is None:
            print(f"  {version}: skipped, no interpreter on this machine (pyenv's, or python{version} on PATH)")
            continue
        if version.endswith("t"):
            print(f"  {version}: skipped, free-threaded: the extension is never built nor loaded there")
            continue
        print(f"  {version}: {python}")
        ok, figures = check(version, python, args.bench)
        if not ok:
            failed.append(version)
        elif figures is not None:
            rows.append(figures)
    if rows:
        _table(rows)
    if failed:
        print(f"the C fast path FAILED on Python {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
