"""README.md shows what the CLI really prints: its samples are re-rendered from captured JSON."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_samples_match_the_renderers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    spec = importlib.util.spec_from_file_location("readme_samples", ROOT / "scripts" / "readme_samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.updated_readme()
    assert (ROOT / "README.md").read_text() == expected, "run: TZ=UTC python scripts/readme_samples.py"
    assert "<!-- sample:status -->\n```text\njob " in expected
