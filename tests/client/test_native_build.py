"""The hook's C fast path builds on every Python users run, with the interpreter's own flags,
and an install that cannot build it says so out loud (or fails, where asked to).

The compile runs ``hatch_build.py`` as a script under each interpreter pyenv has (the same code
the wheel's build hook runs); ``scripts/check_native.py`` goes further and runs the tests that
need no torch on each.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

import hatch_build
from hangwatch import config, testing

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = testing.pythons()


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_the_fast_path_compiles_and_loads_on_every_python(version: str, tmp_path: Path) -> None:
    python = PYTHONS[version]
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    done = subprocess.run(
        [str(python), str(ROOT / "hatch_build.py"), "--strict", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (built,) = tmp_path.glob("_fastpath*.so")
    load = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('hangwatch.client._fastpath', {str(built)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.SLOT_SIZE)\n"
    )
    loaded = subprocess.run([str(python), "-c", load], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["48"]


def test_the_compile_takes_the_interpreters_own_flags(tmp_path: Path) -> None:
    compile_, link = hatch_build.command(str(ROOT), tmp_path / "_fastpath.so")
    for flag in shlex.split(sysconfig.get_config_var("CFLAGS") or ""):
        assert flag in compile_
    assert "-DNDEBUG" in compile_
    assert link[: len(shlex.split(sysconfig.get_config_var("LDSHARED")))] == shlex.split(
        sysconfig.get_config_var("LDSHARED")
    )


@pytest.fixture
def broken_root(tmp_path: Path) -> Path:
    """A checkout whose C source does not compile."""
    source = tmp_path / hatch_build.SOURCE
    source.parent.mkdir(parents=True)
    shutil.copy(ROOT / hatch_build.SOURCE, source)
    source.write_text(source.read_text() + "\nthis is not C;\n")
    return tmp_path


def test_an_install_that_cannot_compile_says_so_on_stderr(
    broken_root: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(config.ENV_REQUIRE_NATIVE, raising=False)
    out = broken_root / "out"
    built, why = hatch_build.compile_extension(str(broken_root), str(out))
    assert built is None and why.startswith("the compile failed")
    err = capfd.readouterr().err
    assert "the C fast path is NOT built" in err and "this is not C" in err
    assert not list(out.glob("_fastpath*"))  # no older build left to be imported instead


def test_a_required_native_build_that_fails_fails_the_install(
    broken_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert hatch_build.ENV_REQUIRE_NATIVE == config.ENV_REQUIRE_NATIVE
    monkeypatch.setenv(config.ENV_REQUIRE_NATIVE, "1")
    with pytest.raises(hatch_build.NativeBuildError, match="compile failed"):
        hatch_build.compile_extension(str(broken_root), str(broken_root / "out"))


def test_a_free_threaded_interpreter_installs_without_the_c_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The extension relies on the GIL; loaded on a free-threaded interpreter it would turn the
    GIL back on for the whole process. The install says so and leaves it out."""
    real = sysconfig.get_config_var
    monkeypatch.setattr(hatch_build.sysconfig, "get_config_var", lambda n: 1 if n == "Py_GIL_DISABLED" else real(n))
    monkeypatch.delenv(config.ENV_REQUIRE_NATIVE, raising=False)
    built, why = hatch_build.compile_extension(str(ROOT), str(tmp_path))
    assert built is None and "free-threaded" in why and "free-threaded" in capfd.readouterr().err
