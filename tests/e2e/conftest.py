"""What the end-to-end tests share beyond ``tests/conftest.py``."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hangwatch.testing import BIN

#: A stand-in for a training framework's logging helper (Lightning's ``_sync_ddp``), installed where
#: frameworks are: under a ``site-packages`` folder.
FRAMEWORK = """
import torch.distributed as dist


def _sync_ddp(value):
    dist.barrier()
    dist.all_reduce(value)
    return value


def log(name, value, sync_dist=False):
    return _sync_ddp(value) if sync_dist else value
"""


@pytest.fixture
def framework(tmp_path: Path) -> dict[str, str]:
    """The stand-in framework, installed under a ``site-packages`` folder on the job's path."""
    site = tmp_path / "venv" / "lib" / "site-packages"
    (site / "minilight").mkdir(parents=True)
    (site / "minilight" / "__init__.py").write_text(FRAMEWORK)
    return {"PYTHONPATH": str(site)}


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[[str, int], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(node: str, port: int) -> subprocess.Popen[str]:
        # two "nodes" on one machine: each agent its own socket (one node, one agent, in real life)
        socket_path = str(tmp_path / f"{node}.sock")
        proc = subprocess.Popen(
            [
                str(BIN / "hangwatch"),
                "agent",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--node-name",
                node,
                "--rank-socket",
                socket_path,
            ],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
