"""What one rank's batch costs the coordinator's handler, this tree against another, on one load.

    .venv/bin/python bench/batchcost.py --baseline DIR [--ranks 8192] [--rates 10,50]
                                        [--patterns fsdp,tp] [--faults none,shape] [--pairs 2]
                                        [--device off|on|both] [--cadence relay|agent|...]

``bench/scale.py`` runs the coordinator on the real clock, where a figure near saturation moves
with everything else the machine does. Here each tree's load is built once by its own
``bench/loadgen.py`` (as ``scale.py`` builds it: what that tree's senders send, so a tree whose
node agents fold their ranks' cycles is measured on folded batches) and written to a file;
each run is a fresh process that registers the
ranks and hands every relay call to the ``ReportMany`` handler at once, one after another, with
the collector tuned as the daemon tunes it. It prints the handler thread's CPU per rank batch
once past ``--warmup`` seconds of the load (a rank's first calls travel one by one), and the
CPU the ranks' registrations took. The trees alternate, ``--pairs`` runs each; medians and the
ratio (this tree over the baseline) are printed. The detectors run beside, as in the daemon,
but the clock is not the load's: no incident is judged here (``scale.py`` does that).
"""

from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(
    ranks: int,
    rate: float,
    pattern: str,
    fault: str,
    seconds: float,
    fault_at: float,
    path: str,
    device: bool = False,
    cadence: str = "relay",
) -> None:
    """The load's relay calls, and the ranks' identities, into ``path``."""
    import loadgen
    import scale

    cfg = scale.replayed(ranks, rate, pattern, fault, device, seconds, fault_at, cadence)
    worker = loadgen.Worker(cfg, list(range(ranks)))
    sends = [(offset, raw, nrep) for offset, _, raw, nrep, _, _ in worker.build_sends()]
    with open(path, "wb") as f:
        pickle.dump({"identities": [sim.identity for sim in worker.sims], "sends": sends}, f)


def one(path: str, warmup: float) -> dict[str, float]:
    """One run of this process's coordinator on the load in ``path``."""
    import logging

    import scale

    from hangwatch import gctune
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
    from hangwatch.protos import hangwatch_pb2 as pb

    with open(path, "rb") as f:
        load = pickle.load(f)
    logging.disable(logging.WARNING)
    coord = Coordinator(
        CoordinatorOptions(host="127.0.0.1", port=0, data_dir=tempfile.mkdtemp(prefix="hw-cost-"), embedded_agent=False)
    )
    coord.start()
    gctune.tune()
    try:
        took = time.process_time()
        for identity in load["identities"]:
            coord.accept_registration(identity, "direct")
        registered = time.process_time() - took
        for identity in load["identities"]:
            coord.accept_report(pb.ReportBatch(rank=identity.rank, session=identity.session, sent_time=0.0))
        handler = coord.server.servicer.ReportMany if coord.server else None
        assert handler is not None
        handled, batches, last = 0.0, 0, warmup
        context = scale._Context()
        for offset, raw, nrep in load["sends"]:
            last = max(last, offset)
            request = pb.RelayBatch.FromString(raw)
            took = time.thread_time()
            handler(request, context)
            if offset >= warmup:
                handled += time.thread_time() - took
                batches += nrep
    finally:
        coord.stop(0.2)
    # the handler's CPU over the load's own seconds: the cores it takes to keep up (comparable
    # where two trees' senders send different numbers of batches)
    cores = handled / (last - warmup) if last > warmup else 0.0
    return {"us_per_batch": 1e6 * handled / max(1, batches), "register_s": registered, "cores": cores}


def _build(tree: str | None, path: str, load: tuple[object, ...], device: bool, cadence: str) -> str:
    """The load ``tree``'s own load generator builds (None: this tree's), into ``path``."""
    ranks, rate, pattern, fault, seconds, fault_at = load
    if tree is None:
        build(ranks, rate, pattern, fault, seconds, fault_at, path, device, cadence)  # type: ignore[arg-type]
        return path
    code = (
        f"import sys; sys.path.insert(0, {str(Path(tree) / 'bench')!r}); import batchcost; "
        f"batchcost.build({ranks!r}, {rate!r}, {pattern!r}, {fault!r}, {seconds!r}, {fault_at!r}, {path!r}, "
        f"{device!r}, {cadence!r})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tree), check=False
    )
    if out.returncode:
        raise SystemExit(f"batchcost: building {tree}'s load failed:\n{out.stderr[-3000:]}")
    return path


def _run(tree: str | None, path: str, warmup: float) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    out = subprocess.run(
        [sys.executable, __file__, "--one", path, "--warmup", str(warmup)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"batchcost: a run failed:\n{out.stderr[-3000:]}")
    values = out.stdout.strip().splitlines()[-1].split()
    return {"us_per_batch": float(values[0]), "register_s": float(values[1]), "cores": float(values[2])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8192")
    ap.add_argument("--rates", default="10,50")
    ap.add_argument("--patterns", default="fsdp,tp")
    ap.add_argument("--faults", default="none,shape")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--fault-at", type=float, default=6.0, help="seconds into the load (the culprit: ranks / 2 + 1)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--device", choices=("off", "on", "both"), default="off", help="NCCL device progress in batches")
    ap.add_argument("--cadence", default="relay", help="how batches reach the coordinator (as bench/scale.py)")
    ap.add_argument("--baseline", help="another checkout, run on the same load, alternating")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal) one run on the load in this file
    args = ap.parse_args(argv)
    if args.one:
        res = one(args.one, args.warmup)
        print(f"{res['us_per_batch']:.2f} {res['register_s']:.3f} {res['cores']:.4f}")
        return 0
    trees: list[tuple[str, str | None]] = [("this", None)]
    if args.baseline:
        trees.append((Path(args.baseline).name, str(Path(args.baseline).resolve())))
    names = " | ".join(f"{name} µs a rank batch | {name} handler cores | {name} registrations s" for name, _ in trees)
    print(f"| ranks | coll/s | pattern | device | fault | {names} | ratio of µs | ratio of cores |")
    print("| ---: | ---: | --- | --- | --- |" + " ---: |" * (3 * len(trees) + 2), flush=True)
    devices = {"off": [False], "on": [True], "both": [False, True]}[args.device]
    for ranks in map(int, args.ranks.split(",")):
        for rate in map(float, args.rates.split(",")):
            for pattern, device, fault in itertools.product(args.patterns.split(","), devices, args.faults.split(",")):
                with tempfile.TemporaryDirectory(prefix="hw-cost-") as tmp:
                    load = (ranks, rate, pattern, fault, args.seconds, args.fault_at)
                    paths = {name: _build(tree, os.path.join(tmp, f"{i}.pkl"), load, device, args.cadence)
                             for i, (name, tree) in enumerate(trees)}  # fmt: skip
                    got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
                    for _ in range(args.pairs):
                        for name, tree in trees:
                            got[name].append(_run(tree, paths[name], args.warmup))
                cells, medians, cores = [], [], []
                for name, _ in trees:
                    us = statistics.median(r["us_per_batch"] for r in got[name])
                    core = statistics.median(r["cores"] for r in got[name])
                    reg = statistics.median(r["register_s"] for r in got[name])
                    medians.append(us)
                    cores.append(core)
                    cells.append(f"{us:.1f} | {core:.3f} | {reg:.2f}")
                ratio = f"{medians[0] / medians[1]:.2f}" if len(medians) > 1 else "-"
                ratio += f" | {cores[0] / cores[1]:.2f}" if len(cores) > 1 and cores[1] else " | -"
                on = "on" if device else "off"
                print(
                    f"| {ranks} | {rate:g} | {pattern} | {on} | {fault} | {' | '.join(cells)} | {ratio} |", flush=True
                )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HANGWATCH_NO_AGENT", "1")
    sys.exit(main())
