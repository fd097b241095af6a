"""Zero false alarms, training wrappers and logging: FSDP2, a 2-D DeviceMesh, DDP Join with
uneven inputs, DataLoader workers, object collectives, rank 0 evaluating alone below the
threshold. The harness is ``tests/e2e/healthy.py``."""

from __future__ import annotations

from collections.abc import Callable

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.e2e.healthy import FINISH, INIT, run_healthy  # noqa: F401

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
    run_healthy(coordinator, torchrun, DDP_JOIN, nproc=2, name="ddp_join")


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
    run_healthy(coordinator, torchrun, OBJECT_COLLECTIVES, nproc=2, name="object_collectives")


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
    run_healthy(coordinator, torchrun, SOLO_EVAL, nproc=2, name="solo_eval")


# --------------------------------------------------------------------------------------------
# 10. The healthy look-alikes of a DDP rank skipping its backward: gradient accumulation under
# no_sync() (forwards without an all-reduce, on every rank), rank 0 evaluating alone through the
# DDP model under no_grad (forwards on one rank only), and a bad batch skipped by every rank
# together (the skip flag all-reduced first, as the hint says).

DDP_SKIPS_TOGETHER = (
    """
import contextlib
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(12):
    for micro in range(2):
        sync = contextlib.nullcontext() if micro == 1 else model.no_sync()
        with sync:
            loss = model(torch.randn(4, 8)).pow(2).mean()
            bad = torch.tensor([float(step == 5 and rank == 1)])  # rank 1 alone sees a NaN loss
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                continue  # every rank skips this micro-batch together
            loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0 and step % 4 == 3:
        with torch.no_grad():
            model(torch.randn(16, 8))  # evaluation through the DDP model, rank 0 only
    time.sleep(0.05)
"""
    + FINISH
)


def test_ddp_skips_agreed_accumulation_and_solo_eval_forwards(
    coordinator: Coordinator, torchrun: Callable[..., Job]
) -> None:
    run_healthy(coordinator, torchrun, DDP_SKIPS_TOGETHER, nproc=2, name="ddp_skips_together")
