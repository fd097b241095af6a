"""The whole bill of the hook: what a rank's process and the coordinator pay per collective.

    .venv/bin/python bench/allin.py              # about 3 minutes on 2 cores
    .venv/bin/python bench/allin.py --quick      # a smoke run, well under a minute
    .venv/bin/python bench/allin.py --ranks 1 --rates 1000 --pairs 5 --calls 20000
    .venv/bin/python bench/allin.py --ranks 1 --baseline /tmp/before   # a change's before and after

``bench/overhead.py`` measures the calling thread's share in isolation (``Recorder.enter`` +
``exit``, the wrapper around a no-op). This script measures everything the hook adds, the way a
user meets it: a real ``hangwatch coordinator`` process started beside the job as the README's
quick start does (it embeds the node agent), and gloo jobs of 1, 2 and 4 ranks (``--ranks``)
whose ranks are fresh processes attached through ``HANGWATCH_ADDR`` (the attach ``.pth``), or
not attached at all (``HANGWATCH_ADDR`` unset: no ``hangwatch`` module is imported). Jobs with
the hook on and off alternate (``--pairs`` pairs, the order flipped every other pair, so drift in
the machine's load hits both sides alike).

Each rank runs, on a 4-element float tensor:

- ``tight``: ``all_reduce`` in a loop, ``--calls`` calls at 1 rank (``--calls / k`` at k ranks),
  and no more than the warm-up's pace fits in ``--tight-seconds`` (slow multi-rank collectives
  on 2 cores keep the run bounded), after a warm-up;
- ``tight, two lines``: the same count of calls, alternating between two ``all_reduce`` lines
  of 4 and 8 floats (a hand-written tensor-parallel layer's two collectives: the node agent sends
  them as runs of a cycle of two signatures), after a warm-up of both;
- ``paced R/s``: ``all_reduce`` on an absolute schedule of R calls per second per rank
  (``--rates``), for about ``--paced-seconds`` seconds, sleeping (never spinning) until the next
  slot, and not at all when behind; the achieved rate is reported (a pace above what the
  tight loop reached cannot be met, and the count is capped so the loop still ends on time).

The windows open once the hook's sender thread has registered with the coordinator (or failed
its first attempt, when it is unreachable): its one-time start-up (importing grpc, the channel)
is not a per-call cost. Per call, read inside each rank around the loop: the process's CPU over all its threads
(``getrusage(RUSAGE_SELF)``: the calling thread, the hook's sender thread, gloo's threads),
counted over the loop plus a ``--settle`` pause after it, so the records the loop left queued
are shipped inside the window; the calling thread's CPU (``time.thread_time``) and the wall
time, over the loop alone; with the hook on, its sender thread's CPU (its thread CPU clock).
Rank 0 reads the coordinator process's CPU (its threads' ``schedstat``) after a barrier before the loop and after
a barrier that ends the window, divided by the calls of all ranks; the coordinator's idle CPU
(measured in the same windows of the jobs with the hook off) is subtracted for the "net" figure.

The "coordinator unreachable" variants (1 rank, tight loop only, alternated with the rest):
``HANGWATCH_ADDR`` at a port where nothing listens (``refused``), and at a
:class:`hangwatch.testing.BlackHole` that accepts connections and never answers (``black hole``);
records pile up in the rank's queue.

Figures are medians over the jobs (each job's figure is the mean over its ranks); "+" is on
minus off, "ratio" is on / off. Printed as a Markdown table, ready for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WARMUP = 200  # calls before the first measured loop (the first call of a kind is flushed at once)
REWARM = 20  # calls before each later loop
TENSOR = 4  # elements, float32
MODES = ("off", "on")
#: the hook with its fast path in Python (``HANGWATCH_NATIVE=0``), beside "on" where the C build exists
PYTHON_MODE = "python"
#: before issue 16's native fast path and runs: the Python fast path, and a second coordinator
#: that takes every call one by one (``HANGWATCH_RUNS=0``)
BEFORE_MODE = "before"
#: the hook as now (C fast path, runs) against a third coordinator whose embedded agent reads
#: every rank's ring every tick and its Flight Recorder ring at every poll (``HANGWATCH_READ_LESS=0``)
EVERY_READ_MODE = "every read"
DEAD_MODES = ("refused", "black hole")
#: the hook of another checkout (``--baseline DIR``: its extension built in place), C and Python
#: fast paths, against the same coordinator: this change's before and after in one run
BASE_ON, BASE_PYTHON = "on, baseline", "python, baseline"
#: the tight loop over two lines that alternate (a cycle of two signatures)
TWO_LINES = "tight, two lines"


# ---- inside a rank --------------------------------------------------------------------------


def _process_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _gc_collections() -> int:
    return sum(int(s["collections"]) for s in gc.get_stats())


class _GcClock:
    """Time the garbage collector spends on the calling thread, and its full (gen 2) runs."""

    def __init__(self) -> None:
        self.main = threading.get_ident()
        self.seconds = 0.0
        self.full = 0
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self.main:
            return
        if phase == "start":
            self._began = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._began
            self.full += info["generation"] == 2


def _cpu_of(pid: int) -> float:
    """CPU seconds of process ``pid``: the sum of its threads' run time in ``schedstat``
    (nanoseconds; ``/proc/<pid>/stat`` and psutil count 10 ms ticks, too coarse for a window in
    which the coordinator spends a few tens of milliseconds). A thread that ended since the last
    reading takes its time with it; the coordinator's threads live as long as it does."""
    task_dir = f"/proc/{pid}/task"
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        tasks = []
    total, read = 0, False
    for task in tasks:
        try:
            with open(f"{task_dir}/{task}/schedstat") as f:
                total += int(f.read().split()[0])
            read = True
        except (OSError, ValueError, IndexError):
            continue
    if read:
        return total / 1e9
    import psutil  # no schedstat (kernel without CONFIG_SCHED_INFO): ticks, better than nothing

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _sender_clock() -> int | None:
    """The hook's sender thread's CPU clock, if this rank has one (None: hook off, or no thread)."""
    if "hangwatch.client.session" not in sys.modules:
        return None
    from hangwatch.client import session

    current = session.current()
    thread = getattr(getattr(current, "sender", None), "_thread", None)
    ident = getattr(thread, "ident", None)
    return None if ident is None else time.pthread_getcpuclockid(ident)


def _slowest(dist: Any, torch: Any, rate: float) -> float:
    """The lowest of the ranks' ``rate`` (a collective outside every measured window)."""
    rates = torch.tensor([rate], dtype=torch.float64)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    return float(rates.item())


def _worker(spec: dict[str, Any]) -> None:
    """One rank: ``spec`` names its rank, world, rendezvous port, mode, workloads and output."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world, mode = int(spec["rank"]), int(spec["world"]), str(spec["mode"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    if mode == "off":
        assert "hangwatch" not in sys.modules, "hook off, yet hangwatch was imported"
    else:
        from hangwatch.client import session
        from hangwatch.testing import wait_for

        current = session.current()
        assert current is not None, "HANGWATCH_ADDR set, yet the hook did not attach"
        # one-time start-up stays out of the windows: linked to the node agent (which then reads
        # the ring), or, with no agent, the sender's first attempt (it imports grpc, registers)
        sender_ = current.sender
        wait_for(
            lambda: current.link is not None or sender_.registered or sender_.send_failures > 0,
            30,
            0.01,
            "the link to the agent or the sender's first attempt",
        )
    coordinator = int(spec["coordinator_pid"]) if rank == 0 and spec["coordinator_pid"] else None

    def coordinator_cpu() -> float:
        return 0.0 if coordinator is None else _cpu_of(coordinator)

    t = torch.ones(TENSOR)
    u = torch.ones(2 * TENSOR)
    all_reduce = dist.all_reduce
    sender = _sender_clock()
    gc_clock = _GcClock()
    results: list[dict[str, Any]] = []
    max_rate = 0.0  # calls/s the slowest rank reached, in the warm-up, then in the tight loop
    for i, (name, rate) in enumerate(spec["workloads"]):
        start = time.perf_counter()
        for _ in range(REWARM if i else WARMUP):
            all_reduce(t)
            if name == TWO_LINES:
                all_reduce(u)
        if not i:
            max_rate = _slowest(dist, torch, WARMUP / (time.perf_counter() - start))
        if rate:
            calls = max(int(min(rate, max_rate) * spec["paced_seconds"]), 10)
        else:  # at most --tight-seconds long, on the warm-up's pace (the same count on every rank)
            calls = max(min(int(spec["calls"]), int(max_rate * spec["tight_seconds"])), 100)
        dist.barrier()
        c0 = coordinator_cpu()
        s0 = time.clock_gettime(sender) if sender is not None else 0.0
        g0, gt0, gf0 = _gc_collections(), gc_clock.seconds, gc_clock.full
        p0, th0, w0 = _process_cpu(), time.thread_time(), time.perf_counter()
        if rate:
            interval = 1.0 / rate
            slot = w0
            for _ in range(calls):
                all_reduce(t)
                slot += interval
                ahead = slot - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
        elif name == TWO_LINES:
            for _ in range(calls // 2):
                all_reduce(t)
                all_reduce(u)
            calls = calls // 2 * 2
        else:
            for _ in range(calls):
                all_reduce(t)
        w1, th1, p1 = time.perf_counter(), time.thread_time(), _process_cpu()
        g1, gt1, gf1 = _gc_collections(), gc_clock.seconds, gc_clock.full
        time.sleep(spec["settle"])  # the records queued at the end are shipped in the window
        p2 = _process_cpu()
        s1 = time.clock_gettime(sender) if sender is not None else 0.0
        dist.barrier()
        c1 = coordinator_cpu()
        results.append(
            {
                "workload": name,
                "calls": calls,
                "wall_s": w1 - w0,
                "thread_cpu_s": th1 - th0,
                "process_cpu_loop_s": p1 - p0,
                "process_cpu_s": p2 - p0,
                "sender_cpu_s": s1 - s0 if sender is not None else None,
                "gc_collections": g1 - g0,
                "gc_thread_cpu_s": gt1 - gt0,
                "gc_full": gf1 - gf0,
                "window_s": time.perf_counter() - w0,
                "coordinator_cpu_s": c1 - c0 if coordinator is not None else None,
            }
        )
        if not rate:
            max_rate = _slowest(dist, torch, calls / (w1 - w0))
    if mode in ("on", PYTHON_MODE, BEFORE_MODE, EVERY_READ_MODE, BASE_ON, BASE_PYTHON):  # it served the calls
        import hangwatch
        from hangwatch.client import capture

        results[-1]["hook_file"] = hangwatch.__file__
        served = getattr(all_reduce, "served", None)
        if mode in (PYTHON_MODE, BEFORE_MODE, BASE_PYTHON):
            assert served is None, "HANGWATCH_NATIVE=0, yet the C fast path wrapped all_reduce"
        elif capture._native is not None:
            assert served, "the C fast path is built, yet it served no call"
    Path(spec["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()


# ---- the driver -----------------------------------------------------------------------------


class _Coordinator:
    """A ``hangwatch coordinator`` process, as the README's quick start starts it; its output is
    drained by a thread (a full pipe would stall it) and kept for a failure's message."""

    def __init__(self, data_dir: str, env: dict[str, str] | None = None) -> None:
        from hangwatch.testing import start_coordinator_cli

        self.addr, self.proc = start_coordinator_cli(data_dir, env=env)
        self.output: list[str] = []
        self._drain = threading.Thread(target=self._read, name="coordinator-output", daemon=True)
        self._drain.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output = [*self.output[-50:], line]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _run_job(
    mode: str,
    world: int,
    addr: str | None,
    coordinator_pid: int,
    workloads: Sequence[tuple[str, int]],
    args: argparse.Namespace,
    job_id: str,
) -> list[list[dict[str, Any]]]:
    """One job of ``world`` fresh rank processes; each rank's list of workload results."""
    from hangwatch.testing import free_port, job_env

    port = free_port()
    native_off = {"HANGWATCH_NATIVE": "0"} if mode in (PYTHON_MODE, BEFORE_MODE, BASE_PYTHON) else {}
    extra = {**args.hook_env, **native_off} if addr else {}
    env = job_env(addr, {"HANGWATCH_JOB_ID": job_id, **extra})
    if mode in (BASE_ON, BASE_PYTHON):  # the baseline's package first on the ranks' path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.baseline, env.get("PYTHONPATH")) if p)
    procs: list[tuple[subprocess.Popen[str], str]] = []
    with tempfile.TemporaryDirectory() as d:
        for rank in range(world):
            out = os.path.join(d, f"rank{rank}.json")
            spec = {
                "rank": rank,
                "world": world,
                "port": port,
                "mode": mode,
                "workloads": list(workloads),
                "calls": max(args.calls // world, 100),
                "paced_seconds": args.paced_seconds,
                "tight_seconds": args.tight_seconds,
                "settle": args.settle,
                "coordinator_pid": coordinator_pid,
                "out": out,
            }
            cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
            procs.append(
                (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
            )
        results = []
        for proc, out in procs:
            try:
                output, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                raise AssertionError(f"{mode} job of {world} ranks did not finish in 300 s") from None
            if proc.returncode != 0 or not os.path.exists(out):
                for p, _ in procs:
                    p.kill()
                raise AssertionError(f"{mode} rank of {world} failed ({proc.returncode}):\n{output[-4000:]}")
            results.append(json.loads(Path(out).read_text()))
        if mode in (BASE_ON, BASE_PYTHON):
            hooks = {w["hook_file"] for rank in results for w in rank if "hook_file" in w}
            assert hooks and all(h.startswith(str(args.baseline)) for h in hooks), f"baseline ranks imported {hooks}"
        return results


def _job_figures(ranks: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per workload: per-call figures averaged over the ranks, and rank 0's coordinator reading."""
    figures: dict[str, dict[str, float]] = {}
    for i, first in enumerate(ranks[0]):
        per_rank = [rank[i] for rank in ranks]
        total_calls = sum(r["calls"] for r in per_rank)

        def mean(key: str, per_rank: list[dict[str, Any]] = per_rank) -> float:
            return statistics.fmean(r[key] / r["calls"] * 1e6 for r in per_rank)

        fig = {
            "process_us": mean("process_cpu_s"),
            "process_loop_us": mean("process_cpu_loop_s"),
            "thread_us": mean("thread_cpu_s"),
            "wall_us": mean("wall_s"),
            "rate": statistics.fmean(r["calls"] / r["wall_s"] for r in per_rank),
            "gc_per_1k_calls": statistics.fmean(r["gc_collections"] / r["calls"] * 1e3 for r in per_rank),
            "gc_full_per_1k_calls": statistics.fmean(r["gc_full"] / r["calls"] * 1e3 for r in per_rank),
            "gc_us": mean("gc_thread_cpu_s"),
            "coordinator_s": first["coordinator_cpu_s"],
            "window_s": first["window_s"],
            "total_calls": total_calls,
        }
        if first["sender_cpu_s"] is not None:
            fig["sender_us"] = mean("sender_cpu_s")
        figures[first["workload"]] = fig
    return figures


def _fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _row_cells(off: list[dict[str, float]], on: list[dict[str, float]], key: str) -> tuple[str, str, str, str]:
    a = statistics.median(f[key] for f in off)
    b = statistics.median(f[key] for f in on)
    return _fmt(a), _fmt(b), f"{b - a:+.1f}", f"{b / a:.2f}x"


def _report(
    results: dict[tuple[int, str, str], list[dict[str, float]]],
    args: argparse.Namespace,
    workloads: Sequence[tuple[str, int]],
) -> None:
    print(
        "\n| ranks | workload | calls/s per rank, off / on | process CPU µs/call: off / on / + / ratio "
        "| calling thread CPU µs/call: off / on / + / ratio | wall µs/call: off / on / + / ratio "
        "| sender thread µs/call (on) | hook's process CPU, % of a core | coordinator µs/call (net of idle) "
        "| all in µs/call (process + coordinator) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for world in args.ranks:
        for name, rate in workloads:
            off = results.get((world, "off", name), [])
            if not off:
                continue
            idle = statistics.median(f["coordinator_s"] / f["window_s"] for f in off)  # CPU s per s
            for mode in (BEFORE_MODE, EVERY_READ_MODE, BASE_ON, "on", BASE_PYTHON, PYTHON_MODE, *DEAD_MODES):
                on = results.get((world, mode, name), [])
                if not on:
                    continue
                rate_off = statistics.median(f["rate"] for f in off)
                rate_on = statistics.median(f["rate"] for f in on)
                pace = f"{rate_off:,.0f} / {rate_on:,.0f}"
                if rate:
                    reached = "reached" if rate_on >= 0.95 * rate and rate_off >= 0.95 * rate else "NOT reached"
                    pace += f" (target {rate:,}: {reached})"
                proc = _row_cells(off, on, "process_us")
                added = statistics.median(f["process_us"] for f in on) - statistics.median(f["process_us"] for f in off)
                share = added * rate_on / 1e4  # µs per call * calls per s → % of one core
                coord_raw = statistics.median(f["coordinator_s"] / f["total_calls"] * 1e6 for f in on)
                coord_net = statistics.median(
                    (f["coordinator_s"] - idle * f["window_s"]) / f["total_calls"] * 1e6 for f in on
                )
                sender = [f["sender_us"] for f in on if "sender_us" in f]
                label = {
                    PYTHON_MODE: f"{name}, fast path in Python (HANGWATCH_NATIVE=0)",
                    BEFORE_MODE: f"{name}, before: fast path in Python, no runs, every read",
                    EVERY_READ_MODE: f"{name}, every read (HANGWATCH_READ_LESS=0)",
                    BASE_ON: f"{name}, baseline",
                    BASE_PYTHON: f"{name}, baseline, fast path in Python (HANGWATCH_NATIVE=0)",
                }.get(mode, name)
                reachable = results.get((world, "on", name), [])
                if mode in DEAD_MODES and reachable:  # what the outage adds to the hook's usual cost
                    more = statistics.median(f["thread_us"] for f in on) - statistics.median(
                        f["thread_us"] for f in reachable
                    )
                    label = f"{name}, coordinator unreachable ({mode}): calling thread {more:+.1f} µs vs reachable"
                print(
                    f"| {world} | {label} | {pace} | {' / '.join(proc)} "
                    f"| {' / '.join(_row_cells(off, on, 'thread_us'))} "
                    f"| {' / '.join(_row_cells(off, on, 'wall_us'))} "
                    f"| {_fmt(statistics.median(sender) if sender else None)} "
                    f"| {share:.1f} % "
                    f"| {coord_net:.1f} ({coord_raw:.1f} raw, idle {idle * 100:.1f} % of a core) "
                    f"| {'-' if mode in DEAD_MODES else f'{added + coord_net:.1f}'} |"
                )
    print(
        "\ngarbage collector, tight loop (medians): runs in any thread / full runs on the calling thread per 1,000 "
        "calls, and its CPU µs/call on the calling thread"
    )
    for (world, mode, name), figs in sorted(results.items()):
        if name == "tight":
            print(
                f"  {world} rank(s), {mode:<10}: {statistics.median(f['gc_per_1k_calls'] for f in figs):.1f} / "
                f"{statistics.median(f['gc_full_per_1k_calls'] for f in figs):.2f} runs, "
                f"{statistics.median(f['gc_us'] for f in figs):.2f} µs/call"
            )


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10000, help="tight-loop calls per rank at 1 rank (N/k at k ranks)")
    ap.add_argument("--pairs", type=int, default=3, help="on/off job pairs per rank count, alternated")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated")
    ap.add_argument("--rates", default="1000,10000,20000", help="paced loops, calls/s per rank, comma-separated")
    ap.add_argument("--tight-seconds", type=float, default=1.5, help="cap on the tight loop's length")
    ap.add_argument("--paced-seconds", type=float, default=0.6, help="length of each paced loop")
    ap.add_argument("--settle", type=float, default=0.3, help="pause after a loop, inside the process-CPU window")
    ap.add_argument("--no-unreachable", action="store_true", help="skip the coordinator-unreachable variants")
    ap.add_argument(
        "--hook-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the hooked ranks only (repeatable), e.g. HANGWATCH_FLIGHT_RECORDER=0",
    )
    ap.add_argument(
        "--no-python", action="store_true", help="skip the hook with its fast path in Python (HANGWATCH_NATIVE=0)"
    )
    ap.add_argument(
        "--no-before", action="store_true", help="skip the hook as it was before issue 16 (Python fast path, no runs)"
    )
    ap.add_argument(
        "--no-every-read",
        action="store_true",
        help="skip the hook as now against an agent that reads every ring every time (HANGWATCH_READ_LESS=0)",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also the hook of another checkout (its extension built in place), C and Python, e.g. the "
        "commit before a change: `git worktree add DIR REV` then `python hatch_build.py` there",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 pair, fewer calls, shorter loops")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = [int(x) for x in args.ranks.split(",") if x]
    args.rates = [int(x) for x in args.rates.split(",") if x]
    args.hook_env = dict(item.split("=", 1) for item in args.hook_env)
    if args.quick:
        args.pairs, args.calls, args.tight_seconds, args.paced_seconds, args.settle = 1, 2000, 0.5, 0.2, 0.25
    return args


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    import torch

    from hangwatch.testing import BlackHole, free_port

    # the ranks and the coordinator import this checkout's hangwatch, whatever is installed
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    workloads: list[tuple[str, int]] = [("tight", 0), (TWO_LINES, 0)] + [(f"paced {r:,}/s", r) for r in args.rates]
    results: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    try:
        from hangwatch.client import _fastpath  # type: ignore[attr-defined]  # noqa: F401

        native = True
    except ImportError:
        native = False
    began = time.time()
    load = os.getloadavg()
    jobs = 0
    with tempfile.TemporaryDirectory() as data, BlackHole() as hole:
        coordinator = _Coordinator(data)
        before = _Coordinator(data + "/before", {"HANGWATCH_RUNS": "0", "HANGWATCH_READ_LESS": "0"})
        every = _Coordinator(data + "/every", {"HANGWATCH_READ_LESS": "0"})
        refused = f"127.0.0.1:{free_port()}"
        try:
            for world in args.ranks:
                for pair in range(args.pairs):
                    modes: list[str] = list(MODES)
                    if native and not args.no_python:
                        modes.append(PYTHON_MODE)
                    if not args.no_before:
                        modes.append(BEFORE_MODE)
                    if not args.no_every_read:
                        modes.append(EVERY_READ_MODE)
                    if args.baseline:
                        modes += [BASE_ON, BASE_PYTHON]
                    if world == 1 and not args.no_unreachable:
                        modes += DEAD_MODES
                    if pair % 2:
                        modes.reverse()  # off, on, … then …, on, off: linear drift cancels
                    for mode in modes:
                        addr = {
                            "off": None,
                            "on": coordinator.addr,
                            PYTHON_MODE: coordinator.addr,
                            BASE_ON: coordinator.addr,
                            BASE_PYTHON: coordinator.addr,
                            BEFORE_MODE: before.addr,
                            EVERY_READ_MODE: every.addr,
                            "refused": refused,
                            "black hole": hole.addr,
                        }[mode]
                        wl = workloads[:1] if mode in DEAD_MODES else workloads
                        jobs += 1
                        started = time.time()
                        pid = {BEFORE_MODE: before, EVERY_READ_MODE: every}.get(mode, coordinator).proc.pid
                        ranks = _run_job(mode, world, addr, pid, wl, args, f"allin-{jobs}")
                        for name, fig in _job_figures(ranks).items():
                            results.setdefault((world, mode, name), []).append(fig)
                        print(
                            f"  {world} rank(s), {mode:<10} pair {pair + 1}/{args.pairs}: "
                            f"{time.time() - started:.1f} s",
                            file=sys.stderr,
                        )
            for c in (coordinator, before, every):
                if c.proc.poll() is not None:
                    raise AssertionError("a coordinator died:\n" + "".join(c.output))
        finally:
            for c in (coordinator, before, every):
                c.stop()
    print(
        f"\nhangwatch all-in overhead — {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average at start "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )
    print(
        f"gloo, all_reduce of {TENSOR} floats, {args.pairs} on/off job pairs per rank count, fresh processes, "
        f"tight loop {args.calls:,} calls at 1 rank (÷ ranks), paced loops ~{args.paced_seconds} s; "
        "medians over jobs"
    )
    _report(results, args, workloads)
    end_load = os.getloadavg()
    print(
        f"\n{jobs} jobs; run took {time.time() - began:.0f} s; load average at the end "
        f"{end_load[0]:.2f} / {end_load[1]:.2f} / {end_load[2]:.2f}"
    )


if __name__ == "__main__":
    main()
