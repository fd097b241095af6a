"""Zero false alarms: healthy multi-rank programs, of the shapes real users write, raise nothing.

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
QUIET_S = 3.5

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


# --------------------------------------------------------------------------------------------
# 1. A 3-stage p2p pipeline (GPipe: all forwards, then all backwards), 4 microbatches a step.
# The schedule is the agreement: every stage knows the number of steps. The last stage sends its
# final gradient and leaves (destroys its group, exits) while stages 0 and 1 are still receiving
# and sending their final gradients.

PIPELINE = """
MICRO, STEPS = 4, 2
first, last = rank == 0, rank == world - 1
stage = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
opt = torch.optim.SGD(stage.parameters(), lr=0.01)


def backward_compute():
    # the slow part of stages 0 and 1: when stage 2 has left, stage 1 still computes its last
    # backward and stage 0 waits in its final recv
    time.sleep(0.25)


for step in range(STEPS):
    saved = []
    for mb in range(MICRO):
        if first:
            x = torch.randn(16, 32)
        else:
            x = torch.empty(16, 32)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if not last:
            dist.send(y.detach(), dst=rank + 1)
        saved.append((x, y))
    for x, y in reversed(saved):
        if last:
            y.pow(2).mean().backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, src=rank + 1)
            backward_compute()
            y.backward(grad)
        if not first:
            dist.send(x.grad, dst=rank - 1)
    opt.step()
    opt.zero_grad()
print(f"stage {rank} done at {time.time():.3f}", flush=True)
dist.destroy_process_group()
"""


def test_pipeline_last_stage_leaves_first(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, PIPELINE, nproc=3, name="pipeline")


# --------------------------------------------------------------------------------------------
# 2. Non-blocking p2p: a leader pings each worker (isend/irecv, wait()), then a ring exchange of
# blocks with batch_isend_irecv (ring attention's pattern), checked against an all_reduce.

P2P_ASYNC = (
    """
for rnd in range(5):
    if rank == 0:
        for peer in range(1, world):
            ping = torch.tensor([float(rnd), float(peer)])
            pong = torch.empty(2)
            send = dist.isend(ping, dst=peer)
            recv = dist.irecv(pong, src=peer)
            send.wait()
            recv.wait()
            assert pong.tolist() == [rnd + 1.0, peer * 10.0], pong
    else:
        ping = torch.empty(2)
        dist.irecv(ping, src=0).wait()
        time.sleep(0.02 * rank)
        dist.isend(torch.tensor([ping[0].item() + 1, ping[1].item() * 10]), dst=0).wait()

right, left = (rank + 1) % world, (rank - 1) % world
for step in range(4):
    block = torch.full((64,), float(rank + step))
    total = block.clone()
    for hop in range(world - 1):
        incoming = torch.empty_like(block)
        ops = [dist.P2POp(dist.isend, block, right), dist.P2POp(dist.irecv, incoming, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        total += incoming
        block = incoming
    check = torch.full((64,), float(rank + step))
    dist.all_reduce(check)
    assert torch.equal(total, check), (total, check)
"""
    + FINISH
)


def test_isend_irecv_ping_pong_and_batched_ring(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, P2P_ASYNC, nproc=3, name="p2p_async")


# --------------------------------------------------------------------------------------------
# 3. monitored_barrier between phases (it names a missing rank where a barrier would just hang),
# all_reduce before and after, ranks arriving at uneven paces.

MONITORED_BARRIER = (
    """
param = torch.nn.Parameter(torch.zeros(8))
opt = torch.optim.SGD([param], lr=0.1)
for phase in ("warmup", "train", "cooldown"):
    for step in range(3):
        grad = torch.randn(8)
        dist.all_reduce(grad)
        param.grad = grad / world
        opt.step()
        time.sleep(0.03 * rank)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=phase == "train")
    marker = torch.ones(1)
    dist.all_reduce(marker)
    assert marker.item() == world
"""
    + FINISH
)


def test_monitored_barrier_between_phases(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, MONITORED_BARRIER, nproc=3, name="monitored_barrier")


# --------------------------------------------------------------------------------------------
# 4. FSDP2 (fully_shard) on CPU/gloo: a small MLP, each Linear sharded, a few AdamW steps; its
# all_gather_into_tensor and reduce_scatter_tensor run on FSDP's own streams of work.

FSDP2 = (
    """
from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)  # every rank builds the same model before sharding
model = torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
torch.manual_seed(rank)
for step in range(5):
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
"""
    + FINISH
)


def test_fsdp2_fully_shard_mlp(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, FSDP2, nproc=2, name="fsdp2")


# --------------------------------------------------------------------------------------------
# 5. A 2-D DeviceMesh ("dp" x "tp", 4 ranks): partial sums reduced over "tp", gradients averaged
# over "dp", each on its dimension's group.

DEVICE_MESH = (
    """
from torch.distributed.device_mesh import init_device_mesh

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
param = torch.nn.Parameter(torch.zeros(8))
opt = torch.optim.SGD([param], lr=0.1)
for step in range(5):
    partial = torch.full((8,), float(rank))
    dist.all_reduce(partial, group=tp)
    expected = float(sum(dist.get_process_group_ranks(tp)))
    assert torch.all(partial == expected), (partial, expected)
    grad = partial.clone()
    dist.all_reduce(grad, group=dp)
    param.grad = grad / mesh.size(0)
    opt.step()
    time.sleep(0.02)
"""
    + FINISH
)


def test_device_mesh_2d_groups(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, DEVICE_MESH, nproc=4, name="device_mesh")


# --------------------------------------------------------------------------------------------
# 6. DDP with uneven inputs under Join: rank r has 3 + 2r batches; the ranks that run out first
# shadow the others' gradient all_reduces until every rank has joined.

DDP_JOIN = (
    """
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(rank)
batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3 + 2 * rank)]
with Join([model]):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.05)
print(f"rank {rank} trained on {len(batches)} batches", flush=True)
"""
    + FINISH
)


def test_ddp_join_uneven_inputs(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, DDP_JOIN, nproc=3, name="ddp_join")


# --------------------------------------------------------------------------------------------
# 7. DDP fed by a DataLoader with two worker processes per rank (forked after init_process_group)
# and a DistributedSampler, two epochs.

DDP_DATALOADER = (
    """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((8,), float(i) / 64)
        return x, x.pow(2).sum(0, keepdim=True)


torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sampler = DistributedSampler(Squares(), shuffle=True, seed=0)
loader = DataLoader(Squares(), batch_size=8, sampler=sampler, num_workers=2)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""
    + FINISH
)


def test_ddp_with_dataloader_workers(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, DDP_DATALOADER, nproc=2, name="ddp_dataloader")


# --------------------------------------------------------------------------------------------
# 8. Logging through object collectives each step: all_gather_object of every rank's metrics,
# gather_object to rank 0, broadcast_object_list of rank 0's decision (which also ends the loop).

OBJECT_COLLECTIVES = """
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
step, keep_going = 0, True
while keep_going:
    grad = torch.randn(4)
    dist.all_reduce(grad)
    param.grad = grad
    opt.step()
    metrics = {"rank": rank, "step": step, "loss": float(grad.norm()), "host": os.uname().nodename}
    everyone = [None] * world
    dist.all_gather_object(everyone, metrics)
    assert [m["rank"] for m in everyone] == list(range(world))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({"step": step, "tokens": 128 * (rank + 1)}, gathered, dst=0)
    decision = [{"continue": step < 5, "lr": 0.1 / (step + 1)}] if rank == 0 else [None]
    dist.broadcast_object_list(decision, src=0)
    keep_going = decision[0]["continue"]
    if rank == 0:
        print(f"step {step}: {sum(g['tokens'] for g in gathered)} tokens", flush=True)
    step += 1
dist.destroy_process_group()
"""


def test_object_collectives_for_logging(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, OBJECT_COLLECTIVES, nproc=3, name="object_collectives")


# --------------------------------------------------------------------------------------------
# 9. Rank 0 evaluates alone every 4 steps (about 1.5 s, half the stuck threshold) while the
# others wait: once in a barrier, once straight in the next gradient all_reduce.

SOLO_EVAL = (
    """
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def evaluate():
    with torch.no_grad():
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            model(torch.randn(32, 16))
            time.sleep(0.05)


for step in range(9):
    opt.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    if step % 4 == 3:
        if rank == 0:
            evaluate()
        if step == 3:
            dist.barrier()  # the second time, the others wait in the next all_reduce instead
"""
    + FINISH
)


def test_rank0_evaluates_alone_below_threshold(coordinator: Coordinator, torchrun: Callable[..., Job]) -> None:
    run_healthy(coordinator, torchrun, SOLO_EVAL, nproc=3, name="solo_eval")
