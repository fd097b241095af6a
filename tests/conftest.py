"""Shared fixtures: a real coordinator on port 0, and real torchrun/gloo jobs attached to it.

Every wait is bounded. Tests clean the HANGWATCH_* variables they did not set themselves.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import config
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

BIN = Path(sys.executable).parent


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


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def start_coordinator_cli(tmp_path: Path, port: int = 0, stuck_after: float = 3.0) -> tuple[str, subprocess.Popen[str]]:
    """A real ``hangwatch coordinator`` process; returns the HANGWATCH_ADDR it prints, and the process."""
    proc = subprocess.Popen(
        [
            str(BIN / "hangwatch"),
            "coordinator",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--stuck-after",
            str(stuck_after),
            "--metrics-port",
            "0",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = re.search(r"export HANGWATCH_ADDR=(\S+)", proc.stdout.readline())
        if match:
            return match.group(1), proc
    proc.kill()
    raise AssertionError("the coordinator did not print the HANGWATCH_ADDR to export")


class Job:
    """A torchrun job of ``nproc`` gloo ranks running ``body`` (Python source), attached via env."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout} s; log:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


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
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        if addr is not None:
            full_env[config.ENV_ADDR] = addr
        full_env.update(env or {})
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={nproc}",
                    str(script),
                ],
                cwd=tmp_path,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        job = Job(proc, log)
        jobs.append(job)
        return job

    yield launch
    for job in jobs:
        job.kill()
