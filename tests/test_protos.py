"""The checked-in generated code must match hangwatch/protos/hangwatch.proto.

Regenerate with ``python scripts/generate_protos.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_coordinator_install_does_not_pull_torch() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = project["dependencies"]
    assert {"grpcio", "protobuf", "psutil", "py-spy"} <= {d.split(">")[0].split("=")[0] for d in runtime}
    assert not any(dep.lower().startswith("torch") for dep in runtime), runtime
