"""Real child processes for the agent tests: spawned, awaited until ready, always reaped."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import psutil
import pytest

from hangwatch.records import Target


class Spawn(Protocol):
    def __call__(self, body: str, name: str = ...) -> subprocess.Popen[str]: ...


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, every: float = 0.02) -> None:
    """Wait (bounded) until ``predicate()`` is true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(every)


def target(proc: subprocess.Popen[str], rank: int = 0) -> Target:
    return Target(rank, proc.pid, psutil.Process(proc.pid).create_time(), link=f"link-of-rank-{rank}")


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``python <name>.py`` running ``body`` after it printed ``ready``; kill all at the end."""
    procs: list[subprocess.Popen[str]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}

    def start(body: str, name: str = "child") -> subprocess.Popen[str]:
        script = tmp_path / f"{name}.py"
        script.write_text(textwrap.dedent(body))
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        procs.append(proc)
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=10.0), f"{name} did not start"
        assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
