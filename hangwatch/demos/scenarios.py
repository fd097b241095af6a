"""A small DDP training job on CPU/gloo with one injected fault. Run under torchrun:

    torchrun --nproc-per-node 2 scenarios.py early_stop

It contains no hangwatch code: the hook attaches through HANGWATCH_ADDR alone.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def save_checkpoint(model: torch.nn.Module, seconds: float) -> None:
    time.sleep(seconds)  # stands in for a slow torch.save to network storage


def main(scenario: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        metric = torch.tensor([loss.item()])
        fault_step = 6
        if scenario == "early_stop" and rank == 1 and step == fault_step:
            print(f"rank {rank}: validation loss stopped improving, stopping early", flush=True)
            break
        if scenario == "stuck" and rank == 1 and step == fault_step:
            time.sleep(3600)
        if scenario == "checkpoint" and step == fault_step:
            if rank == 0:
                save_checkpoint(model, 3600)
            dist.barrier()
        if scenario == "shape_mismatch" and step == fault_step:
            t = torch.zeros(1, 5) if rank == 0 else torch.zeros(1, 2, 5)
            dist.broadcast(t, src=0)
            time.sleep(3600)  # gloo returns silently; stay alive so the diagnosis is clear
        if scenario == "dtype_mismatch" and step == fault_step:
            dist.all_reduce(metric if rank == 0 else metric.double())
        if scenario == "op_mismatch" and step == fault_step:
            if rank == 0:
                dist.all_reduce(metric)
            else:
                dist.broadcast(metric, src=0)
        if scenario == "died" and rank == 1 and step == fault_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        if scenario == "frozen" and rank == 1 and step == fault_step:
            ctypes.PyDLL(None).sleep(3600)  # a native call that blocks while holding the GIL
        dist.all_reduce(metric)
        time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("SCENARIO", "early_stop"))
