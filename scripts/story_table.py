"""Keep the story table in BENCHMARKS.md true: it is written from ``tests/e2e/test_story.py``.

python scripts/story_table.py           # rewrite the section in BENCHMARKS.md
python scripts/story_table.py --check   # exit 1 when the section differs (tests/test_readme.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
BEGIN = "<!-- story table: scripts/story_table.py writes what follows -->"
END = "<!-- end of the story table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """The section's table, one row per story."""
    sys.path.insert(0, str(ROOT))
    from tests.e2e.test_story import STORIES

    lines = [
        "| program | kind, culprit | what it must say (`{X}`: the script's line marked `@X`; `{lineX}`: its file "
        "and line) | before the model |",
        "| --- | --- | --- | --- |",
    ]
    for s in STORIES:
        culprits = ", ".join(map(str, s.culprits))
        told = ("told already: " if s.told_today else "") + s.today
        must = s.summary + (f"; then: {s.aftermath}" if s.aftermath else "")
        if s.pending:
            must += f" (not told yet: {s.pending})"
        lines.append(f"| `{s.name}` | `{s.kind}`, rank {culprits} | {_cell(must)} | {_cell(told)} |")
    return "\n".join(lines) + "\n"


def section(text: str) -> tuple[int, int]:
    start, end = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
    return start, end


def main(argv: list[str]) -> int:
    text = BENCHMARKS.read_text()
    start, end = section(text)
    fresh = text[:start] + table() + text[end:]
    if "--check" in argv:
        return 0 if fresh == text else 1
    BENCHMARKS.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
