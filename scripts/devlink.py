"""Development install: make the source tree importable as ``hangwatch`` without copying.

The wheel installs ``common/`` as the ``hangwatch`` package and mounts ``client/`` as
``hangwatch.client`` (and so on). Editable installs cannot express
that mapping, so ``make dev`` builds ``.dev/hangwatch`` out of symlinks to the real folders and
puts ``.dev`` on the virtual environment's path, together with the attach ``.pth``.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOUNTS = {"client": "client", "coordinator": "coordinator", "agent": "agent", "protos": "protos"}


def build_tree(top: Path) -> Path:
    """``top/hangwatch`` made of symlinks to the source folders; returns it."""
    dev = top / "hangwatch"
    if dev.exists():
        shutil.rmtree(dev)
    dev.mkdir(parents=True)
    for entry in (ROOT / "common").iterdir():
        if entry.name != "__pycache__":
            (dev / entry.name).symlink_to(entry)
    for name, folder in MOUNTS.items():
        (dev / name).symlink_to(ROOT / folder)
    return dev


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--tree-only":
        build_tree(Path(sys.argv[2]).resolve())  # e.g. for mypy on the sources
        return 0
    dev = build_tree(ROOT / ".dev")
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "_hangwatch_dev.pth").write_text(str(ROOT / ".dev") + "\n")
    shutil.copyfile(ROOT / "hangwatch_attach.pth", site / "hangwatch_attach.pth")
    script = Path(sysconfig.get_paths()["scripts"]) / "hangwatch"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom hangwatch.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    print(f"dev links in {dev}; {site} points at them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
