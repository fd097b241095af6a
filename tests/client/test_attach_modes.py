"""Attaching with HANGWATCH_ADDR alone under every launcher, and only real ranks registering:
torch.multiprocessing.spawn, plain python with env:// rendezvous, accelerate launch (with its
set_trigger/check_trigger recorded), DataLoader workers started with spawn, and a subprocess of a
rank that initialises a process group of its own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatch.coordinator.daemon import Coordinator
from tests.conftest import BIN, wait_for

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(c: Coordinator, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    env.update(HANGWATCH_ADDR=f"127.0.0.1:{c.port}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _count_registrations(c: Coordinator) -> list[int]:
    seen: list[int] = []
    original = c.register_rank

    def counting(identity, via="direct"):  # type: ignore[no-untyped-def]
        seen.append(identity.rank)
        return original(identity, via)

    c.register_rank = counting  # type: ignore[method-assign]
    return seen


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_mp_spawn(coordinator: Coordinator, tmp_path: Path) -> None:
    seen = _count_registrations(coordinator)
    script = _script(
        tmp_path,
        "spawned.py",
        f"""
        import datetime, torch, torch.distributed as dist, torch.multiprocessing as mp
        def worker(rank):
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=60))
            dist.all_reduce(torch.ones(3))
            dist.destroy_process_group()
        if __name__ == "__main__":
            mp.spawn(worker, nprocs=2)
    """,
    )
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(coordinator), timeout=120, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    wait_for(lambda: all(st.end is not None for st in coordinator.job.ranks.values()) and len(seen) == 2, 10)
    assert sorted(seen) == [0, 1]  # the parent never registers
    assert all(st.history.get("0") for st in coordinator.job.ranks.values())


def test_plain_python_env_rendezvous(coordinator: Coordinator, tmp_path: Path) -> None:
    seen = _count_registrations(coordinator)
    script = _script(
        tmp_path,
        "plain.py",
        """
        import datetime, torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
        dist.broadcast(torch.ones(2), src=0)
        dist.destroy_process_group()
    """,
    )
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=_env(coordinator, RANK=str(rk), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        )
        for rk in (0, 1)
    ]
    assert [p.wait(120) for p in procs] == [0, 0]
    wait_for(lambda: len(seen) == 2, 10)
    assert sorted(seen) == [0, 1]
    ops = [c.op for st in coordinator.job.ranks.values() for c in st.history.get("0", [])]
    assert ops.count("broadcast") == 2


def test_spawned_dataloader_workers_and_rank_subprocesses_never_register(
    coordinator: Coordinator, torchrun: Callable[..., Any], tmp_path: Path
) -> None:
    seen = _count_registrations(coordinator)
    # spawned workers import the dataset by module, and re-import the main script: keep it guarded
    _script(
        tmp_path,
        "data_mod.py",
        """
        import torch
        class Data(torch.utils.data.Dataset):
            def __len__(self): return 16
            def __getitem__(self, i): return torch.ones(2) * i
    """,
    )
    tool = "import os, torch.distributed as d; d.init_process_group('gloo', rank=0, world_size=1, " + (
        f"init_method='file://{tmp_path}/own-' + str(os.getpid())); d.barrier()"
    )
    job = torchrun(
        f"""
        import subprocess
        from data_mod import Data
        if __name__ == "__main__":
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2,
                                                 multiprocessing_context="spawn")
            for batch in loader:
                dist.all_reduce(batch)
            # a tool the rank starts, with a process group of its own: not one of the job's ranks
            subprocess.run([sys.executable, "-c", {tool!r}], check=True, timeout=60)
            dist.destroy_process_group()
    """,
        addr=f"127.0.0.1:{coordinator.port}",
        name="workers",
    )
    assert job.wait(120) == 0, job.output()[-3000:]
    assert sorted(seen) == [0, 1]
    assert coordinator.job.world_size == 2
    assert "Traceback" not in job.output()


@pytest.mark.skipif(shutil.which("accelerate", path=str(BIN)) is None, reason="accelerate is not installed")
def test_accelerate_launch_records_triggers(coordinator: Coordinator, tmp_path: Path) -> None:
    seen = _count_registrations(coordinator)
    script = _script(
        tmp_path,
        "acc.py",
        """
        import torch
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        for step in range(10):
            accelerator.reduce(torch.ones(2))
            if accelerator.process_index == 1 and step == 3:
                accelerator.set_trigger()  # rank 1 wants to stop
            if accelerator.check_trigger():
                break
        accelerator.wait_for_everyone()
        accelerator.end_training()
    """,
    )
    out = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--multi_gpu",  # with no GPU its torchrun-based launcher starts CPU ranks (MULTI_CPU)
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_free_port()),
            str(script),
        ],
        cwd=tmp_path,
        env=_env(coordinator),
        timeout=180,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    wait_for(lambda: len(seen) == 2, 10)
    assert sorted(seen) == [0, 1]  # not the accelerate launcher
    markers = {rk: [m.name for m in st.markers] for rk, st in coordinator.job.ranks.items()}
    assert "accelerate.set_trigger" in markers[1]
    assert all("accelerate.check_trigger" in names for names in markers.values())
    assert coordinator.incidents_json() == []  # a synchronised stop is not an incident


def test_threads_and_forks_in_a_rank(coordinator: Coordinator, torchrun: Callable[..., Any]) -> None:
    seen = _count_registrations(coordinator)
    job = torchrun(
        """
        import threading
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        stop = threading.Event()
        def busy():
            while not stop.is_set():
                sum(range(2000))
                time.sleep(0.001)
        threads = [threading.Thread(target=busy, daemon=True) for _ in range(24)]
        for th in threads:
            th.start()
        for step in range(30):
            dist.all_reduce(torch.ones(8))
            if step % 10 == 0:
                pid = os.fork()  # a rank that forks (a tool, a checkpoint writer)
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
        stop.set()
        dist.destroy_process_group()
    """,
        addr=f"127.0.0.1:{coordinator.port}",
        name="threads",
    )
    assert job.wait(120) == 0, job.output()[-3000:]
    assert sorted(seen) == [0, 1]
    out = job.output()
    assert "Traceback" not in out
    assert "fork" not in out.lower(), out[-3000:]  # no gRPC fork-handler warnings
    counts = [
        len([c for c in st.history.get("0", []) if c.op == "all_reduce"]) for st in coordinator.job.ranks.values()
    ]
    assert counts == [30, 30]
