"""The packages' layers: each imports only those below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hangwatch"

#: A package and those it must never import (directly; the rest follows by induction).
FORBIDDEN = {
    "model": ("coordinator", "diagnosis", "postmortem", "agent", "client", "cli"),
    "diagnosis": ("coordinator", "postmortem", "agent", "client", "cli"),
    "postmortem": ("coordinator", "agent", "client", "cli"),
    "coordinator": ("cli",),
    "client": ("coordinator", "diagnosis", "postmortem", "agent", "cli"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ``hangwatch.*`` module a file imports, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m.startswith("hangwatch.")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    bad = [
        f"{p.relative_to(ROOT.parent)}:{line} imports {m}"
        for p in sorted((ROOT / package).rglob("*.py"))
        for line, m in _imports(p)
        if m.split(".")[1] in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)
