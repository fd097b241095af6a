"""The job never pays: a coordinator killed with SIGKILL mid-training and restarted, and a
black-holed coordinator that accepts connections but never answers. Real processes throughout."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hangwatch.testing import BIN, BlackHole, Job, free_port, start_coordinator_cli, wait_for

pytestmark = pytest.mark.slow

TRAIN = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
pair = dist.new_group([0, 1])
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
hang_file = os.environ.get("HANG_FILE", "")
steps = int(os.environ.get("STEPS", "100000"))
times = []
for step in range(steps):
    t0 = time.perf_counter()
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    times.append(time.perf_counter() - t0)
    if hang_file and os.path.exists(hang_file) and rank == 1:
        def stuck_after_restart():
            time.sleep(600)
        stuck_after_restart()
    dist.all_reduce(torch.ones(1), group=pair)  # a subgroup made before the restart
    time.sleep(0.02)
print(f"rank {rank} done; median step {sorted(times)[len(times)//2]*1e3:.2f} ms", flush=True)
dist.destroy_process_group()
"""


def _start_coordinator(tmp_path: Path, port: int) -> subprocess.Popen[str]:
    return start_coordinator_cli(tmp_path / "data", port, stuck_after=3.0, cwd=tmp_path)[1]


def _cli_json(addr: str, *args: str) -> object:
    out = subprocess.run(
        [str(BIN / "hangwatch"), *args, "--json", "--addr", addr], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_coordinator_sigkill_and_restart(tmp_path: Path, torchrun: Callable[..., Job]) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    hang_file = tmp_path / "hang-now"
    coord = _start_coordinator(tmp_path, port)
    job = torchrun(TRAIN, addr=addr, env={"HANG_FILE": str(hang_file)}, name="train")
    wait_for(lambda: len(_cli_json(addr, "status")["ranks"]) == 2, 60, 0.5, "registration")  # type: ignore[index]
    before = {i["id"] for i in _cli_json(addr, "incidents")}  # type: ignore[union-attr]
    coord.send_signal(signal.SIGKILL)
    coord.wait(10)
    time.sleep(3.0)  # ranks train on with nobody listening
    assert job.proc.poll() is None, job.output()[-3000:]
    coord = _start_coordinator(tmp_path, port)
    restarted_at = time.monotonic()  # serving from here on
    try:
        wait_for(lambda: len(_cli_json(addr, "status")["ranks"]) == 2, 10, 0.2, "re-registration")  # type: ignore[index]
        assert time.monotonic() - restarted_at < 5
        # detection works for a hang that starts after the restart
        hang_file.write_text("x")
        inc = wait_for(
            lambda: [i for i in _cli_json(addr, "incidents") if i["kind"] == "stuck_collective"],  # type: ignore[union-attr]
            40,
            0.5,
            "a stuck incident after the restart",
        )[0]
        assert inc["culprit_ranks"] == [1]
        assert inc["group"] != "0"  # the subgroup's members were announced again after the restart
        assert "Traceback" not in job.output()
    finally:
        job.kill()
        coord.terminate()
        coord.wait(10)
    # incidents stored before a SIGKILL survive it
    coord = _start_coordinator(tmp_path, port)
    try:
        stored = {i["id"] for i in _cli_json(addr, "incidents")}  # type: ignore[union-attr]
        assert before | {inc["id"]} <= stored
    finally:
        coord.send_signal(signal.SIGKILL)
        coord.wait(10)


def test_black_holed_coordinator_costs_the_job_nothing(tmp_path: Path, torchrun: Callable[..., Job]) -> None:
    with BlackHole() as hole:  # accepts TCP connections, never answers a byte
        start = time.monotonic()
        job = torchrun(TRAIN, addr=hole.addr, env={"STEPS": "150"}, name="hole")
        assert job.wait(120) == 0, job.output()[-3000:]
        assert time.monotonic() - start < 90
        assert "Traceback" not in job.output()
        assert job.output().count("done; median step") == 2
        assert hole.accepted, "the ranks never connected: this test would prove nothing"
