"""One end-to-end test per fault class: a real torchrun gloo job (2 ranks, 3-4 where it matters)
attached by HANGWATCH_ADDR alone, a real in-process coordinator, and the incident it must
produce: kind, culprit and waiting ranks, and the detail a person needs (shapes, ops, step).

gloo reacts to most faults in its own way (see FIELD_NOTES): it hangs, crashes one or both
ranks, or returns silently wrong results. Whatever it does, the diagnosis must name the cause,
and only once. Every wait is bounded; the fixtures kill the jobs.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for

Incident = dict[str, Any]

INIT = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
world = dist.get_world_size()
"""

#: A tiny "training loop" whose optimizer steps hangwatch counts as steps (no code change).
TRAIN = (
    INIT
    + """
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
t = torch.ones(4)
"""
)


def _incidents(c: Coordinator, kind: str | None = None) -> list[Incident]:
    return [i for i in c.incidents_json() if kind is None or i["kind"] == kind]


def wait_incident(
    c: Coordinator, kind: str, timeout: float = 60, pred: Callable[[Incident], bool] | None = None
) -> Incident:
    def find() -> Incident | None:
        for inc in _incidents(c, kind):
            if pred is None or pred(inc):
                return inc
        return None

    try:
        return wait_for(find, timeout, 0.2, f"a {kind} incident")  # type: ignore[no-any-return]
    except AssertionError:
        raise AssertionError(f"no {kind} incident; have: {_brief(c.incidents_json())}; {_lateness(c)}") from None


def _lateness(c: Coordinator) -> str:
    """How late the coordinator ran and its ranks were heard, for a test that waited in vain (the
    stuck detector holds while the coordinator is behind)."""
    now = time.time()
    with c.lock:
        return "; ".join(
            f"job {job.job_id or '?'}: behind {job.behind(now):.1f} s (worst: queue {job.lag.worst:.1f} s, "
            f"heard {job.heard.worst:.1f} s), each rank last sent "
            + ", ".join(f"{rk} {now - st.last_sent:.1f} s ago" for rk, st in sorted(job.ranks.items()))
            for job in c.jobs
        )


def wait_stacks(c: Coordinator, incident_id: str, rank: int, timeout: float = 30) -> str:
    def get() -> str:
        for inc in c.incidents_json():
            if inc["id"] == incident_id:
                return inc["stacks"].get(str(rank)) or inc["stacks"].get(rank) or ""  # type: ignore[no-any-return]
        return ""

    return wait_for(get, timeout, 0.2, f"rank {rank}'s stack on {incident_id}")  # type: ignore[no-any-return]


def settle(c: Coordinator, job: Job, timeout: float = 30) -> None:
    """Let the job end on its own (gloo crashes) and the coordinator see every end, then give the
    detectors a couple of ticks to open whatever else they would (so extra incidents are caught)."""
    try:
        job.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
    time.sleep(3)


def _brief(incs: list[Incident]) -> str:
    return (
        "; ".join(
            f"[{i['kind']} culprits={i['culprit_ranks']} waiting={i['waiting_ranks']}] {i['summary']}" for i in incs
        )
        or "none"
    )


# --------------------------------------------------------------------------------------------
# early_exit


EARLY_EXIT_DDP = (
    INIT
    + """
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
for step in range(100):
    if rank == 1 and step == 5:
        print("rank 1 stops early", flush=True)
        break
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    time.sleep(0.1)
if rank == 1:
    sys.exit(0)
"""
)

EARLY_EXIT_DESTROY = (
    TRAIN
    + """
for step in range(100):
    if rank == 1 and step == 5:
        break
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.1)
if rank == 1:
    dist.destroy_process_group()
"""
)


@pytest.mark.parametrize("script", [EARLY_EXIT_DDP, EARLY_EXIT_DESTROY], ids=["ddp-exit", "all_reduce-destroy"])
def test_early_exit(coordinator: Coordinator, torchrun: Callable[..., Job], script: str) -> None:
    job = torchrun(script, addr=f"127.0.0.1:{coordinator.port}", name="early_exit")
    inc = wait_incident(coordinator, "early_exit")
    settle(coordinator, job)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["early_exit"], _brief(incs)
    inc = incs[0]
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert inc["step"] == 5
    assert "rank 1" in inc["summary"]
    assert "all_reduce" in inc["op"] or "allreduce" in inc["op"]


EARLY_EXIT_BARRIER = (
    TRAIN
    + """
for step in range(100):
    if rank == 1 and step == 4:
        break
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.1)
dist.barrier()
"""
)


def test_early_exit_into_final_barrier(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(EARLY_EXIT_BARRIER, addr=f"127.0.0.1:{coordinator.port}", name="early_barrier")
    inc = wait_incident(coordinator, "early_exit")
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert "barrier" in inc["summary"]
    assert "all_reduce" in inc["summary"]
    assert inc["step"] == 4
    time.sleep(4)  # past stuck_after: the hang must not be reported a second time
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["early_exit"], _brief(incs)
    job.kill()


# --------------------------------------------------------------------------------------------
# stuck_collective


STUCK_SLEEP = (
    TRAIN
    + """
for step in range(100):
    if rank == 1 and step == 3:
        time.sleep(600)
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.1)
"""
)


def test_stuck_collective_sleeping_rank(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(STUCK_SLEEP, addr=f"127.0.0.1:{coordinator.port}", name="stuck_sleep")
    inc = wait_incident(coordinator, "stuck_collective")
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert inc["op"] == "all_reduce"
    assert inc["step"] == 3
    stack = wait_stacks(coordinator, inc["id"], 1)
    assert "stuck_sleep.py" in stack
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    job.kill()


STUCK_CHECKPOINT = (
    TRAIN
    + """
def save_checkpoint(step):
    time.sleep(600)  # a slow filesystem, only on rank 0

for step in range(100):
    dist.all_reduce(t)
    opt.step()
    if step == 3:
        if rank == 0:
            save_checkpoint(step)
        dist.barrier()
    time.sleep(0.1)
"""
)


def test_stuck_collective_checkpoint_on_rank0(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(STUCK_CHECKPOINT, addr=f"127.0.0.1:{coordinator.port}", nproc=3, name="stuck_ckpt")
    inc = wait_incident(coordinator, "stuck_collective")
    assert inc["culprit_ranks"] == [0]
    assert inc["waiting_ranks"] == [1, 2]
    assert inc["op"] == "barrier"
    assert inc["step"] == 4
    stack = wait_stacks(coordinator, inc["id"], 0)
    assert "save_checkpoint" in stack
    fresh = next(i for i in coordinator.incidents_json() if i["id"] == inc["id"])
    assert "save_checkpoint" in fresh["summary"] + str(fresh["details"].get("stack_summary", ""))
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    job.kill()


# --------------------------------------------------------------------------------------------
# shape / dtype / op / arg mismatches


SHAPE_BROADCAST = (
    TRAIN
    + """
for step in range(3):
    dist.all_reduce(t)
    opt.step()
x = torch.zeros(1, 5) if rank == 0 else torch.zeros(1, 2, 5)
dist.broadcast(x, src=0)  # gloo returns at once, silently wrong
for step in range(3):
    dist.all_reduce(t)
    opt.step()
print("done", x.shape, flush=True)
"""
)


def test_shape_mismatch_broadcast_silent(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(SHAPE_BROADCAST, addr=f"127.0.0.1:{coordinator.port}", name="shape_bcast")
    inc = wait_incident(coordinator, "shape_mismatch")
    assert inc["op"] == "broadcast"
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert "[1, 5]" in inc["summary"] and "[1, 2, 5]" in inc["summary"]
    assert inc["step"] == 3
    assert job.wait(60) == 0  # gloo did not notice
    time.sleep(2)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["shape_mismatch"], _brief(incs)


SHAPE_ALL_REDUCE = (
    TRAIN
    + """
for step in range(3):
    dist.all_reduce(t)
    opt.step()
x = torch.ones(10) if rank == 0 else torch.ones(20)
dist.all_reduce(x)
for step in range(3):
    dist.all_reduce(t)
    opt.step()
"""
)


def test_shape_mismatch_all_reduce_crash(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(SHAPE_ALL_REDUCE, addr=f"127.0.0.1:{coordinator.port}", name="shape_ar")
    inc = wait_incident(coordinator, "shape_mismatch")
    assert inc["op"] == "all_reduce"
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert "[10]" in inc["summary"] and "[20]" in inc["summary"]
    assert inc["step"] == 3
    settle(coordinator, job)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["shape_mismatch"], _brief(incs)  # the crash is its consequence


DTYPE = (
    TRAIN
    + """
for step in range(2):
    dist.all_reduce(t)
    opt.step()
x = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.float64)
dist.all_reduce(x)
"""
)


def test_dtype_mismatch(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(DTYPE, addr=f"127.0.0.1:{coordinator.port}", name="dtype")
    inc = wait_incident(coordinator, "dtype_mismatch")
    assert inc["op"] == "all_reduce"
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert "float32" in inc["summary"] and "float64" in inc["summary"]
    assert inc["step"] == 2
    settle(coordinator, job)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["dtype_mismatch"], _brief(incs)


OP_MISMATCH = (
    TRAIN
    + """
for step in range(3):
    dist.all_reduce(t)
    opt.step()
if rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, src=0)
time.sleep(1)
"""
)


def test_op_mismatch(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(OP_MISMATCH, addr=f"127.0.0.1:{coordinator.port}", name="op")
    inc = wait_incident(coordinator, "op_mismatch")
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert "all_reduce" in inc["summary"] and "broadcast" in inc["summary"]
    assert inc["step"] == 3
    settle(coordinator, job, timeout=8)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["op_mismatch"], _brief(incs)


ARG_SRC = (
    TRAIN
    + """
for step in range(3):
    dist.all_reduce(t)
    opt.step()
x = torch.full((4,), float(rank))
dist.broadcast(x, src=rank)  # each rank thinks it is the root
dist.all_reduce(t)
"""
)

ARG_REDUCE_OP = (
    TRAIN
    + """
for step in range(3):
    dist.all_reduce(t)
    opt.step()
dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
dist.all_reduce(t)
"""
)


@pytest.mark.parametrize(
    ("script", "op", "words"),
    [(ARG_SRC, "broadcast", ("src",)), (ARG_REDUCE_OP, "all_reduce", ("SUM", "MAX"))],
    ids=["broadcast-src", "reduce-op"],
)
def test_arg_mismatch(
    coordinator: Coordinator, torchrun: Callable[..., Job], script: str, op: str, words: tuple[str, ...]
) -> None:
    job = torchrun(script, addr=f"127.0.0.1:{coordinator.port}", name="arg")
    inc = wait_incident(coordinator, "arg_mismatch")
    assert inc["op"] == op
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    for word in words:
        assert word in inc["summary"]
    assert inc["step"] == 3
    settle(coordinator, job, timeout=8)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["arg_mismatch"], _brief(incs)


# --------------------------------------------------------------------------------------------
# p2p


P2P_WRONG_PEER = (
    TRAIN
    + """
for step in range(2):
    dist.all_reduce(t)
    opt.step()
x = torch.ones(4)
if rank == 0:
    dist.send(x, dst=1)
elif rank == 1:
    dist.recv(x, src=2)  # should be src=0
else:
    time.sleep(600)
"""
)

P2P_SIZES = (
    TRAIN
    + """
for step in range(2):
    dist.all_reduce(t)
    opt.step()
if rank == 0:
    dist.send(torch.ones(10), dst=1)
else:
    dist.recv(torch.ones(20), src=0)
"""
)


def test_p2p_wrong_peer(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(P2P_WRONG_PEER, addr=f"127.0.0.1:{coordinator.port}", nproc=3, name="p2p_peer")
    inc = wait_incident(coordinator, "p2p_mismatch")
    assert inc["culprit_ranks"] == [0, 1]
    assert "rank 0 sends to rank 1" in inc["summary"]
    assert "receiving from rank 2" in inc["summary"]
    time.sleep(4)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["p2p_mismatch"], _brief(incs)
    job.kill()


def test_p2p_size_mismatch(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(P2P_SIZES, addr=f"127.0.0.1:{coordinator.port}", name="p2p_size")
    inc = wait_incident(coordinator, "p2p_mismatch")
    assert inc["culprit_ranks"] == [0, 1]
    assert "10 elements" in inc["summary"] and "20 elements" in inc["summary"]
    settle(coordinator, job, timeout=10)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["p2p_mismatch"], _brief(incs)


# --------------------------------------------------------------------------------------------
# rank_died, rank_frozen


DIES = (
    TRAIN
    + """
def load_batch(step):
    if rank == 1 and step == 4:
        raise ValueError(f"corrupt sample in shard {step}")
    return torch.ones(4)

for step in range(100):
    t = load_batch(step)
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.1)
"""
)


def test_rank_died_with_exception(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(DIES, addr=f"127.0.0.1:{coordinator.port}", name="dies")
    inc = wait_incident(coordinator, "rank_died")
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    assert "ValueError" in inc["summary"] and "corrupt sample in shard 4" in inc["summary"]
    assert "dies.py" in inc["summary"] and "load_batch" in inc["summary"]
    assert inc["step"] == 4
    settle(coordinator, job)
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["rank_died"], _brief(incs)  # rank 0's failure is a consequence


FROZEN = (
    TRAIN
    + """
import ctypes
for step in range(100):
    if rank == 1 and step == 3:
        ctypes.PyDLL(None).sleep(600)  # native sleep holding the GIL: even the hook's thread stops
    dist.all_reduce(t)
    opt.step()
    time.sleep(0.1)
"""
)


def test_rank_frozen_holding_gil(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(FROZEN, addr=f"127.0.0.1:{coordinator.port}", name="frozen")
    inc = wait_incident(coordinator, "rank_frozen")
    assert inc["culprit_ranks"] == [1]
    assert inc["waiting_ranks"] == [0]
    # a rank that freezes holding the GIL right after a step may not get to ship that last step
    assert inc["step"] in (2, 3)
    stack = wait_stacks(coordinator, inc["id"], 1)
    assert "sleep" in stack
    assert "frozen.py" in stack
    incs = coordinator.incidents_json()
    assert [i["kind"] for i in incs] == ["rank_frozen"], _brief(incs)
    job.kill()


# --------------------------------------------------------------------------------------------
# a healthy job: no incident at all


HEALTHY = (
    INIT
    + """
import random
random.seed(rank)
evens = dist.new_group([0, 2])
odds = dist.new_group([1, 3])
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 16)
mine = evens if rank % 2 == 0 else odds
pair = pairs[rank // 2]
start = time.time()
step = 0
while True:
    # the ranks agree on when to stop (each by its own clock could stop one step apart: a real hang)
    done = torch.tensor([float(time.time() - start >= 12)])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    time.sleep(random.uniform(0.02, 0.4))  # jittery data loading
    loss = torch.tensor([float(step)])
    dist.all_reduce(loss, group=mine)
    dist.all_reduce(loss, group=pair)
    if step % 20 == 19:  # every rank checkpoints together
        torch.save(model.state_dict(), f"ckpt-{rank}.pt")
        time.sleep(random.uniform(0.1, 1.0))
        dist.barrier()
    step += 1
flag = torch.zeros(1)
dist.all_reduce(flag, op=dist.ReduceOp.MAX)
dist.barrier()
dist.destroy_process_group()
"""
)


@pytest.mark.slow
def test_healthy_job_has_no_incident(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    job = torchrun(HEALTHY, addr=f"127.0.0.1:{coordinator.port}", nproc=4, name="healthy")
    rc = job.wait(150)
    assert rc == 0, job.output()[-3000:]
    time.sleep(3)
    assert coordinator.incidents_json() == [], _brief(coordinator.incidents_json())


INSTALLED_TRAINER = """
import datetime, time
import torch
import torch.distributed as dist


def train_step(t):
    dist.all_reduce(t)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    t = torch.ones(4)
    for step in range(100):
        if rank == 1 and step == 3:
            time.sleep(600)
        train_step(t)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
"""


def test_a_training_script_installed_as_a_package_is_the_call_site(coordinator: Coordinator, tmp_path: Path) -> None:
    """``torchrun -m mytrainer.train`` with the package installed in site-packages (laid out as
    pip lays it out): the call site is the package's line, not runpy's or multiprocessing's."""
    package = tmp_path / "lib" / "site-packages" / "mytrainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(INSTALLED_TRAINER)
    env = testing.job_env(f"127.0.0.1:{coordinator.port}", {"PYTHONPATH": str(package.parent)})
    job = testing.torchrun(
        "mytrainer.train", nproc=2, env=env, cwd=tmp_path, log=tmp_path / "installed.log", launcher_args=["-m"]
    )
    try:
        inc = wait_incident(coordinator, "stuck_collective")
        assert inc["culprit_ranks"] == [1]
        assert "at train.py:8 in train_step" in inc["summary"] and "busy in train.py:17 in main" in inc["summary"], inc[
            "summary"
        ]
        assert "runpy" not in inc["summary"] and "multiprocessing" not in inc["summary"]
    finally:
        job.kill()
