"""Diagnosis quality: real jobs with a known root cause (or none), what hangwatch reported.

Usage (about 4 minutes on 2 cores): ``.venv/bin/python bench/diagnosis_quality.py [--only NAME]``

Each scenario is a real torchrun gloo job (the programs of ``tests/e2e``, where each one is
also asserted) attached to a real coordinator in this process (stuck threshold 3 s). A faulty
job runs until its expected incident appears (or 60 s); a healthy one runs to its end, then 4 s
more. The table printed is what BENCHMARKS.md quotes: the scenario, the root cause a person
would name, what hangwatch reported (kind and culprit ranks of every incident) and how many
incidents that root cause produced.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
from tests.conftest import PRELUDE
from tests.e2e import (
    healthy,
    test_async,
    test_ddp_skip,
    test_fault_classes,
    test_healthy_p2p,
    test_healthy_training,
    test_runs,
    test_sequences,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    body: str
    nproc: int
    expected: str  # the root cause as a person would name it
    kind: str | None  # the incident expected (None: a healthy job, nothing expected)


HEALTHY = "none (healthy)"
SCENARIOS = (
    Scenario("early stop (DDP)", test_fault_classes.EARLY_EXIT_DDP, 2, "rank 1 left the loop at step 5", "early_exit"),
    Scenario("stalled rank", test_fault_classes.STUCK_SLEEP, 2, "rank 1 never reached all_reduce (step 3)",
             "stuck_collective"),
    Scenario("async call skipped", test_async.SKIPS_AN_ASYNC_CALL, 3, "rank 1 never issued the async all_reduce",
             "stuck_collective"),
    Scenario("stall after monitored barriers", test_sequences.HANG_AFTER_MONITORED_BARRIERS, 3,
             "rank 2 stalled before all_reduce (step 7)", "stuck_collective"),
    Scenario("NaN batch skipped (DDP)", test_ddp_skip.NAN_SKIP, 2,
             "rank 1 ran forward 6 (step 5) without backward", "stuck_collective"),
    Scenario("own early stop at the last step (DDP)", test_ddp_skip.EARLY_STOP, 2, "rank 1 left the loop at step 23",
             "early_exit"),
    Scenario("reduce-op mismatch every step", test_runs.REDUCE_OP_EVERY_STEP, 2, "rank 1 reduces with MAX",
             "arg_mismatch"),
    Scenario("pipeline, last stage leaves first", healthy.INIT + test_healthy_p2p.PIPELINE, 3, "none (healthy)", None),
    Scenario("monitored barriers between phases", healthy.INIT + test_healthy_p2p.MONITORED_BARRIER, 3, HEALTHY, None),
    Scenario("DDP Join, uneven inputs", healthy.INIT + test_healthy_training.DDP_JOIN, 2, "none (healthy)", None),
    Scenario("rank 0 evaluates alone (1.5 s)", healthy.INIT + test_healthy_training.SOLO_EVAL, 2, HEALTHY, None),
)  # fmt: skip


def run(scenario: Scenario, workdir: Path) -> tuple[list[dict[str, object]], float]:
    c = Coordinator(CoordinatorOptions(host="127.0.0.1", port=0, data_dir=tempfile.mkdtemp(), stuck_after=3.0))
    c.start()
    script = workdir / f"{scenario.name.replace(' ', '_').replace(',', '')}.py"
    script.write_text(PRELUDE + textwrap.dedent(scenario.body))
    t0 = time.monotonic()
    job = testing.torchrun(script, nproc=scenario.nproc, env=testing.job_env(f"127.0.0.1:{c.port}", None),
                           cwd=workdir, log=workdir / f"{script.stem}.log")  # fmt: skip
    try:
        if scenario.kind is None:
            job.wait(180)
            time.sleep(4)
        else:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(i["kind"] == scenario.kind for i in c.incidents_json()):
                time.sleep(0.2)
            time.sleep(4)  # anything else it would report about the same fault
        took = time.monotonic() - t0
        return c.incidents_json(), took
    finally:
        job.kill()
        c.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the scenarios whose name contains this")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hangwatch-quality-"))
    print("| scenario | root cause | reported | incidents |")
    print("| --- | --- | --- | --- |")
    for scenario in SCENARIOS:
        if args.only and args.only not in scenario.name:
            continue
        incidents, _ = run(scenario, workdir)
        reported = "; ".join(f"{i['kind']} (culprit {i['culprit_ranks']})" for i in incidents) or "nothing"
        print(f"| {scenario.name} | {scenario.expected} | {reported} | {len(incidents)} |", flush=True)


if __name__ == "__main__":
    main()
