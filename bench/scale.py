"""The coordinator alone at scale: replayed batches applied in process, on the real clock.

    .venv/bin/python bench/scale.py [--ranks 4096,8192,16384] [--rates 10,50] [--patterns fsdp,tp]
                                    [--faults none,stuck,shape] [--device both] [--seconds 12]

On two cores the load generator cannot offer 8,192 ranks next to a coordinator (``ingest.py``
says so). Here ``bench/loadgen.py`` builds every relay call of the run first (the real encoder,
the real schedule, 8 ranks a node, each node's batches of one relay interval in one
``RelayBatch``), and this process then hands each call's bytes to the coordinator's own
``ReportMany`` handler at its time, one after another, as the server's handler thread would:
parsing, decoding, the job state and the detectors are all the coordinator's. What is left out
is gRPC's transport. CPU is the process's own over the replay (the replay loop only sleeps and
calls the handler), after ``--warmup`` seconds (a rank's first calls travel one by one, and
the steady state is what a long job pays); ``late`` is how long after its time the last call
went in; memory is the RSS the replay added.

A fault run says which incident came, on which ranks, and how long after the fault's onset; a
healthy run must raise nothing. Each run is a fresh process; ``--baseline DIR`` runs each
again with another checkout's coordinator (the load is built by this tree's ``loadgen``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen

from hangwatch import gctune
from hangwatch.agent.shipped import READ_S, TICK_S
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
from hangwatch.protos import hangwatch_pb2 as pb

EXPECTED = {"stuck": "stuck_collective", "shape": "shape_mismatch", "op": "op_mismatch", "early_exit": "early_exit"}
STUCK_AFTER = 5.0
#: After the last call, how long the detectors get to tell what they saw.
SETTLE_S = 4.0


class _Context:
    """The handler's context: every call here carries the right token, so it is never used."""

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


#: How batches reach the coordinator. "relay": ranks send every ``report_interval_for`` (2 s
#: from 2,048 ranks), a node's batches of one relay interval in one call (agentless ranks through
#: a relaying agent; issue 40's tables before its fourth session). "agent": as a node agent's
#: shipper sends its steady ranks' records: as far apart as the coordinator asks, the 8 ranks of
#: a node read on one tick and sent at once in one call. "agent-alone": so, but each batch in a
#: call of its own (the agent before its fifth session); "agent-read-s": alone, every ``READ_S``
#: (0.4 s) whatever the coordinator asked (before its fourth).
CADENCES = ("relay", "agent", "agent-alone", "agent-read-s")


def replayed(
    ranks: int,
    rate: float,
    pattern: str,
    fault: str,
    device: bool,
    seconds: float,
    fault_at: float,
    cadence: str = "relay",
) -> loadgen.Config:
    """A load to replay: relays of 8 ranks (or each rank's batches alone, ``cadence``), runs, the
    culprit ``ranks / 2 + 1``, never dialled."""
    agent = cadence.startswith("agent")
    return loadgen.Config(
        addr="127.0.0.1:9",
        token="",
        ranks=ranks,
        rate=rate,
        seconds=seconds,
        pattern=pattern,
        fault=fault,
        fault_rank=min(ranks - 1, ranks // 2 + 1),
        fault_at=fault_at,
        job_id=f"scale-{uuid.uuid4().hex[:6]}",
        threads=1,
        timeout_s=5.0,
        relay=True,
        replay=True,
        runs=True,
        device=device,
        ranks_per_node=8 if cadence in ("relay", "agent") else 1,
        relay_interval=TICK_S if agent else loadgen.RELAY_INTERVAL_S,
        interval_s=READ_S if cadence == "agent-read-s" else 0.0,
        together=agent,
        fold=agent,  # node agents fold their ranks' cycles (``sendfold``)
    )


def one(warmup: float = 4.0, **load: Any) -> dict[str, Any]:
    """One run: the load ``replayed`` builds of ``load``, CPU counted past ``warmup`` seconds."""
    cfg = replayed(**load)
    ranks = cfg.ranks
    built = time.perf_counter()
    worker = loadgen.Worker(cfg, list(range(ranks)))
    sends = worker.build_sends()
    built = time.perf_counter() - built
    payloads = [(offset, raw, nrep, ncalls) for offset, _, raw, nrep, _, ncalls in sends]
    del sends
    gc.collect()
    proc = psutil.Process()
    with _quiet_logs():
        coord = Coordinator(
            CoordinatorOptions(
                host="127.0.0.1", port=0, data_dir=_tmpdir(), embedded_agent=False, stuck_after=STUCK_AFTER
            )
        )
        coord.start()
        gctune.tune()  # as ``hangwatch coordinator`` does once started
        try:
            for sim in worker.sims:
                reply = coord.accept_registration(sim.identity, "direct")
                if not cfg.interval_s and abs(reply.report_interval_s - sim.interval) > 1e-9:
                    raise SystemExit(f"coordinator asked for {reply.report_interval_s} s, built for {sim.interval}")
            for sim in worker.sims:  # a first, empty batch each, as loadgen's heartbeats
                coord.accept_report(pb.ReportBatch(rank=sim.rank, session=sim.identity.session, sent_time=0.0))
            handler = coord.server.servicer.ReportMany if coord.server else None
            assert handler is not None
            ctx = _Context()
            rss0 = proc.memory_info().rss
            t0 = time.time() + 0.5
            cpu0, steady_at = None, 0.0
            behind: list[float] = []
            calls = 0
            handled, reports = 0.0, 0  # the handler's own CPU, and the rank batches it took, once steady
            for offset, raw, nrep, ncalls in payloads:
                if cpu0 is None and offset >= warmup:  # a rank's first calls go one by one: past them
                    cpu0, steady, steady_at = proc.cpu_times(), time.time(), offset
                due = t0 + offset
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)
                else:
                    behind.append(-delay)
                request = pb.RelayBatch.FromString(raw)
                took = time.thread_time()
                handler(request, ctx)
                if cpu0 is not None:
                    handled += time.thread_time() - took
                    reports += nrep
                calls += ncalls
            late = max(0.0, time.time() - (t0 + payloads[-1][0]))
            cpu1 = proc.cpu_times()
            assert cpu0 is not None, "a run shorter than its warm-up"
            wall = time.time() - steady
            time.sleep(SETTLE_S)
            rss1 = proc.memory_info().rss
            status = coord.status()
            assert status is not None
            incidents = coord.incidents_json()
        finally:
            coord.stop(0.2)
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    onset = t0 + worker.fault_index / cfg.rate if cfg.fault != "none" else None
    want = EXPECTED.get(cfg.fault)
    hit = [i for i in incidents if i["kind"] == want and cfg.fault_rank in i["culprit_ranks"]] if want else []
    return {
        "ranks": ranks,
        "rate": cfg.rate,
        "pattern": cfg.pattern,
        "device": cfg.device,
        "fault": cfg.fault,
        "fault_rank": cfg.fault_rank if want else None,
        "built_s": built,
        "calls_per_s": calls / cfg.seconds,
        "relay_calls_per_s": len(payloads) / cfg.seconds,
        "cores": cpu / wall,
        # the cores it would take to keep up: its CPU over the load's own time (above 1: saturated)
        "demand": cpu / (payloads[-1][0] - steady_at),
        "cpu_us_per_rank_s": 1e6 * cpu / wall / ranks,
        # the handler thread's CPU for one rank's batch (decoded, applied), the detectors' left out
        "us_per_batch": 1e6 * handled / max(1, reports),
        "late_s": late,
        "behind_p99_s": sorted(behind)[int(0.99 * len(behind))] if behind else 0.0,
        "rss_mb": (rss1 - rss0) / 2**20,
        "behind_s": status["job"].get("behind_s"),
        # what the memory budget charges the job, and what it refused
        "held_mb": status["job"]["budget"]["job_held_bytes"] / 2**20,
        "refused": status["job"]["budget"]["job_refused"],
        "hit": hit[0] if hit else None,
        "onset": onset,
        "incidents": incidents,
    }


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="hw-scale-")


class _quiet_logs:
    def __enter__(self) -> None:
        import logging

        logging.disable(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        import logging

        logging.disable(logging.NOTSET)


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 3 else f"{ranks[:3]}… ({len(ranks)})"


def _run(tree: str | None, config: dict[str, Any]) -> dict[str, Any]:
    """One run in a fresh process, with ``tree``'s coordinator (None: this one's), on the load
    its own ``bench/loadgen.py`` builds (what its senders send)."""
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    script = str(Path(tree) / "bench" / "scale.py") if tree else __file__
    out = subprocess.run(
        [sys.executable, script, "--one", json.dumps(config)], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode:
        raise SystemExit(f"scale: a run failed ({config}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _row(tree: str, config: dict[str, Any], res: dict[str, Any]) -> str:
    fault = config["fault"]
    hit = res["hit"]
    others = sorted({f"{i['kind']} {_short(i['culprit_ranks'])}" for i in res["incidents"] if i != hit})
    if fault == "none":
        told, culprits, after = "-", "-", "-"
    elif hit:
        told, culprits, after = hit["kind"], _short(hit["culprit_ranks"]), f"{hit['detected_time'] - res['onset']:.2f}"
    else:
        told, culprits, after = f"MISSED ({EXPECTED[fault]})", "-", "-"
    return (
        f"| {tree} | {config['ranks']} | {config['rate']:g} | {config['pattern']} "
        f"| {'on' if config['device'] else 'off'} | {fault} | {res['relay_calls_per_s']:.0f} | {res['cores']:.2f} "
        f"| {res['demand']:.2f} | {res['us_per_batch']:.1f} "
        f"| {res['cpu_us_per_rank_s']:.1f} | {res['late_s']:.2f} | {res['rss_mb']:.0f} "
        f"| {res.get('held_mb', 0):.0f} / {res.get('refused', 0)} | {told} | {culprits} "
        f"| {after} | {', '.join(others) or '-'} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4096,8192,16384")
    ap.add_argument("--rates", default="10,50")
    ap.add_argument("--patterns", default="fsdp,tp")
    ap.add_argument("--faults", default="none,stuck,shape")
    ap.add_argument("--device", choices=("off", "on", "both"), default="off")
    ap.add_argument("--seconds", type=float, default=14.0)
    ap.add_argument("--fault-at", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds before CPU is counted")
    ap.add_argument("--cadence", choices=CADENCES, default="relay", help="how batches reach the coordinator")
    ap.add_argument("--baseline", help="another checkout: each run again with its coordinator, next to this one's")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal) one run, its config as JSON
    args = ap.parse_args(argv)
    if args.one:
        res = one(**json.loads(args.one))
        print(json.dumps(res, default=str))
        return 0
    devices = {"off": [False], "on": [True], "both": [False, True]}[args.device]
    trees: list[tuple[str, str | None]] = [("this", None)]
    if args.baseline:
        trees.append((Path(args.baseline).name, str(Path(args.baseline).resolve())))
    print(
        "| tree | ranks | coll/s | pattern | device | fault | relay calls/s | cores | demand | µs a rank batch "
        "| µs CPU per rank-s | late s "
        "| RSS added MB | charged MB / refused | incident | culprits | after onset s | other incidents |"
    )
    print(
        "| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- | --- | ---: | --- |",
        flush=True,
    )
    for ranks in map(int, args.ranks.split(",")):
        for rate in map(float, args.rates.split(",")):
            for pattern in args.patterns.split(","):
                for device in devices:
                    for fault in args.faults.split(","):
                        config = {
                            "ranks": ranks,
                            "rate": rate,
                            "pattern": pattern,
                            "fault": fault,
                            "device": device,
                            "seconds": args.seconds,
                            "fault_at": args.fault_at,
                            "warmup": args.warmup,
                            "cadence": args.cadence,
                        }
                        for name, tree in trees:
                            print(_row(name, config, _run(tree, config)), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HANGWATCH_NO_AGENT", "1")
    sys.exit(main())
