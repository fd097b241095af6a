"""The agent path on NCCL, on a machine with a GPU: ``python tests/gpu/nccl_agent_check.py OUTDIR``.

Run from the repository root (``PYTHONPATH=.``); skips (exit 0) without CUDA. One process is the
coordinator with its embedded node agent; one-rank NCCL jobs attach to it, as a user's would:

1. the hook's cost on CUDA tensors: a tight loop of 4-element ``all_reduce`` calls, hook on vs
   off in alternating fresh processes (wall time and the rank process's CPU per call);
2. the agent path: the rank links to the agent (``via`` agent), its records arrive, and a DDP
   step's bucket all-reduces are (or are not) seen;
3. a collective held back on its stream (``torch.cuda._sleep``) while the host thread blocks in
   ``.item()``: what ``status`` says meanwhile (expected: ``waiting`` in the all_reduce, with
   ``completion`` "device", ``host_returned`` set and torch's ``timeout_at``: the call stays
   open from its enqueue to its completion on the GPU), and the NCCL Flight Recorder ring read by
   the agent through the rank's worker server (the socket's pid checked), with its entries' states.

Everything it sees goes to ``OUTDIR/agent_check.json`` (and the job logs beside it).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

RANK = textwrap.dedent(
    """
    import json, os, resource, sys, time
    mode = sys.argv[1]
    if mode != "off":
        import hangwatch.client
        assert hangwatch.client.attach(os.environ["HANGWATCH_ADDR"])
    import torch, torch.distributed as dist
    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    t = torch.ones(4, device="cuda")
    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime
    if mode in ("on", "off"):
        n = int(sys.argv[2])
        for _ in range(500):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), cpu()
        for _ in range(n):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        wall, used = (time.perf_counter() - w0) / n * 1e6, (cpu() - c0) / n * 1e6
        print(json.dumps({"wall_us": wall, "cpu_us": used}), flush=True)
    else:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        for _ in range(20):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        print("steady", flush=True)
        time.sleep(2)
        torch.cuda._sleep(int(8 * 1.9e9))  # about 8 s on an H100
        dist.all_reduce(t)  # enqueued behind the sleep: returns at once
        print("enqueued", flush=True)
        t.sum().item()  # the host blocks here until the stream frees
        print("released", flush=True)
        time.sleep(1)
    dist.destroy_process_group()
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(addr: str, mode: str, out: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", HANGWATCH_ADDR=addr, TORCH_FR_BUFFER_SIZE="2000", PYTHONUNBUFFERED="1")  # fmt: skip
    log = open(out / f"rank_{mode}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-c", RANK, mode, *args], env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True)  # fmt: skip


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "nccl_agent_check")
    out.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        if not torch.cuda.is_available():
            print("SKIP: no CUDA")
            return 0
    except ImportError:
        print("SKIP: no torch")
        return 0
    from hangwatch.agent.frquery import read_rings
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    result: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    c = Coordinator(CoordinatorOptions(host="127.0.0.1", port=0, data_dir=tempfile.mkdtemp(), metrics_port=0))
    c.start()
    addr = f"127.0.0.1:{c.port}"
    try:
        # 1. cost on CUDA tensors, alternated fresh processes
        runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for _ in range(3):
            for mode in ("off", "on"):
                p = _rank(addr, mode, out, "20000")
                line = p.stdout.readline() if p.stdout else ""
                p.wait(120)
                runs[mode].append(json.loads(line))
        result["cost"] = {
            m: {k: statistics.median(x[k] for x in v) for k in ("wall_us", "cpu_us")} for m, v in runs.items()
        }
        result["cost_runs"] = runs
        # 2 and 3. the agent path, and a collective held back behind a sleeping stream
        p = _rank(addr, "stuck", out)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "steady"
        time.sleep(1)
        status = c.status()
        result["ranks_steady"] = status["ranks"]
        ops: dict[str, int] = {}
        with c.lock:
            for st in c.job.ranks.values():
                for hist in st.history.values():
                    for call in hist:
                        ops[f"{call.op} ({call.source})"] = ops.get(f"{call.op} ({call.source})", 0) + 1
        result["ops_seen"] = ops
        assert p.stdout.readline().strip() == "enqueued"
        time.sleep(3)
        result["ranks_blocked"] = c.status()["ranks"]
        links = c.rings.links() if c.rings is not None else []
        result["links"] = [{"pid": lk.peer.pid, "hello": lk.hello} for lk in links]
        if links:
            t0 = time.monotonic()
            rings, errors = read_rings(links[0].hello.get("worker_socket", ""), links[0].peer.pid, only_active=True)
            result["ring_read_ms"] = (time.monotonic() - t0) * 1e3
            result["ring_errors"] = errors
            result["rings_active"] = rings
            t0 = time.monotonic()
            full, _ = read_rings(links[0].hello.get("worker_socket", ""), links[0].peer.pid)
            result["ring_full_read_ms"] = (time.monotonic() - t0) * 1e3
            result["nccl_states"] = [
                (e.get("collective_seq_id"), e.get("profiling_name"), e.get("state"))
                for e in full.get("nccl", {}).get("entries", [])
            ]
        if c.shipper is not None:  # how often the NCCL ring's entries were read, and spared
            f = c.shipper.fetcher
            result["fetcher"] = {"reads": f.reads, "spared": f.spared, "failures": f.failures}
        result["released"] = p.stdout.readline().strip()
        p.wait(60)
        time.sleep(1)
        result["incidents"] = c.incidents_json()
        result["ranks_end"] = c.status()["ranks"]
    finally:
        c.stop()
        (out / "agent_check.json").write_text(json.dumps(result, indent=1, default=str))
    blocked = (result.get("ranks_blocked") or [{}])[0]
    result["checks"] = {
        "held_on_the_gpu": blocked.get("state") == "waiting" and blocked.get("completion") == "device",
        "host_returned_known": bool(blocked.get("host_returned")),
        "timeout_known": bool(blocked.get("timeout_at")),
        "no_incident": not result.get("incidents"),
    }
    (out / "agent_check.json").write_text(json.dumps(result, indent=1, default=str))
    shown = ("cost", "ops_seen", "ring_read_ms", "ring_full_read_ms", "fetcher", "ranks_steady", "checks")
    print(json.dumps({k: result.get(k) for k in shown}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
