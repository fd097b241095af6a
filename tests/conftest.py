"""Shared fixtures: a real coordinator on port 0, and real torchrun/gloo jobs attached to it.

Every wait is bounded. Tests clean the HANGWATCH_* variables they did not set themselves. The
helpers behind them (``wait_for``, ``Job``, ``torchrun``, ``start_coordinator_cli``, ``BlackHole``)
live in :mod:`hangwatch.testing`, shared with ``bench/``; ``Job`` and ``wait_for`` are re-exported
here for the modules that import them from ``tests.conftest``.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
from hangwatch.testing import BIN, Job, wait_for

#: ``BIN``, ``Job`` and ``wait_for`` are re-exported for modules outside the e2e suite that import them from here.
__all__ = ["BIN", "PRELUDE", "Job", "wait_for"]


E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under ``tests/e2e`` runs real jobs: it is ``slow`` (left out of ``make unit``)."""
    for item in items:
        if E2E in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("HANGWATCH_"):
            monkeypatch.delenv(name)


@pytest.fixture
def coordinator_factory(tmp_path: Path) -> Iterator[Callable[..., Coordinator]]:
    started: list[Coordinator] = []

    def make(**overrides: Any) -> Coordinator:
        options = CoordinatorOptions(host="127.0.0.1", port=0, data_dir=str(tmp_path / "data"))
        for key, value in overrides.items():
            setattr(options, key, value)
        c = Coordinator(options)
        c.start()
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop(grace=0.2)


@pytest.fixture
def coordinator(coordinator_factory: Callable[..., Coordinator]) -> Coordinator:
    return coordinator_factory(stuck_after=3.0)


PRELUDE = """
import datetime, os, sys, time
import torch
import torch.distributed as dist
"""


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def launch(
        body: str, *, addr: str | None, nproc: int = 2, env: dict[str, str] | None = None, name: str = "job"
    ) -> Job:
        script = tmp_path / f"{name}.py"
        script.write_text(PRELUDE + textwrap.dedent(body))
        env = testing.job_env(addr, env)
        job = testing.torchrun(script, nproc=nproc, env=env, cwd=tmp_path, log=tmp_path / f"{name}.log")
        jobs.append(job)
        return job

    yield launch
    for job in jobs:
        job.kill()
