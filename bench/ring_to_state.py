"""The coordinator's cost per call, from its ranks' rings to its job state, by path:

- ``wire``: ``RingEncoder.encode`` → protobuf bytes → ``CallDecoder.decode`` → ``JobState.ingest``,
  call by call (a remote agent's or a relay's batches, before runs);
- ``wire runs``: the same with runs of alike calls in column entries (``CallColumns.run``: what a
  relay or a rank shipping its own ring sends a coordinator that takes runs);
- ``wire folded``: the same, the calls that repeat a cycle folded by the sender across polls and
  steps (``hangwatch.sendfold``: what a remote node agent sends now);
- ``typed``: ``RingEncoder.decode(runs=False)`` → ``JobState.ingest``, call by call (the embedded
  agent before runs);
- ``runs``: ``RingEncoder.decode`` → ``JobState.ingest`` with runs of alike calls
  (``records.CallRun``: the embedded agent now), gathered in C (``client/_fastpath.c``);
- ``runs, Python gather``: the same, gathered by the Python reference (``HANGWATCH_NATIVE=0``,
  and where the extension is not built).

``--ranks`` ranks (a real ``JobState`` with that many registered), each a ring of completed
4-float ``all_reduce`` calls on one call site (``--lines 2``: alternating with 8-float ones from
a second line, which runs carry as a cycle of two signatures), read in polls of each ``--batches`` size in turn
(the embedded agent reads every 50 ms: 5 calls a poll is 100 calls/s, 500 is 10,000/s), every
rank's poll in a round, then the engine's ``take_changes``. The reading of the ring itself
(``RingReader.poll``) is left out: it is the same for every path. Medians of ``--repeats``
interleaved runs.

    .venv/bin/python bench/ring_to_state.py [--ranks 4] [--calls 5000] [--batches 5,50,500] [--repeats 5] [--lines 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatch import records as r
from hangwatch.diagnosis import budget
from hangwatch.diagnosis.state import JobState
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch, Kind, RingReader, RingWriter
from hangwatch.ringwire import RingEncoder, call_blob
from hangwatch.sendfold import SenderFold
from hangwatch.signatures import CallDecoder

PY_RUNS = "runs, Python gather"
PATHS = ("wire", "wire runs", "wire folded", "typed", PY_RUNS, "runs")


def _polls(ranks: int, calls: int, batch: int, lines: int = 1) -> list[list[Batch]]:
    """Each rank's ring, written as the hook writes it, read in polls of ``batch`` calls."""
    out = []
    for rank in range(ranks):
        w = RingWriter(capacity=2 * calls + 8, blob_bytes=1 << 16, rank=rank)
        reader = RingReader(w.fd)
        refs = []
        for line in range(lines):
            meta = (r.TensorMeta((4 << line,), "float32"),)
            site = f"train.py:{9 + line} in step"
            refs.append(
                w.blob(call_blob(r.CallRecord(rank, 0, "all_reduce", "0", 0, meta, meta, "sum", call_site=site)))
            )
        t = 1.795e9 + rank * 1e-5
        for i in range(1, calls + 1):
            ref = refs[i % lines]
            w.write(Kind.ENTER, 0, 0, ref, i, i, 0, 0, t)
            w.write(Kind.EXIT, 0, 1, 0, i, 0, 0, 0, t + 1e-5)
            t += 1e-4
        out.append([reader.poll(2 * batch) for _ in range(calls // batch)])
        reader.close()
        w.close()
    return out


def _job(ranks: int) -> tuple[JobState, list[str]]:
    job, sessions = JobState(), []
    for rank in range(ranks):
        session = uuid.uuid4().hex
        job.register(r.RankIdentity("bench", rank, ranks, "node0", 1000 + rank, session=session), 0.0)
        sessions.append(session)
    return job, sessions


def run(path: str, polls: list[list[Batch]]) -> tuple[float, JobState, float]:
    """µs of CPU per call on ``path``, the job state it left, and µs per call of it the
    sender's encoding took (wire paths)."""
    ranks = len(polls)
    job, sessions = _job(ranks)
    encoders = [RingEncoder() for _ in range(ranks)]
    for encoder in encoders:
        encoder.send_runs = path in ("wire runs", "wire folded")
        encoder.fold = SenderFold() if path == "wire folded" else None
        encoder.send_cycles = path != "wire"  # a coordinator that takes runs takes cycles too
        encoder.native = path != PY_RUNS
    # (the decoder folds where its sender did, as a coordinator that takes them does)
    fold = path == "wire folded"
    decoders = [CallDecoder(cost=budget.call_bytes, charge=lambda n: True, fold=fold) for _ in range(ranks)]
    calls = 0
    encoding = 0.0
    t0 = time.process_time()
    for k in range(len(polls[0])):
        for rank in range(ranks):
            ring = polls[rank][k]
            if path.startswith("wire"):
                batch = pb.ReportBatch(rank=rank, session=sessions[rank])
                t_enc = time.process_time()
                encoders[rank].encode(ring, batch)
                encoding += time.process_time() - t_enc
                events = decoders[rank].decode(rank, pb.ReportBatch.FromString(batch.SerializeToString()))[0]
            else:
                events = encoders[rank].decode(ring, rank, budget.call_bytes, runs=path.startswith("runs"))
            job.ingest(sessions[rank], rank, events, now=1.795e9)
            calls += len(ring.slots) // 2
        job.take_changes()
    return 1e6 * (time.process_time() - t0) / calls, job, 1e6 * encoding / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5000, help="calls per rank")
    ap.add_argument("--batches", default="5,50,500", help="calls per poll, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lines", type=int, default=1, choices=(1, 2), help="call sites the calls alternate between")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]
    print(
        f"{args.ranks} ranks x {args.calls:,} completed all_reduce calls from {args.lines} line(s); "
        f"CPU µs per call, median of {args.repeats}"
    )
    print(
        "| calls per poll | " + " | ".join(PATHS) + " | wire / wire runs | wire runs / wire folded | typed / runs "
        "| Python gather / C | the sender's encoding: wire runs / wire folded | held by the job state after "
        "(typed / runs) |"
    )
    print("| ---: |" + " ---: |" * (len(PATHS) + 6))
    for batch in batches:
        polls = _polls(args.ranks, args.calls, batch, args.lines)
        figures: dict[str, list[float]] = {p: [] for p in PATHS}
        held: dict[str, int] = {}
        encodes: dict[str, list[float]] = {p: [] for p in PATHS}
        for _ in range(args.repeats):
            for path in PATHS:
                us, job, enc = run(path, polls)
                figures[path].append(us)
                encodes[path].append(enc)
                held[path] = job.held
                if "runs" in path:
                    assert job.runs_taken > 0 or batch < 2 * args.lines, "no run was taken"
                    assert job.cycle_calls > 0 or args.lines == 1 or batch < 4, "no cycle was taken"
                assert job.records_received == args.ranks * (args.calls // batch) * batch
        med = {p: statistics.median(v) for p, v in figures.items()}
        print(
            f"| {batch:,} | "
            + " | ".join(f"{med[p]:.2f}" for p in PATHS)
            + f" | {med['wire'] / med['wire runs']:.1f}x "
            f"| {med['wire runs'] / med['wire folded']:.2f}x "
            f"| {med['typed'] / med['runs']:.1f}x "
            f"| {med[PY_RUNS] / med['runs']:.2f}x "
            f"| {statistics.median(encodes['wire runs']):.2f} / {statistics.median(encodes['wire folded']):.2f} "
            f"| {held['typed'] / 1024:,.0f} / {held['runs'] / 1024:,.0f} KiB |"
        )


if __name__ == "__main__":
    main()
