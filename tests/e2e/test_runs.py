"""Runs on one coordinator, with real torchrun jobs: the same hang in a rerun is reported again,
an elastic restart is a run of its own, and a mismatch repeated every step is one incident.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.conftest import PRELUDE
from tests.e2e.test_fault_classes import STUCK_SLEEP, TRAIN, _brief, wait_incident


def test_the_same_hang_in_a_rerun_is_reported_again(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    first_job = torchrun(STUCK_SLEEP, addr=f"127.0.0.1:{coordinator.port}", name="rerun_a")
    first = wait_incident(coordinator, "stuck_collective")
    first_job.kill()  # the user kills the hung job and runs it again, unchanged
    second_job = torchrun(STUCK_SLEEP, addr=f"127.0.0.1:{coordinator.port}", name="rerun_b")
    second = wait_incident(coordinator, "stuck_collective", pred=lambda i: i["id"] != first["id"])
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective", "stuck_collective"], _brief(incs)
    assert (second["culprit_ranks"], second["seq"], second["step"]) == (first["culprit_ranks"], first["seq"], 3)
    old = next(i for i in incs if i["id"] == first["id"])
    assert old["status"] == "resolved" and "ended" in old["resolution"], old["resolution"]
    assert coordinator.status()["job"]["run"] == second["run"] != first["run"]
    second_job.kill()


REDUCE_OP_EVERY_STEP = (
    TRAIN
    + """
for step in range(12):
    loss = torch.tensor([float(step)])
    dist.all_reduce(loss, op=dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM)  # rank 1's bug
    opt.step()
    time.sleep(0.05)
dist.destroy_process_group()
"""
)


def test_a_reduce_op_mismatch_every_step_is_one_incident(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    job = torchrun(REDUCE_OP_EVERY_STEP, addr=f"127.0.0.1:{coordinator.port}", name="reduce_loop")
    assert job.proc.wait(120) == 0  # gloo carries on: the results are silently wrong
    inc = wait_incident(coordinator, "arg_mismatch", pred=lambda i: (i["details"].get("repeats") or {}).get("count"))
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["arg_mismatch"], _brief(incs)
    assert inc["culprit_ranks"] == [1] and inc["details"]["repeats"]["count"] >= 10


#: Attempt 0 hangs (rank 1 stops at step 3); the launcher's restart, attempt 1, runs clean.
RESTARTED = (
    TRAIN
    + """
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(30):
    if attempt == 0 and rank == 1 and step == 3:
        time.sleep(600)  # attempt 0's hang
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.05)
dist.destroy_process_group()
"""
)


def test_an_elastic_restart_is_a_new_run_and_the_hang_keeps_its_own_attempt_s_stacks(
    coordinator_factory: Callable[..., Coordinator], tmp_path: Path
) -> None:
    """``torchrun --max-restarts 1`` with ``--abort-on-hang``: the hung attempt is aborted and
    restarted. Its incident is attempt 0's, with attempt 0's stacks; attempt 1 raises nothing."""
    c = coordinator_factory(stuck_after=3.0, abort_on_hang=True)
    script = tmp_path / "restarted.py"
    script.write_text(PRELUDE + RESTARTED)
    # torch 2.13's gloo restarts cleanly only with a rendezvous store of its own per attempt
    # (FIELD_NOTES: pytorch/pytorch#135712)
    env = testing.job_env(f"127.0.0.1:{c.port}", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    job = testing.torchrun(
        script, nproc=2, env=env, cwd=tmp_path, log=tmp_path / "restarted.log", launcher_args=["--max-restarts=1"]
    )
    assert job.wait(120) == 0, job.output()[-3000:]  # aborted once, then restarted clean
    incs = c.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    (inc,) = incs
    assert (inc["culprit_ranks"], inc["attempt"], inc["step"]) == ([1], 0, 3)
    assert "time.sleep(600)" in script.read_text().splitlines()[int(_sleep_line(inc["stacks"]["1"])) - 1]
    assert inc["status"] == "resolved" and "new run" in inc["resolution"], inc["resolution"]
    status = c.status()
    assert (status["job"]["attempt"], status["job"]["states"]) == (1, {"exited": 2})
    assert status["job"]["run"] != inc["run"]


def _sleep_line(stack: str) -> str:
    """The line of restarted.py the rank's main thread stood on (``<module> (restarted.py:N)``)."""
    match = re.search(r"<module> \(restarted\.py:(\d+)\)", stack)
    assert match, stack
    return match.group(1)


#: A process group made anew in the same processes (destroy, then init again): its seqs start
#: from 1 again, and the loop after it calls other shapes, with a broadcast (a new signature: it
#: travels alone, as a read's edge sends some calls) right at the start. Steady loops travel as
#: runs. ``BAD=broadcast`` makes rank 1's broadcast at the 100th step of the second loop another
#: shape (gloo returns from it, silently wrong); ``BAD=all_reduce`` its all_reduce there another
#: size (gloo aborts rank 0).
INIT_AGAIN = (
    TRAIN
    + """
bad = os.environ.get("BAD", "")
for phase, (width, steps) in enumerate(((4, 30), (8, 200))):
    if phase:  # (a store of its own: torchrun's, used again, makes init fail now and then)
        dist.destroy_process_group()
        store = "file://" + os.path.join(os.environ["STORE_DIR"], "again-" + os.environ["MASTER_PORT"])
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    x = torch.ones(width)
    for i in range(steps):
        dist.all_reduce(torch.ones(width + 1) if bad == "all_reduce" and phase and rank == 1 and i == 100 else x)
        if phase and i in (1, 100):
            z = torch.ones(1, 2, 5) if bad == "broadcast" and rank == 1 and i == 100 else torch.ones(1, 5)
            dist.broadcast(z, src=0)
        if i % 40 == 0:
            time.sleep(0.05)
dist.destroy_process_group()
"""
)


def test_a_process_group_made_anew_in_the_same_processes_raises_nothing(
    coordinator: Coordinator, torchrun: Callable[..., Job], tmp_path: Path
) -> None:
    """The runs kept from the first numbering must not meet the second's calls at the same seqs
    (a false shape mismatch, [8] against [4]: ``JobState._renumbered``)."""
    env = {"STORE_DIR": str(tmp_path)}
    job = torchrun(INIT_AGAIN, addr=f"127.0.0.1:{coordinator.port}", name="init_again", env=env)
    assert job.wait(120) == 0, job.output()[-2000:]
    status = testing.wait_for(
        lambda: (s := coordinator.status())["job"]["states"] == {"exited": 2} and s, 30, 0.2, "both ranks' ends"
    )
    assert status["job"]["records_in_runs"] > 2 * 200, status["job"]  # the loops went as runs
    assert coordinator.incidents_json() == [], _brief(coordinator.incidents_json())
    (state,) = list(coordinator.jobs)
    assert state.numbering == {"0": {0: 1, 1: 1}}  # each rank's hook told of the group made anew


@pytest.mark.parametrize("op", ["broadcast", "all_reduce"])
def test_a_mismatch_after_the_process_group_is_made_anew_is_told_on_its_rank(
    coordinator: Coordinator, torchrun: Callable[..., Job], tmp_path: Path, op: str
) -> None:
    """Rank 1's broadcast of another shape returns (silently wrong); its all_reduce of another
    size makes gloo abort rank 0: the mismatch is told either way, not the death it caused (a
    late batch of rank 0's first loop pruned the new numbering's slots, rank 1's call with them:
    ``test_call_runs.test_a_late_batch_of_the_numbering_before_prunes_nothing_of_the_new_one``)."""
    env = {"BAD": op, "STORE_DIR": str(tmp_path)}
    torchrun(INIT_AGAIN, addr=f"127.0.0.1:{coordinator.port}", name=f"init_again_{op}", env=env)
    inc = wait_incident(coordinator, "shape_mismatch")
    assert inc["op"] == op and inc["culprit_ranks"] == [1], _brief([inc])
    if op == "broadcast":
        assert inc["seq"] == 103 and "[1, 2, 5]" in inc["summary"] and "[1, 5]" in inc["summary"], inc["summary"]
    else:
        assert inc["seq"] == 102 and "[9]" in inc["summary"] and "[8]" in inc["summary"], inc["summary"]
