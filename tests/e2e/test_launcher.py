"""`hangwatch run` and `hangwatch demo` as a user runs them: real torchrun, real diagnosis printed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hangwatch.testing import BIN

pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "hangwatch"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_run_prints_the_diagnosis_and_returns_the_jobs_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import datetime, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n"
        "t = torch.zeros(1, 5) if dist.get_rank() == 0 else torch.zeros(1, 2, 5)\n"
        "dist.broadcast(t, src=0)\n"
        "dist.destroy_process_group()\n"
        "sys.exit(3)\n"
    )
    out = _run(
        ["run", "--data-dir", str(tmp_path / "data"), "--", "--standalone", "--nproc-per-node", "2", str(script)],
        tmp_path,
    )
    # torchrun's own exit code (1 when a rank fails), which hangwatch run passes through
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[shape_mismatch]" in out.stdout
    assert "[1, 5]" in out.stdout and "[1, 2, 5]" in out.stdout
    assert (tmp_path / "data" / "hangwatch.sqlite3").exists()


def test_run_without_a_script_explains(tmp_path: Path) -> None:
    out = _run(["run"], tmp_path, timeout=30)
    assert out.returncode == 2
    assert "give torchrun options and a script" in out.stderr


def test_demo_default_scenario_is_diagnosed_live(tmp_path: Path) -> None:
    out = _run(["demo", "--data-dir", str(tmp_path / "data")], tmp_path, timeout=150)
    assert "[early_exit]" in out.stdout, out.stdout[-3000:]
    assert "Unsynchronised early exit" in out.stdout  # the full report
    assert "set_trigger" in out.stdout  # the hint
    listing = _run(["demo", "--list"], tmp_path, timeout=30)
    assert listing.returncode == 0 and "early_stop" in listing.stdout and "frozen" in listing.stdout
