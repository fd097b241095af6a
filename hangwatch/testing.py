"""Helpers shared by the test suite and the benchmarks: real jobs, real coordinators, bad networks.

One implementation of what ``tests/`` and ``bench/`` both need: a free port, a bounded poll loop
(:func:`wait_for`), a black-holed coordinator (:class:`BlackHole`: accepts TCP connections and
never answers a byte), a ``hangwatch coordinator`` process (:func:`start_coordinator_cli`) and a
``torchrun`` job (:func:`torchrun`, returning a :class:`Job`).

Why it ships in the package rather than living in ``tests/``: the bench scripts run as
``python bench/<name>.py`` from any checkout, where ``tests`` is not importable without path
tricks but the installed ``hangwatch`` is; and the same helpers let a user rehearse a deployment
(a job against a black-holed or restarted coordinator) without our test tree. It imports only
the standard library (no torch, no pytest, no grpc), so importing it costs nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from hangwatch import config

#: The folder of the running interpreter: where the ``hangwatch`` console script is installed.
BIN = Path(sys.executable).parent

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (nothing listens there now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.1, what: str = "condition") -> T:
    """Poll ``predicate`` every ``interval`` seconds until it returns something truthy, and return
    that; raise AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class BlackHole:
    """A coordinator address that accepts TCP connections and never answers a byte.

    Use as a context manager; ``addr`` is ``127.0.0.1:<port>``. Accepted connections are held
    open (so a client's RPCs run into their deadlines) and closed on exit.
    """

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self.addr = f"127.0.0.1:{self.port}"
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="black-hole", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.accepted.append(self._sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self._sock.close()
        for conn in self.accepted:
            conn.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, tp: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def start_coordinator_cli(
    data_dir: Path | str,
    port: int = 0,
    *,
    stuck_after: float | None = None,
    cwd: Path | str | None = None,
    stderr: int | IO[Any] | None = subprocess.STDOUT,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> tuple[str, subprocess.Popen[str]]:
    """A real ``hangwatch coordinator`` process (metrics off) storing into ``data_dir``
    (``env``: more environment for it).

    Returns the ``HANGWATCH_ADDR`` it prints once it serves, and the process (its stdout is a
    pipe; ``stderr`` goes into it by default). Kills it and raises AssertionError if it prints
    no address within ``timeout`` seconds.
    """
    args = [str(BIN / "hangwatch"), "coordinator", "--port", str(port), "--data-dir", str(data_dir)]
    if stuck_after is not None:
        args += ["--stuck-after", str(stuck_after)]
    proc = subprocess.Popen(
        [*args, "--metrics-port", "0"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **env} if env else None,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        match = re.search(r"export HANGWATCH_ADDR=(\S+)", line)
        if match:
            return match.group(1), proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise AssertionError("the coordinator did not print the HANGWATCH_ADDR to export")


class Job:
    """A running ``torchrun`` job; its output goes to ``log`` (None: discarded)."""

    def __init__(self, proc: subprocess.Popen[str], log: Path | None) -> None:
        self.proc = proc
        self.log = log

    def wait(self, timeout: float) -> int:
        """The job's exit code; kills it and raises AssertionError (with its log) after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout} s; log:\n{self.output()[-4000:]}") from None

    def kill(self, grace: float = 10.0) -> None:
        """Terminate the job (torchrun passes it on to the ranks); SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""


def job_env(addr: str | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a job's ranks: no inherited ``HANGWATCH_*`` variable, one
    OpenMP thread, unbuffered output, ``HANGWATCH_ADDR`` set to ``addr`` unless it is None."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if addr is not None:
        env[config.ENV_ADDR] = addr
    env.update(extra or {})
    return env


def torchrun(
    script: Path | str,
    *,
    nproc: int = 2,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    log: Path | None = None,
    launcher_args: Sequence[str] = (),
) -> Job:
    """Start ``python -m torch.distributed.run --standalone --nproc-per-node=<nproc>
    launcher_args script args``.

    ``env`` is the ranks' whole environment (see :func:`job_env`; None: this process's). Output
    (stdout and stderr) goes to ``log``, or nowhere when ``log`` is None.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *launcher_args,
        str(script),
        *args,
    ]
    if log is None:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    else:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return Job(proc, log)


#: The start of a gloo job (hangwatch not attached) whose every rank dumps its Flight Recorder
#: ring to ``$DUMP_DIR/nccl_trace_rank_<rank>`` ``$DUMP_AT`` s in (plus ``$DUMP_SKEW`` s per
#: rank), as pickle with stack frames or as JSON (``$DUMP_FORMAT``), from a thread, as a user's
#: own ``_dump_fr_trace`` would (gloo writes no dump on timeout); then it ends the process, once
#: the others have dumped too (its exit breaks their connections). ``t`` is a 4-float tensor.
FR_DUMPING_JOB = """
import datetime, os, sys, threading, time
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
world = dist.get_world_size()

def _dump():
    skew = float(os.environ.get("DUMP_SKEW", "0"))
    time.sleep(float(os.environ["DUMP_AT"]) + skew * rank)
    json_dump = os.environ.get("DUMP_FORMAT") == "json"
    data = _dump_fr_trace_json(True, False) if json_dump else _dump_fr_trace(True, True, False)
    name = os.path.join(os.environ["DUMP_DIR"], f"nccl_trace_rank_{rank}" + (".json" if json_dump else ""))
    with open(name + ".tmp", "wb") as f:
        f.write(data)
    os.replace(name + ".tmp", name)
    time.sleep(3 + skew * world)
    os._exit(0)

threading.Thread(target=_dump, daemon=True).start()
t = torch.ones(4)
"""


def fr_dump_job(
    body: str,
    workdir: Path,
    *,
    name: str,
    nproc: int = 3,
    dump_at: float = 8.0,
    fmt: str = "pickle",
    skew: float = 0.0,
    ring: int = 2000,
    addr: str | None = None,
) -> Path:
    """Run ``body`` after :data:`FR_DUMPING_JOB` under torchrun and wait for it (bounded): the
    folder of its ranks' dumps. The job waits for its dumps whatever ``body`` does; ``addr``:
    the coordinator hangwatch attaches it to (None: not attached)."""
    out = workdir / f"{name}-dumps"
    out.mkdir(parents=True)
    script = workdir / f"{name}.py"
    script.write_text(FR_DUMPING_JOB + body + "\ntime.sleep(300)\n")
    env = job_env(
        addr,
        {
            "TORCH_FR_BUFFER_SIZE": str(ring),
            "DUMP_DIR": str(out),
            "DUMP_AT": str(dump_at),
            "DUMP_FORMAT": fmt,
            "DUMP_SKEW": str(skew),
        },
    )
    job = torchrun(script, nproc=nproc, env=env, cwd=workdir, log=workdir / f"{name}.log")
    # until the job ends, or no new dump came for a while after the first (a rank that cannot
    # dump, frozen or dead, keeps torchrun waiting), bounded
    deadline = time.monotonic() + 60 + dump_at + skew * nproc
    quiet_s = 4 + skew * nproc
    seen, last_new = 0, time.monotonic()
    try:
        while job.proc.poll() is None and time.monotonic() < deadline:
            count = sum(1 for p in out.iterdir() if not p.name.endswith(".tmp"))
            if count >= nproc:
                break  # every rank's dump is in (the job itself waits for ever)
            if count != seen:
                seen, last_new = count, time.monotonic()
            elif seen and time.monotonic() - last_new > quiet_s:
                break
            time.sleep(0.2)
    finally:
        job.kill()
    return out


#: The Pythons the hook's C fast path is checked on (``scripts/check_native.py``), oldest first;
#: a ``t`` build (free-threaded) is looked for beside each from 3.13 on.
PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13", "3.14")


def pythons(versions: Sequence[str] = PYTHON_VERSIONS) -> dict[str, Path | None]:
    """Each version's interpreter on this machine (pyenv's, under ``$PYENV_ROOT`` or ``~/.pyenv``,
    then ``pythonX.Y`` on ``PATH``), None where it has none; free-threaded builds as ``X.Yt``."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    installed = sorted(root.iterdir()) if root.is_dir() else []
    found: dict[str, Path | None] = {}
    for version in versions:
        free_threaded = tuple(int(x) for x in version.split(".")) >= (3, 13)
        wanted = [version] + ([version + "t"] if free_threaded else [])
        for name in wanted:
            free = name.endswith("t")
            path: Path | None = None
            for folder in reversed(installed):  # the newest patch release first
                base = folder.name
                if base.endswith("t") != free or not base.rstrip("t").startswith(version + "."):
                    continue
                exe = folder / "bin" / f"python{name}"
                if not exe.exists() and not free:
                    exe = folder / "bin" / "python"
                if exe.exists():
                    path = exe
                    break
            if path is None:
                on_path = shutil.which(f"python{name}")
                path = Path(on_path) if on_path else None
            if path is not None or not free:
                found[name] = path
    return found
