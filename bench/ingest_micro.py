"""Coordinator ingest in-process: bytes, decode and apply per collective, the two wire forms side by side.

    .venv/bin/python bench/ingest_micro.py [--ranks 1024] [--calls 50] [--rounds 4]

Builds what ``--ranks`` ranks send in ``--rounds`` batches of ``--calls`` completed all_reduces
each, in both forms the coordinator accepts: every call and exit spelled out as events (the form
before call interning, still accepted), and interned (``Signature`` once, then ``CallColumns``
with exits folded in). Then parses, decodes and applies them to a real ``JobState`` with
``JobState.ingest``, rank after rank and round after round, as the servicer would. No gRPC:
this is the part of a Report that is hangwatch's own code. Prints one line per form and the ratios.
"""

from __future__ import annotations

import argparse
import time
import uuid

from hangwatch import records as r
from hangwatch import wire
from hangwatch.columns import CallEncoder
from hangwatch.diagnosis import budget
from hangwatch.diagnosis.state import JobState
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.signatures import CallDecoder


def _events(rank: int, first: int, n: int) -> list[r.RankEvent]:
    out: list[r.RankEvent] = []
    t = 1.795e9 + first * 0.01
    for i in range(first, first + n):
        out.append(
            r.CallRecord(
                rank=rank,
                call_id=i,
                op="all_reduce",
                group="0",
                seq=i,
                inputs=(r.TensorMeta((6_553_600 - 1_000_000 * (i % 4),), "float32", "cuda"),),
                reduce_op="sum",
                async_op=True,
                step=i // 4,
                call_site=f"train.py:{120 + i % 4}",
                enter_time=t + i * 0.01,
            )
        )
        out.append(r.CallExit(rank, i, t + i * 0.01 + 0.005))
    return out


def _job(ranks: int) -> tuple[JobState, list[str]]:
    job, sessions = JobState(), [uuid.uuid4().hex for _ in range(ranks)]
    for k, session in enumerate(sessions):
        job.register(r.RankIdentity("bench", k, ranks, f"node{k // 8}", 1000 + k, session=session), 0.0)
    return job, sessions


def run(form: str, ranks: int, calls: int, rounds: int) -> dict[str, float]:
    job, sessions = _job(ranks)
    encoders = [CallEncoder() for _ in range(ranks)]
    # as the daemon makes them: each signature's byte cost worked out once (the memory budget's)
    decoders = [CallDecoder(cost=budget.call_bytes, charge=lambda n: True) for _ in range(ranks)]
    payloads: list[bytes] = []
    for rnd in range(rounds):
        for k in range(ranks):
            batch = pb.ReportBatch(rank=k, session=sessions[k])
            events = _events(k, 1 + rnd * calls, calls)
            if form == "interned":
                encoders[k].encode(events, batch)
            else:
                for ev in events:
                    wire.event_to_pb(ev, batch.events.add())
            payloads.append(batch.SerializeToString())
    t0 = time.perf_counter()
    msgs = [pb.ReportBatch.FromString(p) for p in payloads]
    t1 = time.perf_counter()
    if form == "interned":
        decoded = [decoders[m.rank].decode(m.rank, m)[0] for m in msgs]
    else:
        decoded = [[wire.event_from_pb(m.rank, e) for e in m.events] for m in msgs]
    t2 = time.perf_counter()
    for m, events in zip(msgs, decoded, strict=True):
        job.ingest(m.session, m.rank, events, now=0.0)  # what Coordinator.report calls
    t3 = time.perf_counter()
    n = ranks * calls * rounds
    return {
        "bytes": sum(map(len, payloads)) / n,
        "parse": 1e6 * (t1 - t0) / n,
        "decode": 1e6 * (t2 - t1) / n,
        "apply": 1e6 * (t3 - t2) / n,
        "total": 1e6 * (t3 - t0) / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=50, help="collectives per batch")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    print(f"# {args.ranks} ranks x {args.rounds} batches of {args.calls} completed all_reduces, per collective")
    print("| form | bytes | parse µs | decode µs | apply µs | total µs |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    results = {}
    for form in ("events", "interned"):
        res = results[form] = run(form, args.ranks, args.calls, args.rounds)
        print(
            f"| {form} | {res['bytes']:.1f} | {res['parse']:.2f} | {res['decode']:.2f} | {res['apply']:.2f} "
            f"| {res['total']:.2f} |"
        )
    e, i = results["events"], results["interned"]
    print(f"ratios events/interned: bytes {e['bytes'] / i['bytes']:.1f}x, total {e['total'] / i['total']:.1f}x")


if __name__ == "__main__":
    main()
