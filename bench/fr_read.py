"""What reading Flight Recorder costs the rank: from inside (the old sender-thread poller) vs from
outside (the node agent through the rank's worker server).

One gloo rank (world size 1) fills its CPU ring with ``--entries`` all_reduce calls, starts its
worker server as the hook does, and then idles while the parent reads its ring ``--reads`` times
through the server (the agent's ``read_rings``), measuring the rank process's CPU (all threads,
from ``/proc``) and the round trip; then the rank reads its own ring as many times with torch's
``_dump_fr_trace_json`` + ``json.loads`` (what the in-rank poller did, on a Python thread under
the rank's GIL) and reports its CPU per read. Both in one run, side by side, medians of
``--repeats`` rounds.

    .venv/bin/python bench/fr_read.py --entries 256 --reads 200 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

from hangwatch.agent.frquery import read_rings

RANK = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ.update(TORCH_FR_BUFFER_SIZE=sys.argv[2], MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1],
                      RANK="0", WORLD_SIZE="1")
    import torch, torch.distributed as dist
    from hangwatch.client import workerserver
    dist.init_process_group("gloo")
    t = torch.ones(4)
    for _ in range(int(sys.argv[2])):
        dist.all_reduce(t)
    ws = workerserver.start(workerserver.planned_path())
    print(ws.path, flush=True)
    dump = torch._C._distributed_c10d._dump_fr_trace_json
    for line in sys.stdin:
        n = int(line)
        if n == 0:
            break
        c0 = time.thread_time()
        for _ in range(n):
            json.loads(dump(True, False))
        print((time.thread_time() - c0) / n, flush=True)
    ws.stop()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=256)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = dict(os.environ, XDG_RUNTIME_DIR=tempfile.mkdtemp())
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, str(_free_port()), str(args.entries)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert rank.stdin is not None and rank.stdout is not None
    try:
        path = rank.stdout.readline().strip()
        proc = psutil.Process(rank.pid)
        time.sleep(0.5)
        outside_cpu, outside_wall, inside_cpu = [], [], []
        entries = 0
        for _ in range(args.repeats):
            c0, w0 = _cpu(proc), time.perf_counter()
            for _ in range(args.reads):
                rings, errors = read_rings(path, rank.pid)
                assert not errors, errors
                entries = len(rings["cpu"]["entries"])
            outside_wall.append((time.perf_counter() - w0) / args.reads)
            outside_cpu.append((_cpu(proc) - c0) / args.reads)
            rank.stdin.write(f"{args.reads}\n")
            rank.stdin.flush()
            inside_cpu.append(float(rank.stdout.readline()))
        rank.stdin.write("0\n")
        rank.stdin.flush()
    finally:
        rank.wait(30)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.2f} ms"

    print(f"one read of a {entries}-entry CPU ring, medians of {args.repeats} x {args.reads} reads:")
    print(f"  inside the rank (dump + json.loads on a Python thread, GIL held): {ms(inside_cpu)} of rank CPU")
    print(f"  from outside (worker server, C++ thread, no GIL):                 {ms(outside_cpu)} of rank CPU")
    print(f"  the agent's round trip (request, JSON parse in the agent):        {ms(outside_wall)}")
    ratio = statistics.median(outside_cpu) / max(statistics.median(inside_cpu), 1e-9)
    print(f"  rank CPU per read, outside / inside: {ratio:.2f}")


if __name__ == "__main__":
    main()
