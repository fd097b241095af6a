"""Zero false alarms: the harness of the healthy programs (``test_healthy_p2p.py``,
``test_healthy_training.py``): healthy multi-rank programs, of the shapes real users write, raise nothing.

Each test runs one correct torchrun gloo job (2-4 ranks, CPU) attached by HANGWATCH_ADDR alone
to a real coordinator whose stuck threshold is 3 s, lets it end (every rank agrees to stop and
destroys its process group), waits past the threshold and asserts that not one incident was
opened: no mismatch, no stuck collective, no early exit, no death, no straggler. The programs
use what the fault tests do not: p2p pipelines whose last stage leaves first, isend/irecv and
batch_isend_irecv, monitored_barrier, FSDP2, a 2-D DeviceMesh, DDP's Join with uneven inputs,
DataLoader workers, object collectives, solo work on rank 0 below the threshold.

A program that does raise an incident is a false alarm of hangwatch: it stays as written, marked
``xfail(strict=True)`` with the incident it raises, so fixing the detector turns it into an
unexpected pass. Every wait is bounded; the fixtures kill the jobs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hangwatch
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.records import EndKind
from hangwatch.testing import Job

#: How long a job may take, start to end; each is a few seconds of work after torch's import.
JOB_TIMEOUT_S = 120
#: After the job ends: past the fixture's stuck threshold (3 s), so every detector has spoken.
QUIET_S = 3.0

INIT = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
world = dist.get_world_size()
torch.manual_seed(1234 + rank)
"""

#: The ends of a rank that finished well, as the coordinator's status tells them.
CLEAN_ENDS = (EndKind.CLEAN_EXIT.value, EndKind.DESTROYED.value)

#: Every rank agrees that it is done, then leaves.
FINISH = """
done = torch.ones(1)
dist.all_reduce(done)
assert done.item() == world, done
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""


def _ranks_env() -> dict[str, str]:
    """The ranks import the same hangwatch as this test (a checkout, not the installed one)."""
    root = str(Path(hangwatch.__file__).resolve().parents[1])
    inherited = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, inherited) if p)}


def _details(incs: list[dict[str, Any]]) -> str:
    keys = ("kind", "culprit_ranks", "waiting_ranks", "op", "step", "summary", "details")
    return json.dumps([{k: inc.get(k) for k in keys} for inc in incs], indent=1, default=str)


def run_healthy(coordinator: Coordinator, torchrun: Callable[..., Job], body: str, *, nproc: int, name: str) -> None:
    """Run ``body`` to its end (exit code 0), wait past the stuck threshold, expect no incident."""
    job = torchrun(INIT + body, addr=f"127.0.0.1:{coordinator.port}", nproc=nproc, env=_ranks_env(), name=name)
    rc = job.wait(JOB_TIMEOUT_S)
    assert rc == 0, f"the healthy job failed ({rc}); log:\n{job.output()[-4000:]}"
    time.sleep(QUIET_S)
    incs = coordinator.incidents_json()
    assert incs == [], f"false alarm on a healthy job:\n{_details(incs)}"
    # not vacuous: every rank was attached, recorded its calls and was seen to end cleanly
    status = coordinator.status()
    ends = {rk["rank"]: (rk["end"] or {}).get("kind") for rk in status["ranks"]}
    assert status["job"]["registered"] == nproc and status["job"]["records_received"] > 0, status["job"]
    assert sorted(ends) == list(range(nproc)) and all(kind in CLEAN_ENDS for kind in ends.values()), ends
