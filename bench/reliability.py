"""The job never pays: step times while the coordinator is up, SIGKILLed and restarted, and a
rank's memory while its coordinator is a black hole. Real torchrun/gloo jobs, side by side.

    .venv/bin/python bench/reliability.py        # about 1.5 minutes

(1) one 2-rank DDP job runs for 36 s; its coordinator (a real ``hangwatch coordinator`` process)
    is SIGKILLed at 12 s and restarted at 24 s: median step time in each phase, and the ratios.
(2) one 2-rank job all_reduces 1 KB as fast as it can for 20 s against a coordinator that accepts
    connections and never answers: the rank's RSS over time and the events it dropped.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from hangwatch.testing import BlackHole, Job, free_port, start_coordinator_cli, torchrun

DDP = """
import datetime, json, os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
out, start = [], time.time()
while True:
    done = torch.tensor([float(time.time() - start >= float(os.environ["SECONDS_TO_RUN"]))])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)  # the ranks stop together, not one step apart
    if done.item():
        break
    t0 = time.perf_counter()
    opt.zero_grad(); model(x).sum().backward(); opt.step()
    dist.all_reduce(torch.ones(4))
    out.append((time.time(), time.perf_counter() - t0))
if rank == 0:
    json.dump(out, open(os.environ["OUT"], "w"))
dist.destroy_process_group()
"""

FLOOD = """
import datetime, json, os, time, psutil, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
from hangwatch.client import session
t, me, samples, start = torch.ones(256), psutil.Process(), [], time.time()
calls = 0
while True:
    if calls % 1000 == 0:  # the ranks stop together (the same call count on every rank)
        done = torch.tensor([float(time.time() - start >= 20)])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break
    dist.all_reduce(t); calls += 1
    if calls % 2000 == 0:
        s = session.current()
        lost = s.sender.ring_counts()[1] if s else -1
        samples.append((round(time.time() - start, 1), me.memory_info().rss, lost, calls))
if dist.get_rank() == 0:
    json.dump(samples, open(os.environ["OUT"], "w"))
dist.destroy_process_group()
"""


def _coordinator(port: int, data: str) -> subprocess.Popen[str]:
    return start_coordinator_cli(data, port, stderr=subprocess.DEVNULL)[1]


def _torchrun(script: str, env: dict[str, str], cwd: str) -> Job:
    """A 2-rank torchrun job running ``script`` (its output discarded)."""
    path = Path(cwd) / "job.py"
    path.write_text(textwrap.dedent(script))
    return torchrun(path, env=env, cwd=cwd)


def restart_phases() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        coord = _coordinator(port, os.path.join(tmp, "data"))
        out = os.path.join(tmp, "steps.json")
        env = dict(os.environ, HANGWATCH_ADDR=f"127.0.0.1:{port}", OMP_NUM_THREADS="1", SECONDS_TO_RUN="36", OUT=out)
        job = _torchrun(DDP, env, tmp)
        time.sleep(8)  # startup
        t_kill = time.time() + 12 - 8
        time.sleep(max(0.0, t_kill - time.time()))
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        killed_at = time.time()
        time.sleep(12)
        coord = _coordinator(port, os.path.join(tmp, "data"))
        restarted_at = time.time()
        code = job.wait(120)
        coord.terminate()
        coord.wait(10)
        steps = json.loads(Path(out).read_text())
    phases = {
        "coordinator up": [d for t, d in steps if t < killed_at],
        "coordinator SIGKILLed": [d for t, d in steps if killed_at <= t < restarted_at],
        "coordinator restarted": [d for t, d in steps if t >= restarted_at + 3],
    }
    base = statistics.median(phases["coordinator up"])
    print(f"(1) DDP step time across a coordinator SIGKILL and restart (job exit code {code})")
    for name, values in phases.items():
        med = statistics.median(values)
        print(f"    {name:<24} {med * 1e3:7.2f} ms median over {len(values):5d} steps   ratio {med / base:.3f}")


def black_hole() -> None:
    with BlackHole() as hole, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rss.json")
        env = dict(
            os.environ,
            HANGWATCH_ADDR=hole.addr,
            OMP_NUM_THREADS="1",
            OUT=out,
            HANGWATCH_QUEUE_SIZE=os.environ.get("HANGWATCH_QUEUE_SIZE", "65536"),
        )
        code = _torchrun(FLOOD, env, tmp).wait(120)
        samples = json.loads(Path(out).read_text())
    print(f"\n(2) a rank flooding collectives at a black-holed coordinator for 20 s (job exit code {code})")
    print("    t (s)   RSS (MiB)   events dropped   calls")
    for i, (t, rss, dropped, calls) in enumerate(samples):
        if i % max(1, len(samples) // 8) == 0 or i == len(samples) - 1:
            print(f"    {t:5.1f}   {rss / 2**20:9.1f}   {dropped:14d}   {calls:5d}")
    rss = [s[1] for s in samples]
    half = len(rss) // 2
    print(
        f"    RSS growth over the second half: {(max(rss[half:]) - rss[half]) / 2**20:.1f} MiB (bounded ring: "
        "it fills, then overwrites the oldest and counts)"
    )


def main() -> None:
    print(f"hangwatch reliability bench — Python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    restart_phases()
    black_hole()


if __name__ == "__main__":
    main()
