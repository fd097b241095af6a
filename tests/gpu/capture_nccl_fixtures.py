#!/usr/bin/env python3
"""Capture real NCCL Flight Recorder dumps and facts on a CUDA machine (hangwatch test fixtures).

Run on a machine with one CUDA GPU and a CUDA build of torch (nothing else is needed):

    PYTHONUNBUFFERED=1 python tests/gpu/capture_nccl_fixtures.py OUTDIR [--budget 540]

Without CUDA it prints a skip message and exits 0. Every probe runs in its own subprocess with a
hard timeout (``--probe NAME``); one that fails or hangs loses nothing of the others. Results,
errors and tracebacks go to OUTDIR/findings.json (rewritten after each probe), raw dumps and
worker-server responses to OUTDIR/*, each probe's output to OUTDIR/logs/. All jobs are single-rank
(world_size=1: NCCL refuses two ranks on one GPU). ``CAPTURE_DEV_CPU=1`` runs the harness with
gloo on CPU (most probes then record errors), only to test the script itself.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import pickle
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCRIPT = str(Path(__file__).resolve())
DEV_CPU = os.environ.get("CAPTURE_DEV_CPU") == "1"
ENTRY_KEYS = (
    "record_id",
    "pg_id",
    "process_group",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "profiling_name",
    "state",
    "retired",
    "is_p2p",
    "input_sizes",
    "output_sizes",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "duration_ms",
    "timeout_ms",
    "thread_name",
)


# ----------------------------------------------------------------------------- shared helpers
class Recorder:
    """A JSON result file rewritten after every change, so a crash keeps what was learnt."""

    def __init__(self, outdir: Path, name: str) -> None:
        self.outdir, self.path, self.data = outdir, outdir / f"probe_{name}.json", {}

    def set(self, key: str, value: Any) -> Any:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=repr))
        return value

    def save(self, filename: str, content: bytes | str) -> None:
        raw = content.encode() if isinstance(content, str) else bytes(content)
        (self.outdir / filename).write_bytes(raw)
        self.set("files", {**self.data.get("files", {}), filename: len(raw)})

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            errs = self.data.get("errors", {})
            errs[name] = {"error": repr(e), "traceback": traceback.format_exc()}
            self.set("errors", errs)


def parse_dump(raw: bytes | str) -> Any:
    if isinstance(raw, (bytes, bytearray)) and raw[:1] == b"\x80":
        return pickle.loads(raw)
    return json.loads(raw)


def summarize_ring(dump: Any) -> dict[str, Any]:
    if not isinstance(dump, dict):
        return {"type": type(dump).__name__}
    entries = dump.get("entries") or []
    return {
        "top_keys": sorted(dump),
        "version": dump.get("version"),
        "pg_config": dump.get("pg_config"),
        "pg_status": dump.get("pg_status"),
        "n_entries": len(entries),
        "entry_keys": sorted(entries[0]) if entries else [],
        "entries": [entry_brief(e) for e in entries[-40:]],
    }


def entry_brief(e: dict[str, Any]) -> dict[str, Any]:
    out = {k: e[k] for k in ENTRY_KEYS if k in e}
    if "frames" in e:
        out["n_frames"] = len(e["frames"])
    return out


def unix_request(sock: str, method: str, path: str, timeout: float) -> dict[str, Any]:
    """Plain HTTP over the worker server's Unix socket; returns status, body and timing."""

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(sock)

    t0, w0 = time.perf_counter(), time.time()
    conn = Conn("localhost", timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        body = resp.read()
        res = {"status": resp.status, "content_type": resp.getheader("Content-Type"), "body": body}
    except Exception as e:
        res = {"status": None, "error": repr(e), "body": b""}
    finally:
        conn.close()
    res.update(ms=round((time.perf_counter() - t0) * 1e3, 3), wall_start=w0, wall_end=time.time())
    return res


def run_client(sock: str, plan_json: str, result: str) -> int:
    """Client process: plan = {"delay": s, "requests": [[method, path, save_as|None, pause_s?], ...]}.
    A path "ALL" posts every handler listed by GET /handler/; pause_s waits before that request."""
    plan = json.loads(plan_json)
    outdir = Path(result).parent
    time.sleep(plan.get("delay", 0.0))
    reqs, out = list(plan["requests"]), []
    while reqs:
        method, path, save_as, *pause = reqs.pop(0)
        time.sleep(pause[0] if pause else 0.0)
        if path == "ALL":
            names = json.loads(unix_request(sock, "GET", "/handler/", 10)["body"] or b"[]")
            reqs[:0] = [["POST", f"/handler/{n}", f"ws_{n}"] for n in names]
            continue
        r = unix_request(sock, method, path, plan.get("timeout", 20.0))
        body = r.pop("body")
        r.update(path=path, bytes=len(body), head=body[:300].decode("utf-8", "replace"))
        if save_as and body and len(body) <= 262144:
            ext = {"application/json": ".json", "text/plain": ".txt"}.get(r.get("content_type") or "", ".bin")
            (outdir / f"{save_as}{ext}").write_bytes(body)
            r["saved"] = f"{save_as}{ext}"
        out.append(r)
    Path(result).write_text(json.dumps(out, indent=1))
    return 0


def start_client(rec: Recorder, sock: str, plan: dict[str, Any], tag: str) -> tuple[subprocess.Popen[bytes], Path]:
    result = rec.outdir / f"client_{tag}.json"
    proc = subprocess.Popen([sys.executable, SCRIPT, "--client", sock, json.dumps(plan), str(result)])
    return proc, result


def finish_client(rec: Recorder, proc: subprocess.Popen[bytes], result: Path, key: str, timeout: float = 60) -> Any:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    data = json.loads(result.read_text()) if result.exists() else {"error": f"no client result, rc={proc.returncode}"}
    result.unlink(missing_ok=True)
    return rec.set(key, data)


# ----------------------------------------------------------------------------- in-rank helpers
def init_pg(timeout_s: float | None = None) -> tuple[Any, Any, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    dev = torch.device("cpu") if DEV_CPU else torch.device("cuda", 0)
    if not DEV_CPU:
        torch.cuda.set_device(0)
    kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo" if DEV_CPU else "nccl", init_method="env://", rank=0, world_size=1, **kw)
    return torch, dist, dev


def c10d() -> Any:
    import torch._C._distributed_c10d as m

    return m


def nccl_json(only_active: bool = False) -> bytes:
    return bytes(c10d()._dump_nccl_trace_json(True, only_active))


def sync() -> None:
    import torch

    if not DEV_CPU:
        torch.cuda.synchronize()


def sleep_cycles(torch: Any, seconds: float, cps: float) -> None:
    torch.cuda._sleep(int(seconds * cps))


def calibrate_sleep(torch: Any) -> float:
    """GPU clock cycles per second of torch.cuda._sleep, from CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    end.synchronize()
    return 200_000_000 / (float(start.elapsed_time(end)) / 1e3)


def warm_up(torch: Any, dist: Any, dev: Any) -> Any:
    x = torch.ones(4, device=dev)
    dist.all_reduce(x)
    sync()
    return x


# ----------------------------------------------------------------------------- probes
def probe_env(rec: Recorder, tag: str) -> None:
    import torch

    rec.set("python", sys.version)
    rec.set("torch", torch.__version__)
    rec.set("torch_cuda", torch.version.cuda)
    with rec.step("nccl_version"):
        rec.set("nccl_version", torch.cuda.nccl.version())
    with rec.step("gpu"):
        p = torch.cuda.get_device_properties(0)
        rec.set(
            "gpu",
            {
                "name": p.name,
                "capability": [p.major, p.minor],
                "sms": p.multi_processor_count,
                "mem_gib": round(p.total_memory / 2**30, 1),
            },
        )
    m = c10d()
    names = [
        "_dump_nccl_trace_json",
        "_dump_nccl_trace",
        "_dump_fr_trace_json",
        "_dump_fr_trace",
        "_WorkerServer",
        "_get_handler_names",
        "_register_handler",
        "_get_handler",
    ]
    rec.set("c10d_exists", {n: hasattr(m, n) for n in names})
    rec.set("c10d_docs", {n: (getattr(m, n).__doc__ or "").strip().splitlines()[:1] for n in names if hasattr(m, n)})
    rec.set("c10d_dump_like", sorted(n for n in dir(m) if "dump" in n.lower() or "trace" in n.lower()))
    with rec.step("handler_names"):
        rec.set("handler_names_at_import", sorted(m._get_handler_names()))
        import torch.distributed

        rec.set("handler_names_after_import_torch_distributed", sorted(m._get_handler_names()))
        import importlib

        importlib.import_module("torch.distributed.debug._handlers")
        rec.set("handler_names_after_debug_handlers", sorted(m._get_handler_names()))
    inc = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d"
    consts: dict[str, dict[str, str]] = {}
    envs: dict[str, list[str]] = {}
    for f in sorted(inc.glob("*")):
        if f.suffix in (".hpp", ".h") and ("Flight" in f.name or "NCCL" in f.name or "Trace" in f.name):
            text = f.read_text(errors="replace")
            found = dict(re.findall(r'DEFINE_CONSTANT\((\w+),\s*"([^"]*)"\)', text))
            if found:
                consts[f.name] = found
            envs[f.name] = sorted(set(re.findall(r'"(TORCH_[A-Z0-9_]+)"', text)))
    rec.set("fr_header_constants", consts)
    rec.set("header_env_vars", envs)
    with rec.step("nvidia_smi"):
        q = "name,driver_version,clocks.max.sm,memory.total"
        cmd = ["nvidia-smi", f"--query-gpu={q}", "--format=csv"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        rec.set("nvidia_smi", r.stdout.strip())


def probe_ring(rec: Recorder, tag: str) -> None:
    torch, dist, dev = init_pg()
    m = c10d()
    has_cpu_ring = hasattr(m, "_dump_fr_trace_json")
    seen = {"nccl": 0, "cpu": 0}
    ops: list[dict[str, Any]] = []

    def new_entries(label: str) -> None:
        row: dict[str, Any] = {"op": label}
        for ring, dump in (
            ("nccl", lambda: m._dump_nccl_trace_json(True, False)),
            ("cpu", lambda: m._dump_fr_trace_json(True, False)),
        ):
            if ring == "cpu" and not has_cpu_ring:
                continue
            try:
                entries = parse_dump(dump()).get("entries") or []
            except Exception as e:
                row[ring] = repr(e)
                continue
            row[ring] = [
                [
                    e.get("record_id"),
                    e.get("profiling_name"),
                    e.get("pg_id"),
                    e.get("collective_seq_id"),
                    e.get("p2p_seq_id"),
                    e.get("state"),
                ]
                for e in entries
                if e.get("record_id", 0) >= seen[ring]
            ]
            seen[ring] = max([seen[ring]] + [e.get("record_id", -1) + 1 for e in entries])
        ops.append(row)
        rec.set("ops_new_entries", ops)

    def op(label: str, fn: Callable[[], Any]) -> None:
        with rec.step(label):
            fn()
            sync()
        new_entries(label)

    x = torch.arange(8, dtype=torch.float32, device=dev)
    op("all_reduce", lambda: dist.all_reduce(x))
    op("all_reduce_async_wait", lambda: dist.all_reduce(x, async_op=True).wait())
    op("broadcast", lambda: dist.broadcast(x, src=0))
    op("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty_like(x), x))
    op("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty_like(x), x))
    if hasattr(dist, "_all_gather_base"):
        op("_all_gather_base", lambda: dist._all_gather_base(torch.empty_like(x), x))
    op("all_to_all_single", lambda: dist.all_to_all_single(torch.empty_like(x), x))
    op("barrier", lambda: dist.barrier())
    sub: list[Any] = []
    op("new_group([0])", lambda: sub.append(dist.new_group([0])))
    op("all_reduce_on_subgroup", lambda: dist.all_reduce(x, group=sub[0]))
    op("all_gather_object", lambda: dist.all_gather_object([None], {"a": 1}))
    if hasattr(dist, "_coalescing_manager"):

        def coalesced() -> None:
            with dist._coalescing_manager(async_ops=True) as cm:
                dist.all_reduce(x)
                dist.all_reduce(x.clone())
            cm.wait()

        op("coalescing_manager_2x_all_reduce", coalesced)
    gloo: list[Any] = []
    op("new_group_gloo", lambda: gloo.append(dist.new_group([0], backend="gloo")))
    op("gloo_cpu_all_reduce", lambda: dist.all_reduce(torch.ones(4), group=gloo[0]))
    model: list[Any] = []

    def ddp_make() -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
        model.append(DDP(net, device_ids=None if DEV_CPU else [0]))

    op("ddp_construct", ddp_make)

    def ddp_train() -> None:
        opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
        for _ in range(3):
            opt.zero_grad()
            model[0](torch.randn(16, 64, device=dev)).sum().backward()
            opt.step()

    op("ddp_3_steps", ddp_train)

    def funcol() -> None:
        import torch.distributed._functional_collectives as fc

        y = fc.all_reduce(x, "sum", dist.group.WORLD)
        fc.wait_tensor(y)

    op("functional_all_reduce", funcol)
    time.sleep(1.0)  # let the watchdog retire completed work
    for fname, call in (
        (f"nccl_ring_{tag}.json", lambda: m._dump_nccl_trace_json(True, False)),
        (f"nccl_ring_onlyactive_{tag}.json", lambda: m._dump_nccl_trace_json(True, True)),
        (f"nccl_ring_{tag}.pkl", lambda: m._dump_nccl_trace(True, True, False)),
        (f"cpu_ring_{tag}.json", lambda: m._dump_fr_trace_json(True, False)),
        (f"cpu_ring_{tag}.pkl", lambda: m._dump_fr_trace(True, True, False)),
    ):
        with rec.step(fname):
            raw = call()
            rec.save(fname, raw)
            rec.set(f"summary:{fname}", summarize_ring(parse_dump(raw)))
    dist.destroy_process_group()


def probe_enqueued(rec: Recorder, tag: str) -> None:
    torch, dist, dev = init_pg()
    x = warm_up(torch, dist, dev)
    cps = rec.set("sleep_cycles_per_s", calibrate_sleep(torch))
    snaps: list[dict[str, Any]] = []
    t = {"wall0": time.time()}

    def dumper() -> None:
        for i, at in enumerate((0.5, 1.5, 2.5)):
            time.sleep(max(0.0, t["wall0"] + at - time.time()))
            raw, w = nccl_json(), time.time()
            d = parse_dump(raw)
            if i == 1:
                rec.save(f"nccl_ring_inflight_{tag}.json", raw)
            snaps.append(
                {
                    "t_rel_s": round(w - t["wall0"], 3),
                    "pg_status": d.get("pg_status"),
                    "last_entry": entry_brief(d["entries"][-1]) if d.get("entries") else None,
                }
            )
            rec.set("snapshots", snaps)

    sleep_cycles(torch, 3.0, cps)
    t["wall0"] = time.time()
    dist.all_reduce(x)
    t["all_reduce_returned_s"] = time.time() - t["wall0"]
    th = threading.Thread(target=dumper, daemon=True)
    th.start()
    x.sum().item()
    t["item_returned_s"] = time.time() - t["wall0"]
    th.join(timeout=10)
    time.sleep(0.5)
    after = parse_dump(nccl_json())
    rec.set("times", t)
    rec.set("after", {"pg_status": after.get("pg_status"), "last_entry": entry_brief(after["entries"][-1])})
    dist.destroy_process_group()


def regex_size(seconds: float) -> int:
    """Length n for which re.match(r"(a+)+$", "a"*n + "b") (sre backtracking: a C call that holds
    the GIL throughout, doubling in time per character) takes about `seconds`."""
    n = 18
    while (dt := hold_gil(n)) < 0.05 and n < 40:
        n += 1
    return min(40, n + round(math.log2(seconds / dt)))


def hold_gil(n: int) -> float:
    t0 = time.perf_counter()
    re.match(r"(a+)+$", "a" * n + "b")
    return time.perf_counter() - t0


def counter_rate(fn: Callable[[], Any]) -> dict[str, float]:
    """Increments/s of a Python counter thread while fn runs in the main thread (GIL released?)."""
    box, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            box[0] += 1

    th = threading.Thread(target=count, daemon=True)
    th.start()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    stop.set()
    th.join(5)
    return {"seconds": round(dt, 3), "increments_per_s": round(box[0] / dt)}


def probe_ws(rec: Recorder, tag: str) -> None:
    torch, dist, dev = init_pg()
    x = warm_up(torch, dist, dev)
    m = c10d()
    with rec.step("import_debug_handlers"):
        import importlib

        importlib.import_module("torch.distributed.debug._handlers")
    sock = f"/tmp/hw_ws_{os.getpid()}.sock"
    server = m._WorkerServer(sock)
    rec.set("socket", sock)
    rec.set("handler_names", sorted(m._get_handler_names()))
    idle = [["GET", "/handler/", "ws_handler_list"], ["POST", "/handler/ping", None], ["POST", "ALL", None]]
    idle += [
        ["POST", f"/handler/dump_nccl_trace_json?{q}", f"ws_dump_nccl_trace_json_{s}"]
        for q, s in (
            ("onlyactive=true", "onlyactive"),
            ("includecollectives=false", "nocollectives"),
            ("bogus=1", "badparam"),
            ("onlyactive=yes", "badvalue"),
        )
    ]
    idle += [
        ["POST", "/handler/dump_nccl_trace_pickle?includestacktraces=false", "ws_dump_nccl_trace_pickle_nostack"],
        ["POST", "/handler/torch_profile?duration=0.2", None],
        ["POST", "/handler/no_such_handler", None],
    ]
    proc, res = start_client(rec, sock, {"delay": 0, "requests": idle}, "idle")
    finish_client(rec, proc, res, "idle_requests", 120)
    busy: list[tuple[str, str, str | None]] = [
        ("POST", "/handler/ping", None),
        ("POST", "/handler/dump_nccl_trace_json?onlyactive=true", "ws_blocked_{}_dump_nccl_trace_json"),
        ("POST", "/handler/fr_trace_json", None),
        ("POST", "/handler/dump_traceback", "ws_blocked_{}_dump_traceback"),
    ]
    cps = rec.set("sleep_cycles_per_s", 0.0 if DEV_CPU else calibrate_sleep(torch))
    with rec.step("blocked_in_item"):
        plan = {"delay": 1.0, "timeout": 15, "requests": [[a, b, c and c.format("item")] for a, b, c in busy]}
        proc, res = start_client(rec, sock, plan, "item")
        sleep_cycles(torch, 4.0, cps)
        w0 = time.time()
        dist.all_reduce(x)
        x.sum().item()
        rec.set("blocked_in_item_wall", [w0, time.time()])
        finish_client(rec, proc, res, "blocked_in_item_requests")
    with rec.step("gil_held_regex"):
        plan = {"delay": 0.8, "timeout": 15, "requests": [[a, b, c and c.format("gil")] for a, b, c in busy]}
        n = rec.set("regex_n", regex_size(4.0))
        proc, res = start_client(rec, sock, plan, "gil")
        w0 = time.time()
        dt = hold_gil(n)
        rec.set("gil_held_wall", [w0, time.time(), dt])
        finish_client(rec, proc, res, "gil_held_requests")
    with rec.step("gil_release_check"):
        rates: dict[str, Any] = {"baseline_sleep_0.5s": counter_rate(lambda: time.sleep(0.5))}

        def sync_after_sleep() -> None:
            sleep_cycles(torch, 2.0, cps)
            torch.cuda.synchronize()

        def item_after_sleep() -> None:
            sleep_cycles(torch, 2.0, cps)
            x.sum().item()

        rates["cuda_synchronize_behind_2s_sleep"] = counter_rate(sync_after_sleep)
        rates["item_behind_2s_sleep"] = counter_rate(item_after_sleep)
        n1 = regex_size(1.0)
        rates["regex_1s"] = counter_rate(lambda: hold_gil(n1))
        rec.set("gil_counter_rates", rates)
    server.shutdown()
    dist.destroy_process_group()


def probe_timeout(rec: Recorder, tag: str) -> None:
    """Collective timeout 5 s, the all_reduce stuck behind a long sleep kernel; a worker-server
    client (which outlives this process) queries the rank at +12 s and +32 s."""
    torch, dist, dev = init_pg(timeout_s=5)
    x = warm_up(torch, dist, dev)
    cps = calibrate_sleep(torch)
    sock = f"/tmp/hw_timeout_{os.getpid()}.sock"
    server = c10d()._WorkerServer(sock)
    reqs = [
        ["POST", "/handler/ping", None, 12.0],
        ["POST", "/handler/dump_nccl_trace_json", "ws_after_timeout_dump_nccl_trace_json"],
        ["POST", "/handler/dump_traceback", "ws_after_timeout_dump_traceback"],
        ["POST", "/handler/ping", None, 20.0],
        ["POST", "/handler/dump_nccl_trace_json", "ws_after_timeout_late_dump_nccl_trace_json"],
    ]
    start_client(rec, sock, {"timeout": 10, "requests": reqs}, "timeout")
    sleep_cycles(torch, float(os.environ.get("CAPTURE_TIMEOUT_SLEEP_S", "90")), cps)
    dist.all_reduce(x)
    print(f"MARK enqueued {time.time():.3f}", flush=True)
    rec.set("enqueued_wall", time.time())
    x.sum().item()
    rec.set("item_returned_wall", time.time())  # only if the watchdog did not end the process
    server.shutdown()


def probe_cost(rec: Recorder, tag: str) -> None:
    torch, dist, dev = init_pg()
    m = c10d()
    x = warm_up(torch, dist, dev)
    for _ in range(2000):
        dist.all_reduce(x)
    sync()
    loop, total = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20000):
            dist.all_reduce(x)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        loop.append((t1 - t0) / 20000 * 1e6)
        total.append((t2 - t0) / 20000 * 1e6)
    rec.set("us_per_call_loop", loop)
    rec.set("us_per_call_incl_sync", total)
    time.sleep(0.5)
    for key, call in (
        ("dump_json_full", lambda: m._dump_nccl_trace_json(True, False)),
        ("dump_json_onlyactive", lambda: m._dump_nccl_trace_json(True, True)),
        ("dump_pickle_nostack", lambda: m._dump_nccl_trace(True, False, False)),
        ("dump_pickle_stack", lambda: m._dump_nccl_trace(True, True, False)),
    ):
        with rec.step(key):
            ms, size = [], 0
            for _ in range(20):
                t0 = time.perf_counter()
                size = len(call())
                ms.append((time.perf_counter() - t0) * 1e3)
            rec.set(key, {"median_ms": statistics.median(ms), "min_ms": min(ms), "bytes": size})
    with rec.step("n_entries"):
        rec.set("n_entries", len(parse_dump(nccl_json())["entries"]))
    with rec.step("worker_server_round_trip"):
        sock = f"/tmp/hw_cost_{os.getpid()}.sock"
        server = m._WorkerServer(sock)
        reqs = [["POST", "/handler/dump_nccl_trace_json", None]] * 20 + [["POST", "/handler/ping", None]] * 20
        proc, res = start_client(rec, sock, {"requests": reqs}, "cost")
        data = finish_client(rec, proc, res, "_ws_raw")
        rec.set("ws_dump_nccl_trace_json_ms", statistics.median(r["ms"] for r in data[:20]))
        rec.set("ws_dump_nccl_trace_json_bytes", data[0]["bytes"])
        rec.set("ws_ping_ms", statistics.median(r["ms"] for r in data[20:]))
        rec.data.pop("_ws_raw")
        server.shutdown()
    dist.destroy_process_group()


def probe_nvml(rec: Recorder, tag: str) -> None:
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    rec.set("driver", nv.nvmlSystemGetDriverVersion())

    def sample() -> dict[str, Any]:
        u = nv.nvmlDeviceGetUtilizationRates(h)
        procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
        return {
            "t": round(time.time(), 3),
            "util_gpu": u.gpu,
            "util_mem": u.memory,
            "mem_used_mib": nv.nvmlDeviceGetMemoryInfo(h).used // 2**20,
            "procs": [[p.pid, (p.usedGpuMemory or 0) // 2**20] for p in procs],
        }

    rec.set("my_pid", os.getpid())
    rec.set("before_cuda", sample())
    torch, dist, dev = init_pg()
    x = warm_up(torch, dist, dev)
    cps = calibrate_sleep(torch)
    rec.set("idle_after_init", sample())
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            samples.append(sample())
            time.sleep(0.2)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    w0 = time.time()
    sleep_cycles(torch, 3.0, cps)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    w1 = time.time()
    time.sleep(1.5)
    stop.set()
    th.join(5)
    rec.set("busy_wall", [w0, w1])
    rec.set("samples", samples)
    with rec.step("xid_events"):
        rec.set("supported_event_types", nv.nvmlDeviceGetSupportedEventTypes(h))
        es = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
        rec.set("xid_register", "ok")
        try:
            ev = nv.nvmlEventSetWait_v2(es, 300)
            rec.set("xid_wait", {"event_type": ev.eventType, "data": ev.eventData})
        except nv.NVMLError as e:
            rec.set("xid_wait", f"{type(e).__name__}: {e}")
        nv.nvmlEventSetFree(es)
    dist.destroy_process_group()
    nv.nvmlShutdown()


PROBES: dict[str, Callable[[Recorder, str], None]] = {
    "env": probe_env,
    "ring": probe_ring,
    "enqueued": probe_enqueued,
    "ws": probe_ws,
    "timeout": probe_timeout,
    "cost": probe_cost,
    "nvml": probe_nvml,
}


# ----------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_one(outdir: Path, name: str, kind: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    (outdir / "logs").mkdir(exist_ok=True)
    log = outdir / "logs" / f"{name}.log"
    full = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    cmd = [sys.executable, SCRIPT, "--probe", kind, "--tag", name, str(outdir)]
    t0 = time.time()
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, env=full, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
    res: dict[str, Any] = {"env": env, "rc": rc, "timed_out": rc is None, "seconds": round(time.time() - t0, 2)}
    if rc is not None and rc < 0:
        res["signal"] = signal.Signals(-rc).name
    text = log.read_text(errors="replace")
    res["log_tail"] = text.splitlines()[-60:]
    pfile = outdir / f"probe_{name}.json"
    if pfile.exists():
        res["result"] = json.loads(pfile.read_text())
        pfile.unlink()
    marks = re.findall(r"MARK (\w+) ([\d.]+)", text)
    if marks:
        res["marks"] = {k: float(v) for k, v in marks}
        res["seconds_after_enqueue_until_exit"] = round(t0 + res["seconds"] - float(marks[-1][1]), 2)
    return res


def timeout_dump_files(dump_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted(dump_dir.glob("*")):
        raw = f.read_bytes()
        info: dict[str, Any] = {
            "bytes": len(raw),
            "format": "pickle" if raw[:1] == b"\x80" else "json" if raw[:1] in (b"{", b"[") else repr(raw[:16]),
        }
        try:
            info["summary"] = summarize_ring(parse_dump(raw))
        except Exception as e:
            info["parse_error"] = repr(e)
        out[f.name] = info
    return out


def plan(outdir: Path) -> list[tuple[str, str, dict[str, str], float]]:
    dump_dir = outdir / "timeout_dumps"
    dump_dir.mkdir(exist_ok=True)
    prefix = str(dump_dir / "fr_timeout_rank_")
    steps: list[tuple[str, str, dict[str, str], float]] = [("env", "env", {}, 90)]
    for t in ("0", "1"):
        steps.append((f"ring_timing{t}", "ring", {"TORCH_NCCL_ENABLE_TIMING": t}, 120))
    for t in ("0", "1"):
        steps.append((f"enqueued_timing{t}", "enqueued", {"TORCH_NCCL_ENABLE_TIMING": t}, 90))
    steps.append(("ws", "ws", {}, 150))
    steps.append(
        (
            "timeout",
            "timeout",
            {
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_FR_DUMP_TEMP_FILE": prefix,
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
            },
            130,
        )
    )
    for rep in ("a", "b"):
        for t in ("0", "1"):
            steps.append((f"cost_timing{t}_{rep}", "cost", {"TORCH_NCCL_ENABLE_TIMING": t}, 90))
    steps.append(("nvml", "nvml", {}, 60))
    return steps


def drive(outdir: Path, budget: float, only: list[str] | None) -> int:
    outdir.mkdir(parents=True, exist_ok=True)
    findings: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "probes": {}}
    fpath = outdir / "findings.json"
    t_start = time.time()
    for name, kind, env, timeout in plan(outdir):
        if only and name not in only and kind not in only:
            continue
        left = budget - (time.time() - t_start)
        if left < 20:
            findings["probes"][name] = {"skipped": f"budget: {left:.0f}s left"}
            continue
        print(f"[capture] {name} (timeout {min(timeout, left - 5):.0f}s)", flush=True)
        res = run_one(outdir, name, kind, env, min(timeout, left - 5))
        if kind == "timeout":
            res["dump_files"] = timeout_dump_files(outdir / "timeout_dumps")
            client, until = outdir / "client_timeout.json", time.time() + 45
            while not client.exists() and time.time() < until:
                time.sleep(1)
            res["client"] = json.loads(client.read_text()) if client.exists() else "no client result"
        findings["probes"][name] = res
        errs = list(res.get("result", {}).get("errors", {}))
        print(f"[capture] {name}: rc={res['rc']} {res['seconds']}s errors={errs}", flush=True)
        findings["cost_summary"] = cost_summary(findings["probes"])
        fpath.write_text(json.dumps(findings, indent=1, default=repr))
    print(f"[capture] done in {time.time() - t_start:.0f}s; findings in {fpath}", flush=True)
    return 0


def cost_summary(probes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in ("0", "1"):
        rs = [p["result"] for n, p in probes.items() if n.startswith(f"cost_timing{t}_") and "result" in p]
        loops = [v for r in rs for v in r.get("us_per_call_loop", [])]
        if loops:
            out[f"timing{t}_us_per_call_median"] = round(statistics.median(loops), 3)
            out[f"timing{t}_us_per_call_incl_sync_median"] = round(
                statistics.median(v for r in rs for v in r.get("us_per_call_incl_sync", [])), 3
            )
            out[f"timing{t}_dump_json_full_ms"] = [r.get("dump_json_full", {}).get("median_ms") for r in rs]
            out[f"timing{t}_ws_dump_ms"] = [r.get("ws_dump_nccl_trace_json_ms") for r in rs]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all probes together")
    ap.add_argument("--only", nargs="*", help="probe names or kinds to run (default: all)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return run_client(*args.client)
    if not args.outdir:
        ap.error("OUTDIR is required")
    outdir = Path(args.outdir).resolve()
    if args.probe:
        suffix = args.tag.removeprefix(args.probe).lstrip("_") or args.probe
        PROBES[args.probe](Recorder(outdir, args.tag), suffix)
        return 0
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except ImportError:
        cuda = False
    if not cuda and not DEV_CPU:
        print("SKIP: CUDA is not available (or torch is not installed); nothing captured.")
        return 0
    return drive(outdir, args.budget, args.only)


if __name__ == "__main__":
    sys.exit(main())
