"""README.md shows what the CLI really prints: its samples are re-rendered from captured JSON."""

from __future__ import annotations

import importlib.util
import re
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


#: Backticked repository paths in the docs (``bench/overhead.py``, ``hangwatch/wire.py``).
_TOPS = "hangwatch|common|client|coordinator|agent|protos|tests|bench|scripts|deploy|docs|\\.ci"
_PATH = re.compile(rf"`((?:{_TOPS})/[A-Za-z0-9_./-]*)`")


def test_the_story_table_in_benchmarks_is_the_test_s() -> None:
    spec = importlib.util.spec_from_file_location("story_table", ROOT / "scripts" / "story_table.py")
    assert spec is not None and spec.loader is not None
    story_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(story_table)
    assert story_table.main(["--check"]) == 0, "run: python scripts/story_table.py"


DOCS = [
    "README.md",
    "BENCHMARKS.md",
    "deploy/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_docs_name_exists(doc: str) -> None:
    text = (ROOT / doc).read_text()
    named = sorted(set(_PATH.findall(text)))
    assert named or doc.startswith("docs/"), f"{doc} names no repository path: the pattern is broken"
    missing = [p for p in named if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"{doc} names paths that do not exist: {missing}"


#: What a newcomer reads through: the rest belongs in docs/.
README_WORDS = 2000


def test_the_readme_stays_within_its_budget() -> None:
    words = len((ROOT / "README.md").read_text().split())
    assert words <= README_WORDS, f"README.md has {words} words (at most {README_WORDS}): move detail to docs/"


def test_every_flag_the_readme_names_exists() -> None:
    """A flag the README shows (``--stuck-after``) is one the CLI's parser takes."""
    from hangwatch.cli.parser import build_parser

    parser = build_parser()
    known: set[str] = set()

    def collect(p: object) -> None:
        for action in getattr(p, "_actions", []):
            known.update(action.option_strings)
            choices = getattr(action, "choices", None)
            for sub in choices.values() if isinstance(choices, dict) else ():
                collect(sub)

    collect(parser)
    readme = (ROOT / "README.md").read_text()
    torchrun = {"--standalone", "--nproc-per-node", "--nnodes", "--node-rank", "--max-restarts"}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", readme)) - torchrun
    assert named <= known, f"README.md names flags the CLI does not take: {sorted(named - known)}"
