"""Several jobs on one coordinator, with real torchrun jobs: two at once with one job id (as every
torchrun with a static rendezvous has, "none") never mix ranks, slots or incidents, and ``--abort-on-hang`` stops
only the hung one; the next job after them starts from nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hangwatch.cli.main import main as cli
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for
from tests.e2e.test_fault_classes import STUCK_SLEEP, TRAIN, _brief, wait_incident

#: Healthy, and looks most like a neighbour of the hung job: the same ops on the same world
#: group, at a different pace, for longer than the hang takes to be found and aborted.
STEADY = (
    TRAIN
    + """
for step in range(160):
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.1)
dist.destroy_process_group()
"""
)

#: The next job: 3 ranks, a subgroup, shapes of its own (the last job's numbering means nothing).
NEXT = (
    TRAIN
    + """
sub = dist.new_group([0, 1])
for step in range(20):
    x = torch.ones(3 + step % 2)
    dist.all_reduce(x)
    if rank < 2:
        dist.broadcast(torch.zeros(2), src=0, group=sub)
    opt.step()
    time.sleep(0.05)
dist.destroy_process_group()
"""
)


def test_two_jobs_at_once_then_a_third(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job], capsys: object
) -> None:
    c = coordinator_factory(stuck_after=3.0, abort_on_hang=True)
    addr = f"127.0.0.1:{c.port}"
    same_id = {"HANGWATCH_JOB_ID": "none"}
    steady = torchrun(STEADY, addr=addr, name="steady", env=same_id)
    wait_for(lambda: c.status()["job"]["registered"] == 2, 60, 0.2, "the steady job's ranks")
    hung = torchrun(STUCK_SLEEP, addr=addr, name="hung", env=same_id)
    inc = wait_incident(c, "stuck_collective")
    assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["step"]) == ([1], [0], 3)
    assert hung.proc.wait(60) != 0  # --abort-on-hang stopped the hung job ...
    assert steady.proc.wait(60) == 0  # ... and only it: the healthy one ran to its end
    incs = c.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    jobs = c.status()["jobs"]
    assert len(jobs) == 2 and {j["id"] for j in jobs} == {"none"}
    [steady_line] = [j for j in jobs if j["run"] != inc["run"]]
    assert steady_line["states"] == {"exited": 2} and steady_line["open_incidents"] == 0
    # --job selects: the hung job's incident is not the steady one's
    assert c.incidents_json(steady_line["key"]) == []
    assert [i["id"] for i in c.incidents_json(inc["run"])] == [inc["id"]]
    assert cli(["incidents", "--addr", addr, "--json", "--job", steady_line["run"]]) == 0
    assert json.loads(capsys.readouterr().out) == []  # type: ignore[attr-defined]

    nxt = torchrun(NEXT, addr=addr, nproc=3, name="next", env=same_id)
    assert nxt.proc.wait(120) == 0
    status = c.status()
    assert (status["job"]["world_size"], status["job"]["registered"]) == (3, 3)
    assert status["job"]["states"] == {"exited": 3}
    assert [i["id"] for i in c.incidents_json()] == [inc["id"]], _brief(c.incidents_json())
