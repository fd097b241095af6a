"""Zero false alarms, p2p and sequence shapes: a pipeline whose last stage leaves first,
isend/irecv and batch_isend_irecv, monitored barriers. The harness is ``tests/e2e/healthy.py``."""

from __future__ import annotations

from collections.abc import Callable

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.e2e.healthy import FINISH, INIT, run_healthy  # noqa: F401

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
