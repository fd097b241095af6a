"""Regenerate the Python code for hangwatch/protos/hangwatch.proto: ``python scripts/generate_protos.py``.

``--check`` regenerates into a temporary directory and exits 1 if the checked-in files differ.
Needs grpcio-tools (a dev/test dependency, pinned in pyproject.toml so output is reproducible).
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "hangwatch" / "protos"
OUTPUTS = ("hangwatch_pb2.py", "hangwatch_pb2.pyi", "hangwatch_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    # Compiled from the repository root, the generated modules import each other as
    # ``hangwatch.protos.*``, which is where they live.
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(HERE / "hangwatch.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str]) -> int:
    check = "--check" in argv
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        produced = Path(tmp) / "hangwatch" / "protos"
        if check:
            stale = [
                name
                for name in OUTPUTS
                if not (HERE / name).exists() or not filecmp.cmp(produced / name, HERE / name, shallow=False)
            ]
            if stale:
                print(f"stale generated code: {', '.join(stale)}; run: python scripts/generate_protos.py")
                return 1
            return 0
        for name in OUTPUTS:
            shutil.copyfile(produced / name, HERE / name)
    print("generated", ", ".join(OUTPUTS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
