"""The coordinator's memory budget (issue 15): what a healthy job is charged under the default
budgets, and what a hostile flood costs with the budget and without it, measured side by side.

    .venv/bin/python bench/budget.py                 # about 5 minutes
    .venv/bin/python bench/budget.py --ranks 1024,4096 --steps 80

1. Healthy jobs of ``--ranks`` ranks in a real ``JobState`` under the default budgets: a world
   group, tensor-parallel groups of 8 and the data-parallel groups across them, and per step 4
   completed ``all_reduce`` calls per rank (bf16, realistic call sites). Printed: bytes charged,
   its share of the job's budget, refusals and history trimmed.
2. One flood through a real coordinator's RPCs (``tests/coordinator/test_budget_rpc.py``'s: many
   groups, thousands of open calls, signatures with the longest strings ``wire`` lets in), once
   with budgets of 0.5/2/4 MiB and once with no effective budget; Python's traced memory
   (``tracemalloc``) past the idle coordinator, and what the budget held.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state import JobState

MIB = 1 << 20
SITE = "/workspace/megatron/core/tensor_parallel/layers.py:{} in forward"


def healthy(n: int, steps: int, tp: int = 8) -> str:
    ledger = b.Ledger(b.Budget())
    job = JobState(ledger)
    states = [
        job.register(r.RankIdentity("big", k, n, f"node{k // 8}", 1000 + k, session=f"s{k}"), 0.0) for k in range(n)
    ]
    t = 1.0
    for k in range(n):
        base = k - k % tp
        groups = [
            r.GroupInfo(f"tp{k // tp}", tuple(range(base, base + tp)), "nccl", 1),
            r.GroupInfo(f"dp{k % tp}", tuple(range(k % tp, n, tp)), "nccl", 2),
        ]
        events = [r.GroupEvent(k, r.GroupEventKind.CREATED, g, t) for g in groups]
        job.ingest(f"s{k}", k, events, now=t)
    ids = [0] * n
    seqs: dict[tuple[int, str], int] = {}
    started = time.perf_counter()
    for step in range(steps):
        t += 1.0
        for k in range(n):
            calls: list[r.RankEvent] = []
            tp_group, dp_group = f"tp{k // tp}", f"dp{k % tp}"
            shapes = (
                ("0", (25_000_000,)),
                (tp_group, (4096, 8192)),
                (dp_group, (1_000_000,)),
                (tp_group, (4096, 8192)),
            )
            for j, (g, shape) in enumerate(shapes):
                ids[k] += 1
                seq = seqs[(k, g)] = seqs.get((k, g), 0) + 1
                meta = (r.TensorMeta(shape, "bfloat16", f"cuda:{k % 8}"),)
                enter = t + j * 0.01
                site = SITE.format(100 + j)
                calls.append(r.CallRecord(k, ids[k], "all_reduce", g, seq, meta, (), "sum", step=step, call_site=site,
                                          enter_time=enter, exit_time=enter + 0.005))  # fmt: skip
            job.ingest(f"s{k}", k, calls, now=t)
    per_rank = max(st.held + st.calls for st in states)
    return (
        f"| {n:,} ranks, {steps} steps | {job.held / MIB:,.0f} MiB | {100 * job.held / ledger.budget.job:.0f} % | "
        f"{job.refused} | {ledger.trimmed} | {per_rank / MIB:.2f} MiB | {time.perf_counter() - started:.0f} s |"
    )


def flood(limits: tuple[float, float, float]) -> tuple[float, float]:
    from tests.coordinator.test_budget_rpc import traced_flood

    plan = [(job, rank, 3000, 2000, 300, True, 50) for job in range(4) for rank in range(8)]
    used, budget = traced_flood(tempfile.mkdtemp(), limits, plan)
    return used / MIB, budget["held_bytes"] / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024", help="healthy job sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    print("| healthy job (world, tp 8, dp) | charged | of the job budget | refused | trimmed | largest rank | took |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(x) for x in args.ranks.split(",") if x):
        print(healthy(n, args.steps))
    print()
    what = "flood: 4 jobs x 8 ranks, each 3,000 groups, 2,000 open calls, 300 long signatures"
    print(f"| {what} | traced past idle | charged |")
    print("| --- | ---: | ---: |")
    for name, limits in (("budgets 0.5 / 2 / 4 MiB", (0.5, 2.0, 4.0)), ("no effective budget", (1e5, 1e5, 1e5))):
        used, held = flood(limits)
        print(f"| {name} | {used:.1f} MiB | {held:.1f} MiB |")


if __name__ == "__main__":
    main()
