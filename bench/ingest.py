"""Coordinator ingest at scale: throughput, CPU, memory, latency, and detection under load.

    .venv/bin/python bench/ingest.py ladder   [--rate 10] [--scales 8,64,256,1024,4096]
    .venv/bin/python bench/ingest.py ceiling  [--ranks 1024] [--rates 10,25,50,100]
    .venv/bin/python bench/ingest.py detect   [--ranks 1024] [--rate 10] [--faults stuck,shape,...]
    .venv/bin/python bench/ingest.py profile  [--ranks 1024] [--rate 25]   # py-spy on the coordinator
    .venv/bin/python bench/ingest.py versus   --baseline DIR [--ranks 1024] [--rate 10] [--pairs 3]

Each run starts a fresh coordinator in a subprocess (``ingest.py serve``: ``Coordinator`` with
its default options except ``embedded_agent=False`` (the simulated pids are not real processes)
and ``stuck_after`` fixed at 5 s, the adaptive threshold's minimum), so that psutil measures the
coordinator's own CPU time and RSS apart from the load generator. ``bench/loadgen.py`` then
drives it over gRPC on 127.0.0.1 from a few OS processes. NOTE: the load generator competes with
the coordinator for the same cores, so the offered load is itself limited by the machine; the
columns say what was offered, what the coordinator accepted, and what it cost the coordinator.

Every mode is bounded (a run is ``--seconds`` of load plus registration; a mode a few minutes).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

HERE = Path(__file__).resolve().parent
PY = sys.executable
EXPECTED = {
    "stuck": "stuck_collective",
    "shape": "shape_mismatch",
    "op": "op_mismatch",
    "dtype": "dtype_mismatch",
    "early_exit": "early_exit",
}


# ---- the coordinator under test ---------------------------------------------------------------


def serve(data_dir: str, stuck_after: float) -> None:
    """Run a coordinator until stdin closes; prints its port on the first line."""
    from hangwatch import gctune
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    coordinator = Coordinator(
        CoordinatorOptions(host="127.0.0.1", port=0, data_dir=data_dir, embedded_agent=False, stuck_after=stuck_after)
    )
    coordinator.start()
    gctune.tune()  # as ``hangwatch coordinator`` does
    print(coordinator.port, flush=True)
    sys.stdin.read()
    coordinator.stop(0.2)


class CoordinatorProc:
    def __init__(self, stuck_after: float = 5.0, tree: str | None = None) -> None:
        self.data = tempfile.TemporaryDirectory(prefix="hw-ingest-")
        cmd = [
            PY,
            str(Path(__file__).resolve()),
            "serve",
            "--data-dir",
            self.data.name,
            "--stuck-after",
            str(stuck_after),
        ]
        env = dict(os.environ, PYTHONPATH=tree) if tree else None  # another checkout's coordinator
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"coordinator did not start (got {line!r})")
        self.port = int(line)
        self.ps = psutil.Process(self.proc.pid)
        self.samples: list[tuple[float, float, int]] = []  # (time, cpu seconds, rss bytes)
        self.connections: list[tuple[float, int]] = []  # (time, established client connections)
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                t = self.ps.cpu_times()
                now = time.time()
                self.samples.append((now, t.user + t.system, self.ps.memory_info().rss))
                if not self.connections or now - self.connections[-1][0] >= 1.0:
                    conns = self.ps.net_connections("tcp")
                    n = sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == self.port)
                    self.connections.append((now, n))
            except psutil.Error:
                return
            self._stop.wait(0.25)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """CPU cores used and peak RSS between t0 and t1 (from the 0.25 s samples)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        conns = [n for t, n in self.connections if t0 <= t <= t1]
        if len(inside) < 2:
            return {"cores": None, "rss_mb": None, "connections": max(conns, default=None)}
        (ta, ca, _), (tb, cb, _) = inside[0], inside[-1]
        return {
            "cores": (cb - ca) / (tb - ta),
            "rss_mb": max(s[2] for s in inside) / 2**20,
            "connections": max(conns, default=None),
        }

    def rss_mb(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def query(self, method: str) -> Any:
        from hangwatch.protos import hangwatch_pb2 as pb
        from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc

        # GetStatus for 4096 ranks is ~6 MB: over gRPC's default 4 MB receive limit
        options = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]
        with grpc.insecure_channel(f"127.0.0.1:{self.port}", options) as channel:
            stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            reply = getattr(stub, method)(pb.QueryRequest(), timeout=30)
            return json.loads(reply.json)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._stop.set()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.data.cleanup()


# ---- driving the load generator ----------------------------------------------------------------


def loadgen(port: int, ranks: int, rate: float, seconds: float, extra: list[str] | None = None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [PY, str(HERE / "loadgen.py"), "--addr", f"127.0.0.1:{port}", "--ranks", str(ranks)]
        cmd += ["--rate", str(rate), "--seconds", str(seconds), "--json", out.name, *(extra or [])]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=seconds + 280)
        if done.returncode != 0:
            raise RuntimeError(f"loadgen failed: {done.stderr.strip()[-400:]}")
        return dict(json.loads(Path(out.name).read_text()))


def measure(
    ranks: int, rate: float, seconds: float, pattern: str, via: str = "direct", tree: str | None = None
) -> dict[str, Any]:
    coord = CoordinatorProc(tree=tree)
    try:
        idle_rss = coord.rss_mb()
        res = loadgen(coord.port, ranks, rate, seconds, ["--pattern", pattern, *_via(via)])
        # skip the first second (connection warm-up) when measuring the coordinator
        win = coord.window(res["t0"] + 1.0, res["t_end"])
        status = coord.query("GetStatus") if coord.alive() else {}
        incidents = coord.query("ListIncidents") if coord.alive() else []
        res.update(
            coord_cores=win["cores"],
            coord_rss_mb=win["rss_mb"],
            coord_connections=win["connections"],
            coord_idle_rss_mb=idle_rss,
            coord_alive=coord.alive(),
            records_received=status.get("records_received"),
            incidents=collections.Counter(i["kind"] for i in incidents),
        )
        return res
    finally:
        coord.close()


REPLAY: list[str] = []  # ["--replay"] when asked: batches built before t0, then sent as bytes


def _via(via: str) -> list[str]:
    return (["--relay"] if via == "relay" else []) + REPLAY


def row(res: dict[str, Any]) -> str:
    cores = res["coord_cores"] or 0.0
    acc = res["accepted_events_per_s"]
    per_core = acc / cores if cores else 0.0
    rss_rank = 1024 * (res["coord_rss_mb"] - res["coord_idle_rss_mb"]) / res["ranks"] if res["coord_rss_mb"] else 0.0
    # kept up: the coordinator took everything offered, promptly, without failures or false
    # incidents, and the generator offered (nearly) the schedule; a run's last send interval is
    # cut off by the window, hence 90 % of the schedule with a 1-2 s interval
    kept = (
        res["batches_failed"] == 0
        and acc >= 0.99 * res["offered_events_per_s"]
        and res["offered_events_per_s"] >= 0.9 * res["target_events_per_s"]
        and (res["rpc_p99_ms"] or 0) < 1000
        and not res["incidents"]
    )
    inc = ",".join(f"{k}:{v}" for k, v in sorted(res["incidents"].items())) or "-"
    via = (f"relay {res['relay_interval_s']:g} s" if res.get("relay") else "direct") + (
        " (replay)" if res.get("replay") else ""
    )
    return (
        f"| {res['ranks']} | {via} | {res['rate']:g} | {res['target_calls_per_s']:,} | {res['calls_per_s']:,} "
        f"| {res['target_events_per_s']:,} | {res['offered_events_per_s']:,} "
        f"| {acc:,} | {res['report_interval_s']:g} | {res['coordinator_rpcs_per_s']:,} | {res['coord_connections']} "
        f"| {cores:.2f} | {per_core:,.0f} | {res['coord_rss_mb']:.0f} | {rss_rank:.0f} "
        f"| {res['rpc_p50_ms']} / {res['rpc_p99_ms']} | {res['server_lag_p99_ms']} | {res['gen_behind_p99_ms']} "
        f"| {res['batches_failed']} | {inc} | {'yes' if kept else 'NO'} |"
    )


HEADER = (
    "| ranks | via | coll/s/rank | scheduled coll/s | sent coll/s | scheduled ev/s | offered ev/s | accepted ev/s "
    "| rank send interval s | coord RPC/s | coord conns | coord cores | accepted ev/s/core "
    "| coord RSS MB | RSS KB/rank | Report RPC p50 / p99 ms | server lag p99 ms | loadgen behind p99 ms "
    "| failed batches | false incidents | kept up |\n"
    "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
    "| --- | ---: | ---: | ---: | --- | --- |"
)


def _vias(via: str) -> list[str]:
    return ["direct", "relay"] if via == "both" else [via]


def ladder(scales: list[int], rate: float, seconds: float, pattern: str, via: str) -> None:
    print(f"# ladder: pattern={pattern} rate={rate:g} collectives/s/rank, {seconds:g} s each", flush=True)
    print(f"# machine: {os.cpu_count()} cores; loadgen and coordinator share them", flush=True)
    print(HEADER, flush=True)
    for n in scales:
        for v in _vias(via):  # side by side: the same scale direct and through relays
            try:
                print(row(measure(n, rate, seconds, pattern, v)), flush=True)
            except Exception as exc:
                print(f"| {n} | {v} | {rate:g} | failed: {exc} |", flush=True)


def ceiling(ranks: int, rates: list[float], seconds: float, pattern: str, via: str) -> None:
    print(f"# ceiling: {ranks} ranks, pattern={pattern}, {seconds:g} s each; stops after the first miss", flush=True)
    print(HEADER, flush=True)
    for v in _vias(via):
        for rate in rates:
            res = measure(ranks, rate, seconds, pattern, v)
            print(row(res), flush=True)
            if res["accepted_events_per_s"] < 0.9 * res["target_events_per_s"] or (res["rpc_p99_ms"] or 0) > 2000:
                break


def versus(baseline: str, ranks: int, rate: float, seconds: float, pattern: str, pairs: int) -> None:
    """This tree's coordinator against another checkout's, the same load, runs alternated."""
    import statistics

    print(f"# versus: {ranks} ranks, {rate:g} coll/s/rank, pattern={pattern}, {seconds:g} s, {pairs} pairs", flush=True)
    print(f"# baseline: {baseline}; machine: {os.cpu_count()} cores, shared with the load generator", flush=True)
    print("| tree | run | accepted ev/s | coord cores | coord µs/event | coord RSS MB | false incidents |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    cost: dict[str, list[float]] = {"this": [], "baseline": []}
    rss: dict[str, list[float]] = {"this": [], "baseline": []}
    for i in range(pairs):
        for name, tree in (
            (("baseline", baseline), ("this", None)) if i % 2 else (("this", None), ("baseline", baseline))
        ):
            res = measure(ranks, rate, seconds, pattern, tree=tree)
            us = 1e6 * (res["coord_cores"] or 0.0) / max(1, res["accepted_events_per_s"])
            cost[name].append(us)
            rss[name].append(res["coord_rss_mb"] or 0.0)
            inc = ",".join(f"{k}:{v}" for k, v in sorted(res["incidents"].items())) or "-"
            print(
                f"| {name} | {i + 1} | {res['accepted_events_per_s']:,} | {res['coord_cores'] or 0:.2f} | {us:.2f} "
                f"| {res['coord_rss_mb'] or 0:.0f} | {inc} |",
                flush=True,
            )
    a, b = statistics.median(cost["this"]), statistics.median(cost["baseline"])
    ra, rb = statistics.median(rss["this"]), statistics.median(rss["baseline"])
    print(f"\nmedian coordinator CPU per accepted event: this {a:.2f} µs, baseline {b:.2f} µs, ratio {a / b:.3f}")
    print(f"median coordinator peak RSS: this {ra:.0f} MB, baseline {rb:.0f} MB, ratio {ra / rb:.3f}")


def detect(ranks: int, rate: float, faults: list[str], pattern: str, fault_at: float, via: str) -> None:
    print(f"# detection under load: {ranks} ranks x {rate:g} coll/s, pattern={pattern}, stuck_after=5 s", flush=True)
    print("| fault | culprit | incident | culprits | fault → incident s | onset → incident s | other incidents |")
    print("| --- | ---: | --- | --- | ---: | ---: | --- |", flush=True)
    seconds = fault_at + 15.0
    for fault in faults:
        coord = CoordinatorProc()
        try:
            res = loadgen(coord.port, ranks, rate, seconds, ["--pattern", pattern, "--fault", fault, *_via(via)])
            res["fault_at"] = str(fault_at)
            incidents = coord.query("ListIncidents")
        finally:
            coord.close()
        want, k = EXPECTED[fault], res["fault_rank"]
        hit = [i for i in incidents if i["kind"] == want and k in i["culprit_ranks"]]
        others = sorted({i["kind"] for i in incidents if i not in hit})
        if hit:
            i = hit[0]
            print(
                f"| {fault} | {k} | {i['kind']} | {_short(i['culprit_ranks'])} "
                f"| {i['detected_time'] - res['fault_onset']:.2f} | {i['detected_time'] - i['onset_time']:.2f} "
                f"| {', '.join(others) or '-'} |",
                flush=True,
            )
        else:
            print(f"| {fault} | {k} | MISSED ({want}) | - | - | - | {', '.join(others) or '-'} |", flush=True)


def soak(ranks: int, rate: float, seconds: float, pattern: str, via: str) -> None:
    """Coordinator RSS over a long run: bounded state shows as a flat line after warm-up."""
    coord = CoordinatorProc()
    try:
        res = loadgen(coord.port, ranks, rate, seconds, ["--pattern", pattern, *_via(via)])
        t0 = res["t0"]
        status = coord.query("GetStatus")
        print(
            f"soak: {ranks} ranks x {rate:g} coll/s, {pattern}, {seconds:.0f} s; "
            f"{status['job']['records_received']:,} records received; "
            f"incidents: {dict(collections.Counter(i['kind'] for i in coord.query('ListIncidents'))) or 'none'}"
        )
        print("    t (s)   coordinator RSS (MB)")
        step = max(1.0, seconds / 10)
        mark = step
        for t, _cpu, rss in coord.samples:
            if t - t0 >= mark:
                print(f"    {t - t0:5.0f}   {rss / 2**20:8.1f}")
                mark += step
    finally:
        coord.close()


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 4 else f"{ranks[:3]}… ({len(ranks)})"


def profile(ranks: int, rate: float, seconds: float, pattern: str, top: int, via: str) -> None:
    spy = Path(PY).with_name("py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "coordinator.txt"
        dur = int(seconds) - 2
        coord = CoordinatorProc()
        try:
            # attach after registration: start loadgen, wait for load, then record by pid
            box: dict[str, Any] = {}
            th = threading.Thread(
                target=lambda: box.update(
                    loadgen(coord.port, ranks, rate, seconds, ["--pattern", pattern, *_via(via)])
                ),
                daemon=True,
            )
            th.start()
            while not coord.samples or coord.window(time.time() - 2, time.time())["cores"] in (None, 0.0):
                time.sleep(0.5)
            time.sleep(2.0 + ranks / 500)  # past registration, into the steady state
            rec = subprocess.run(
                [
                    *(str(spy), "record", "--pid", str(coord.ps.pid), "--duration", str(dur), "--rate", "200"),
                    *("--format", "raw", "--threads", "--gil", "-o", str(raw)),
                ],
                capture_output=True,
                text=True,
                timeout=dur + 60,
            )
            th.join(seconds + 300)
        finally:
            coord.close()
        if rec.returncode != 0 or not raw.exists():
            print(f"py-spy failed: {rec.stderr.strip()[-400:]}")
            return
        summarize_raw(raw, top)
        print(
            f"# load during the profile: {box.get('accepted_events_per_s')} accepted events/s of "
            f"{box.get('target_events_per_s')} scheduled; Report p99 {box.get('rpc_p99_ms')} ms"
        )


def summarize_raw(path: Path, top: int) -> None:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        frames = frames[1:]
        total += n
        threads[thread.split(" ")[-1] if " " in thread else thread] += n
        if frames:
            own[_fn(frames[-1])] += n
        for f in {_fn(f) for f in frames}:
            incl[f] += n
    if not total:
        print("no samples")
        return
    print(f"# py-spy: {total} samples (non-idle, all threads)")
    print("| self % | function |\n| ---: | --- |")
    for fn, n in own.most_common(top):
        print(f"| {100 * n / total:.1f} | `{fn}` |")
    print("\n| inclusive % | function |\n| ---: | --- |")
    for fn, n in incl.most_common(top + 10):
        print(f"| {100 * n / total:.1f} | `{fn}` |")


def _fn(frame: str) -> str:
    # "function (path/to/file.py:LINE)" -> "function (file.py)"
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(where.split('/')[-2:])})" if where else name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve", help="(internal) run the coordinator under test")
    s.add_argument("--data-dir", required=True)
    s.add_argument("--stuck-after", type=float, default=5.0)
    for name in ("ladder", "ceiling", "detect", "profile", "soak", "versus"):
        p = sub.add_parser(name)
        if name == "versus":
            p.add_argument(
                "--baseline", required=True, metavar="DIR", help="another checkout: `git worktree add DIR REV`"
            )
            p.add_argument("--pairs", type=int, default=3)
        p.add_argument("--pattern", default="ddp", choices=("ddp", "fsdp", "pipeline", "mixed", "tp"))
        p.add_argument("--runs", action="store_true", help="ranks send calls alike as runs (CallColumns.run)")
        p.add_argument(
            "--device",
            action="store_true",
            help="NCCL ranks: their batches carry device progress as node agents read it (tp, ddp, fsdp patterns)",
        )
        p.add_argument("--seconds", type=float, default=15.0)
        p.add_argument("--ranks", type=int, default=1024)
        p.add_argument("--rate", type=float, default=10.0)
        p.add_argument("--scales", default="8,64,256,1024,4096")
        p.add_argument("--rates", default="10,25,50,100")
        p.add_argument("--faults", default="stuck,shape,op,dtype,early_exit")
        p.add_argument("--fault-at", type=float, default=5.0)
        p.add_argument("--top", type=int, default=15)
        p.add_argument(
            "--via",
            default="direct" if name in ("detect", "profile", "soak") else "both",
            choices=("direct", "relay", "both"),
            help="ranks talk to the coordinator directly, through one node-agent relay per 8 ranks, or both "
            "side by side (ladder and ceiling only)",
        )
        p.add_argument("--relay-interval", type=float, help="the simulated agents' --relay-interval")
        p.add_argument(
            "--replay",
            action="store_true",
            help="the load generator builds every batch before the run and then only sends bytes, so "
            "it can offer loads it could not generate live on the cores it shares with the coordinator",
        )
    args = ap.parse_args(argv)
    if getattr(args, "replay", False):
        REPLAY.append("--replay")
    if getattr(args, "runs", False):
        REPLAY.append("--runs")
    if getattr(args, "device", False):
        REPLAY.append("--device")
    if getattr(args, "relay_interval", None):
        REPLAY.extend(["--relay-interval", str(args.relay_interval)])
    if args.mode == "serve":
        serve(args.data_dir, args.stuck_after)
    elif args.mode == "ladder":
        ladder([int(x) for x in args.scales.split(",")], args.rate, args.seconds, args.pattern, args.via)
    elif args.mode == "ceiling":
        ceiling(args.ranks, [float(x) for x in args.rates.split(",")], args.seconds, args.pattern, args.via)
    elif args.mode == "versus":
        versus(args.baseline, args.ranks, args.rate, args.seconds, args.pattern, args.pairs)
    elif args.mode == "detect":
        detect(args.ranks, args.rate, args.faults.split(","), args.pattern, args.fault_at, args.via)
    elif args.mode == "soak":
        soak(args.ranks, args.rate, args.seconds, args.pattern, args.via)
    else:
        profile(args.ranks, args.rate, args.seconds, args.pattern, args.top, args.via)
    return 0


if __name__ == "__main__":
    sys.exit(main())
