"""How fast each fault class is diagnosed, next to what torch.distributed alone would do.

    .venv/bin/python bench/detection.py [SCENARIO ...]     # all scenarios: a few minutes

Each scenario is a real 2-rank DDP job on gloo/CPU (``hangwatch/demos/scenarios.py``, the same
scripts ``hangwatch demo`` runs) attached to an in-process coordinator with its DEFAULT settings
(adaptive stuck threshold, embedded agent). For each it prints the incident kind and culprit, the
time from the fault's onset to the incident, and from the incident to the culprits' stacks.
torch.distributed's own answer is its timeout (30 min on gloo, 10 min on NCCL by default), or an
immediate error that names no cause.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

from hangwatch.testing import torchrun, wait_for

SCENARIOS = {
    # scenario: (expected kind, expected culprit, what torch.distributed alone does)
    "early_stop": ("early_exit", [1], "peer raises 'Connection closed by peer' at once (NCCL: hangs 10 min)"),
    "stuck": ("stuck_collective", [1], "waits for the timeout: 30 min (gloo) / 10 min (NCCL)"),
    "checkpoint": ("stuck_collective", [0], "waits for the timeout: 30 min (gloo) / 10 min (NCCL)"),
    "shape_mismatch": ("shape_mismatch", None, "returns silently wrong results (no error at all)"),
    "dtype_mismatch": ("dtype_mismatch", None, "both processes crash inside gloo, no cause given"),
    "op_mismatch": ("op_mismatch", None, "waits for the timeout: 30 min (gloo) / 10 min (NCCL)"),
    "died": ("rank_died", [1], "peer raises 'Connection reset by peer'; torchrun reports the first failure"),
    "frozen": ("rank_frozen", [1], "waits for the timeout: 30 min (gloo) / 10 min (NCCL)"),
}
REPEATS = int(os.environ.get("REPEATS", "1"))


def run(scenario: str) -> dict[str, Any]:
    from hangwatch import demos
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    script = os.path.join(os.path.dirname(demos.__file__), "scenarios.py")
    with tempfile.TemporaryDirectory() as data:
        coordinator = Coordinator(CoordinatorOptions(port=0, data_dir=data))
        coordinator.start()
        env = dict(os.environ, HANGWATCH_ADDR=f"127.0.0.1:{coordinator.port}", OMP_NUM_THREADS="1")
        job = torchrun(script, args=[scenario], env=env)

        def settled() -> dict[str, Any] | None:
            found = [i for i in coordinator.incidents_json() if i["severity"] == "error"]
            # complete once its stacks are in (or noted missing, or none were wanted: every
            # rank already gone); a short grace lets a requested dump land
            if found and (
                found[0]["stacks_time"] or found[0]["stack_notes"] or time.time() - found[0]["detected_time"] > 3
            ):
                return found[0]
            return None

        try:
            incident = wait_for(settled, 120, 0.1, "an error incident")
        except AssertionError:
            incident = None
        finally:
            job.kill(grace=20)
            coordinator.stop(0.2)
    if incident is None:
        return {"scenario": scenario, "kind": "none within 120 s"}
    return {
        "scenario": scenario,
        "kind": incident["kind"],
        "culprits": incident["culprit_ranks"],
        "detect_s": incident["detected_time"] - incident["onset_time"],
        "stacks_s": (incident["stacks_time"] or incident["detected_time"]) - incident["detected_time"],
        "incidents": 1,
    }


def main() -> None:
    chosen = sys.argv[1:] or list(SCENARIOS)
    print(f"hangwatch detection latency — default settings, 2 ranks, gloo/CPU, {REPEATS} run(s) each, medians\n")
    header = (
        f"{'scenario':<15} {'incident':<17} {'culprit':<8} {'onset→incident':>15} {'→stacks':>8}  "
        "torch.distributed alone"
    )
    print(header)
    print("-" * len(header))
    for scenario in chosen:
        runs = [run(scenario) for _ in range(REPEATS)]
        kind, culprit, alone = SCENARIOS[scenario]
        ok = [r_ for r_ in runs if "detect_s" in r_]
        if not ok:
            print(f"{scenario:<15} {runs[0]['kind']:<17}")
            continue
        detect = statistics.median(r_["detect_s"] for r_ in ok)
        stacks = statistics.median(r_["stacks_s"] for r_ in ok)
        got = ok[0]
        mark = "" if got["kind"] == kind and (culprit is None or got["culprits"] == culprit) else "  (unexpected!)"
        culprits = ",".join(map(str, got["culprits"]))
        print(f"{scenario:<15} {got['kind']:<17} {culprits:<8} {detect:>13.1f} s {stacks:>6.1f} s  {alone}{mark}")


if __name__ == "__main__":
    main()
