"""The embedded agent's path from a rank's ring to the job state, per call: through the wire
(``RingEncoder.encode`` → protobuf bytes → ``CallDecoder.decode``, as a remote agent's batches
go) against typed (``RingEncoder.decode``, what the coordinator's own agent does since issue 16),
each followed by ``JobState.ingest``. One rank's ring of completed 4-float ``all_reduce`` calls
on one call site, read in polls of ``--batch`` calls; medians of ``--repeats`` interleaved runs.

    .venv/bin/python bench/ring_to_state.py [--calls 20000] [--batch 500] [--repeats 7]
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
from hangwatch.coordinator import budget
from hangwatch.coordinator.state import JobState
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Kind, RingReader, RingWriter
from hangwatch.ringwire import RingEncoder, call_blob
from hangwatch.signatures import CallDecoder


def _polls(calls: int, batch: int) -> tuple[list, RingWriter]:  # type: ignore[type-arg]
    w = RingWriter(capacity=4 * calls, blob_bytes=1 << 16)
    reader = RingReader(w.fd)
    meta = (r.TensorMeta((4,), "float32"),)
    ref = w.blob(call_blob(r.CallRecord(0, 0, "all_reduce", "0", 0, meta, (), "sum", call_site="train.py:9 in step")))
    polls = []
    t = 1.795e9
    for i in range(1, calls + 1):
        w.write(Kind.ENTER, 0, 0, ref, i, i, 0, 0, t)
        w.write(Kind.EXIT, 0, 1, 0, i, 0, 0, 0, t + 1e-5)
        t += 1e-4
        if i % batch == 0:
            polls.append(reader.poll())
    return polls, w


def _job() -> tuple[JobState, str]:
    job, session = JobState(), uuid.uuid4().hex
    job.register(r.RankIdentity("bench", 0, 1, "node0", 1000, session=session), 0.0)
    return job, session


def wire(polls: list, ingest: bool = True) -> float:  # type: ignore[type-arg]
    job, session = _job()
    enc, dec = RingEncoder(), CallDecoder(cost=budget.call_bytes, charge=lambda n: True)
    n = 0
    t0 = time.perf_counter()
    for ring in polls:
        batch = pb.ReportBatch(rank=0, session=session)
        enc.encode(ring, batch)
        msg = pb.ReportBatch.FromString(batch.SerializeToString())
        events = dec.decode(0, msg)[0]
        if ingest:
            job.ingest(session, 0, events, now=0.0)
        n += len(ring.slots) // 2
    return 1e6 * (time.perf_counter() - t0) / n


def typed(polls: list, ingest: bool = True) -> float:  # type: ignore[type-arg]
    job, session = _job()
    enc = RingEncoder()
    n = 0
    t0 = time.perf_counter()
    for ring in polls:
        events = enc.decode(ring, 0, budget.call_bytes)
        if ingest:
            job.ingest(session, 0, events, now=0.0)
        n += len(ring.slots) // 2
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    polls, w = _polls(args.calls, args.batch)
    runs: dict[str, list[float]] = {
        "wire, records only": [],
        "typed, records only": [],
        "wire, into the job state": [],
        "typed, into the job state": [],
    }
    for _ in range(args.repeats):
        runs["wire, records only"].append(wire(polls, ingest=False))
        runs["typed, records only"].append(typed(polls, ingest=False))
        runs["wire, into the job state"].append(wire(polls))
        runs["typed, into the job state"].append(typed(polls))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print("| path, ring to job state | µs per call (median) | runs |\n| --- | ---: | --- |")
    for k, v in runs.items():
        print(f"| {k} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    print(
        f"typed / wire: records {med['typed, records only'] / med['wire, records only']:.2f}, "
        f"into the state {med['typed, into the job state'] / med['wire, into the job state']:.2f}"
    )
    w.close()


if __name__ == "__main__":
    main()
