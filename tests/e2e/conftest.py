"""What the end-to-end tests share beyond ``tests/conftest.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

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
