"""What the hook costs, measured side by side in one run on a 2-rank gloo job (CPU).

    .venv/bin/python bench/overhead.py            # about 1-2 minutes on 2 cores

(a) time added per collective on the calling thread: ``Recorder.enter``+``exit`` alone, and a
    4 KB ``all_reduce`` through the wrapper with the hook recording vs the unwrapped function
    (interleaved rounds, medians); (b) DDP step time, hook on vs off; (c) ``all_reduce`` under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; (d) Accelerate debug mode if installed; (e) interpreter
    start with ``HANGWATCH_ADDR`` unset / set, and with no site hook at all (``python -S``).
The ranks are spawned by this script (``torch.multiprocessing.spawn``) and report to an
in-process coordinator, as a real job would.

This is the calling thread's share. The whole bill per collective (the rank's process over all
its threads, the wall time, and the coordinator process's CPU, hook on vs off in fresh processes)
is ``bench/allin.py``.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hangwatch.testing import free_port

ROUNDS = 15  # interleaved on/off rounds for the all_reduce comparison
CALLS = 60  # all_reduce calls per round
MICRO = 20000  # Recorder.enter+exit calls
DDP_STEPS = 120
DDP_PAIRS = 5  # on/off job pairs, alternated, for the DDP step-time ratio
STARTS = 20


def _per_call(fn: Any, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def _worker(rank: int, mode: str, port: int, addr: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if mode == "detail":
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if mode in ("on", "ddp-on"):
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")  # what the bootstrap sets
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if mode in ("on", "ddp-on"):
        import hangwatch.client

        assert hangwatch.client.attach(addr)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    result: dict[str, Any] = {}
    t = torch.ones(1024)  # 4 KB
    for _ in range(20):
        dist.all_reduce(t)
    if mode.startswith("ddp-"):
        pass
    elif mode == "on":
        from hangwatch.client import capture, session
        from hangwatch.client.ops import OPS_BY_NAME

        sess = session.current()
        assert sess is not None
        original = capture._originals["all_reduce"]
        on_times, off_times = [], []
        for _ in range(ROUNDS):
            on_times.append(_per_call(lambda: dist.all_reduce(t), CALLS))
            off_times.append(_per_call(lambda: original(t), CALLS))
        result["all_reduce_on_us"] = statistics.median(on_times) * 1e6
        result["all_reduce_off_us"] = statistics.median(off_times) * 1e6
        dist.barrier()
        # the hot path alone: enter + exit, on rank 0 only (no communication involved)
        if rank == 0:
            # a private recorder and ring: these calls are not sent to the coordinator
            from hangwatch.client.recorder import Recorder
            from hangwatch.client.ringsink import RingSink

            rec, spec = Recorder(rank, RingSink(1 << 16), sess.recorder.c10d), OPS_BY_NAME["all_reduce"]
            params = {"tensor": t}

            def one() -> None:
                entered = rec.enter(spec, params)
                rec.exit(*entered, None)

            samples = []
            for _ in range(10):
                samples.append(_per_call(one, MICRO // 10))
            result["enter_exit_us"] = statistics.median(samples) * 1e6
            # the full wrapper around a no-op original, minus the bare no-op
            wrapped = capture._wrap_op(spec, lambda tensor, op=None, group=None, async_op=False: None)
            # registered, so the steady-state novel-signature check is paid as in a real rank (the
            # first call's flush is answered at once; every later call repeats its signature)
            sender = type("Snd", (), {"registered": True, "flush": lambda self, timeout: True})()
            fake = type("S", (), {"recorder": rec, "sender": sender, "fail": lambda *a: None})()
            capture.set_session(fake)

            def bare(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
                return None

            w, b = [], []
            for _ in range(10):
                w.append(_per_call(lambda: wrapped(t), MICRO // 10))
                b.append(_per_call(lambda: bare(t), MICRO // 10))
            result["wrapper_noop_us"] = (statistics.median(w) - statistics.median(b)) * 1e6
            capture.set_session(sess)
        dist.barrier()
    elif mode == "detail":
        result["all_reduce_detail_us"] = (
            statistics.median(_per_call(lambda: dist.all_reduce(t), CALLS) for _ in range(ROUNDS // 2)) * 1e6
        )
    else:
        result["all_reduce_plain_us"] = (
            statistics.median(_per_call(lambda: dist.all_reduce(t), CALLS) for _ in range(ROUNDS // 2)) * 1e6
        )
    if mode.startswith("ddp-"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        layers = [torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU()]
        model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(512, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 512), torch.randn(64, 10)
        steps = []
        sender_cpu = None
        if mode == "ddp-on":
            from hangwatch.client import session as session_mod

            thread = session_mod.current().sender._thread  # type: ignore[union-attr]
            clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[union-attr, arg-type]
        for i in range(DDP_STEPS + 10):
            if i == 10 and mode == "ddp-on":
                sender_cpu = time.clock_gettime(clock)
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if i >= 10:
                steps.append(time.perf_counter() - start)
        result["ddp_step_ms"] = statistics.median(steps) * 1e3
        if sender_cpu is not None:
            # CPU the hook's background thread used per training step (it competes for the cores)
            result["sender_cpu_ms_per_step"] = (time.clock_gettime(clock) - sender_cpu) / DDP_STEPS * 1e3
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _accelerate_worker(rank: int, port: int, out: str) -> None:
    """Accelerate's ``reduce`` of 4 KB, timed; debug mode comes from ACCELERATE_DEBUG_MODE."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch
    from accelerate import PartialState
    from accelerate.utils import reduce

    state = PartialState(cpu=True)
    t = torch.ones(1024)
    for _ in range(20):
        reduce(t)
    median = statistics.median(_per_call(lambda: reduce(t), CALLS) for _ in range(ROUNDS // 2)) * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps({"debug": state.debug, "reduce_us": median}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # leaving with gloo threads alive can abort


def _run_accelerate(debug: bool) -> dict[str, Any]:
    import torch.multiprocessing as mp

    os.environ["ACCELERATE_DEBUG_MODE"] = "1" if debug else "0"
    try:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "result.json")
            mp.spawn(_accelerate_worker, args=(free_port(), out), nprocs=2, join=True)
            return dict(json.loads(Path(out).read_text()))
    finally:
        del os.environ["ACCELERATE_DEBUG_MODE"]


def _run_job(mode: str, addr: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(_worker, args=(mode, free_port(), addr, out), nprocs=2, join=True)
        return dict(json.loads(Path(out).read_text()))


def _start_times() -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    variants = {
        "no site hook (python -S)": ([sys.executable, "-S", "-c", "pass"], env),
        "HANGWATCH_ADDR unset": ([sys.executable, "-c", "pass"], env),
        "HANGWATCH_ADDR set": ([sys.executable, "-c", "pass"], {**env, "HANGWATCH_ADDR": "127.0.0.1:1"}),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(STARTS):  # interleaved
        for name, (cmd, e) in variants.items():
            start = time.perf_counter()
            subprocess.run(cmd, env=e, check=True)
            samples[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def _pth_line_us() -> float:
    """The attach .pth line itself with HANGWATCH_ADDR unset: what every interpreter pays."""
    import timeit

    line = (Path(__file__).resolve().parent.parent / "hangwatch_attach.pth").read_text().strip()
    code = compile(line, "hangwatch_attach.pth", "exec")
    saved = os.environ.pop("HANGWATCH_ADDR", None)
    try:
        return min(timeit.repeat(lambda: exec(code, {}), number=10000, repeat=5)) / 10000 * 1e6
    finally:
        if saved is not None:
            os.environ["HANGWATCH_ADDR"] = saved


def main() -> None:
    import torch

    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    began = time.time()
    ddp_on: list[float] = []
    ddp_off: list[float] = []
    sender_cpu: list[float] = []
    with tempfile.TemporaryDirectory() as data:
        coordinator = Coordinator(CoordinatorOptions(host="127.0.0.1", port=0, data_dir=data))
        coordinator.start()
        try:
            on = _run_job("on", coordinator.addr)
            for _ in range(DDP_PAIRS):  # alternate, so drift in the machine's load hits both sides
                ddp_off.append(_run_job("ddp-off", "")["ddp_step_ms"])
                result = _run_job("ddp-on", coordinator.addr)
                ddp_on.append(result["ddp_step_ms"])
                sender_cpu.append(result["sender_cpu_ms_per_step"])
        finally:
            coordinator.stop(grace=0.2)
    off = _run_job("off", "")
    off["ddp_step_ms"] = statistics.median(ddp_off)
    on["ddp_step_ms"] = statistics.median(ddp_on)
    # torch reads the debug level when the spawned child imports it, before _worker runs
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        detail = _run_job("detail", "")
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    starts = _start_times()
    accelerate = None
    if importlib.util.find_spec("accelerate") is not None:
        plain, debug = _run_accelerate(False), _run_accelerate(True)
        assert debug["debug"] and not plain["debug"]
        accelerate = (plain["reduce_us"], debug["reduce_us"])

    added = on["all_reduce_on_us"] - on["all_reduce_off_us"]
    print(f"\nhangwatch overhead — torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print("gloo, 2 ranks on one host, 4 KB all_reduce; medians\n")
    rows = [
        ("(a) Recorder.enter + exit (hot path alone)", f"{on['enter_exit_us']:.2f} µs", "target ≤ 5 µs"),
        ("(a) wrapper around a no-op (minus bare call)", f"{on['wrapper_noop_us']:.2f} µs", "target ≤ 5 µs"),
        ("(a) all_reduce, unwrapped", f"{on['all_reduce_off_us']:.1f} µs", ""),
        ("(a) all_reduce, hook recording", f"{on['all_reduce_on_us']:.1f} µs", f"Δ {added:+.1f} µs"),
        ("(a) all_reduce, no hook (separate job)", f"{off['all_reduce_plain_us']:.1f} µs", ""),
        ("(b) DDP step, no hook", f"{off['ddp_step_ms']:.3f} ms", f"jobs: {', '.join(f'{v:.2f}' for v in ddp_off)}"),
        (
            "(b) DDP step, hook on",
            f"{on['ddp_step_ms']:.3f} ms",
            f"ratio {on['ddp_step_ms'] / off['ddp_step_ms']:.3f} (target ≤ 1.01); "
            f"jobs: {', '.join(f'{v:.2f}' for v in ddp_on)}",
        ),
        (
            "(b) hook's sender thread CPU per DDP step",
            f"{statistics.median(sender_cpu):.3f} ms",
            f"{statistics.median(sender_cpu) / off['ddp_step_ms'] * 100:.2f} % of a step (background, not the "
            "calling thread)",
        ),
        (
            "(c) all_reduce, TORCH_DISTRIBUTED_DEBUG=DETAIL",
            f"{detail['all_reduce_detail_us']:.1f} µs",
            f"ratio {detail['all_reduce_detail_us'] / off['all_reduce_plain_us']:.2f} vs no hook",
        ),
    ]
    if accelerate is None:
        rows.append(("(d) Accelerate debug mode", "not installed", "pip install accelerate"))
    else:
        rows.append(("(d) Accelerate reduce, ACCELERATE_DEBUG_MODE=0", f"{accelerate[0]:.1f} µs", ""))
        rows.append(
            (
                "(d) Accelerate reduce, ACCELERATE_DEBUG_MODE=1",
                f"{accelerate[1]:.1f} µs",
                f"ratio {accelerate[1] / accelerate[0]:.2f}",
            )
        )
    rows.append(("(e) the .pth line alone, HANGWATCH_ADDR unset", f"{_pth_line_us():.2f} µs", "an environment check"))
    base = starts["HANGWATCH_ADDR unset"]
    for name, ms in starts.items():
        rows.append((f"(e) start: {name}", f"{ms:.1f} ms", f"ratio {ms / base:.3f} vs unset"))
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(f"\nrun took {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
