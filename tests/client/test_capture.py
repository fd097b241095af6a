"""What the hook captures from real torchrun gloo jobs (2 ranks), asserted on what a real in-process
coordinator received: every ``torch.distributed`` API with its op, shapes, dtypes, root/peer, reduce op
and sequence numbers aligned across ranks; DDP's C++-issued all-reduces through Flight Recorder;
steps, subgroups, call sites, the end of each rank; and the ways a job must run unharmed (forked
DataLoader workers, ``HANGWATCH_DISABLE``, an unreachable coordinator, the explicit ``attach()``).

Several APIs share one job (a torchrun costs seconds): the jobs run once per module and the tests
read what the coordinator holds afterwards.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hangwatch import config
from hangwatch import records as r
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
from hangwatch.flight_entries import entry_call_id
from tests.conftest import PRELUDE, Job, wait_for

pytestmark = pytest.mark.slow

NPROC = 2
JOB_TIMEOUT = 120.0

COLLECTIVES = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
world = dist.get_world_size()
peer = 1 - rank


def user_collectives():
    dist.all_reduce(torch.ones(3, 4), op=dist.ReduceOp.MAX)  # SITE all_reduce
    dist.reduce(torch.ones(5, dtype=torch.float64), dst=1)  # SITE reduce
    dist.broadcast(torch.zeros(2, 3, dtype=torch.int64), src=1)  # SITE broadcast
    dist.all_gather([torch.zeros(6) for _ in range(world)], torch.ones(6))  # SITE all_gather
    dist.all_gather_into_tensor(torch.zeros(2 * 7), torch.ones(7))  # SITE all_gather_into_tensor
    dist.gather(torch.ones(8), [torch.zeros(8) for _ in range(world)] if rank == 0 else None, dst=0)  # SITE gather
    dist.scatter(torch.zeros(9), [torch.ones(9) for _ in range(world)] if rank == 1 else None, src=1)  # SITE scatter
    dist.reduce_scatter(torch.zeros(10), [torch.ones(10)] * world, op=dist.ReduceOp.MIN)  # SITE reduce_scatter
    dist.reduce_scatter_tensor(torch.zeros(11), torch.ones(22), op=dist.ReduceOp.PRODUCT)  # SITE reduce_scatter_tensor
    dist.all_to_all([torch.zeros(3) for _ in range(world)], [torch.ones(3) for _ in range(world)])  # SITE all_to_all
    splits_in = [1, 3] if rank == 0 else [2, 2]
    splits_out = [1, 2] if rank == 0 else [3, 2]
    dist.all_to_all_single(torch.zeros(sum(splits_out)), torch.ones(4), splits_out, splits_in)  # SITE all_to_all_single
    dist.barrier()  # SITE barrier
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))  # SITE monitored_barrier
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])  # SITE all_reduce_coalesced
    outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(world)]
    dist.all_gather_coalesced(outs, [torch.ones(2), torch.ones(3)])  # SITE all_gather_coalesced
    work = dist.all_reduce(torch.ones(15), async_op=True)  # SITE async_all_reduce
    time.sleep(0.3)
    work.wait()


def user_p2p():
    if rank == 0:
        dist.send(torch.ones(12), dst=1)  # SITE send
        dist.isend(torch.ones(13, dtype=torch.int32), dst=1).wait()  # SITE isend
        dist.send_object_list([1, "two", {"three": 3}], dst=1)  # SITE send_object_list
    else:
        dist.recv(torch.zeros(12), src=0)  # SITE recv
        dist.irecv(torch.zeros(13, dtype=torch.int32), src=0).wait()  # SITE irecv
        dist.recv_object_list([None, None, None], src=0)  # SITE recv_object_list
    ops = [dist.P2POp(dist.isend, torch.ones(14), peer), dist.P2POp(dist.irecv, torch.zeros(14), peer)]
    for w in dist.batch_isend_irecv(ops):  # SITE batch_isend_irecv
        w.wait()


def user_objects():
    dist.broadcast_object_list([{"r": rank}, None], src=1)  # SITE broadcast_object_list
    dist.all_gather_object([None] * world, {"r": rank})  # SITE all_gather_object
    dist.gather_object({"r": rank}, [None] * world if rank == 0 else None, dst=0)  # SITE gather_object
    dist.scatter_object_list([None], [1, 2] if rank == 1 else None, src=1)  # SITE scatter_object_list


def user_groups():
    both = dist.new_group([0, 1])
    solo = dist.new_group([1])
    dist.all_reduce(torch.ones(16), group=both)  # SITE sub_all_reduce
    if rank == 1:
        dist.broadcast(torch.ones(17), group_src=0, group=solo)  # SITE solo_broadcast
    dist.all_reduce(torch.ones(18))  # SITE final


user_collectives()
user_p2p()
dist.all_reduce(torch.ones(1))  # SITE after_p2p
user_objects()
user_groups()
os.write(1, f"PID {rank} {os.getpid()}\\n".encode())  # one write: lines never interleave
"""

DDP = """
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
dist.all_reduce(torch.ones(1))  # SITE before_ddp
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8, num_workers=4, multiprocessing_context=mp.get_context("fork"))
steps = 0
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    steps += 1
dist.all_reduce(torch.ones(2))  # SITE after_ddp
os.write(1, f"PID {rank} {os.getpid()} STEPS {steps}\\n".encode())
"""

#: Rank 0 ends cleanly; rank 1 raises an uncaught exception a moment later (after rank 0 is gone,
#: so torchrun has nobody left to terminate).
ENDS = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
dist.all_reduce(torch.ones(1))
dist.barrier()


def fail_here():
    raise RuntimeError(f"boom from rank {rank}")  # SITE raise


if rank == 1:
    time.sleep(2.0)
    fail_here()
"""

SMALL = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(4))
dist.barrier()
print("FINISHED", dist.get_rank(), flush=True)
dist.destroy_process_group()  # else gloo sometimes aborts at exit, hook or not (CI, HANGWATCH_DISABLE=1)
"""

ATTACH = """
import hangwatch.client

assert "HANGWATCH_ADDR" not in os.environ
attached = hangwatch.client.attach(os.environ["TEST_COORDINATOR"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(5))  # SITE attached_all_reduce
sys.stdout.write(f"ATTACHED={attached}\\n")  # one write: ranks' lines must not interleave
sys.stdout.flush()
# torch 2.13's gloo sometimes aborts at interpreter exit when a rank leaves its group alive
# ("terminate called without an active exception", without the hook too: FIELD_NOTES.md)
dist.destroy_process_group()
"""


# ---- running jobs -----------------------------------------------------------------------------------


@dataclass
class Ran:
    coordinator: Coordinator | None
    script: Path
    rc: int
    output: str
    registrations: list[r.RankIdentity]
    launcher_pid: int

    def site(self, tag: str) -> str:
        """``file:line`` of the script line marked ``# SITE tag``."""
        for number, line in enumerate(self.script.read_text().splitlines(), 1):
            if line.rstrip().endswith(f"# SITE {tag}"):
                return f"{self.script.name}:{number}"
        raise AssertionError(f"no SITE {tag} in the script")

    @property
    def ranks(self) -> dict[int, Any]:
        assert self.coordinator is not None
        return self.coordinator.job.ranks

    def calls(self, rank: int, group: str = "0") -> list[r.CallRecord]:
        return sorted(self.ranks[rank].history.get(group, ()), key=lambda c: c.call_id)

    def at(self, rank: int, tag: str, group: str = "0") -> r.CallRecord:
        site = self.site(tag) + " in "
        found = [c for c in self.calls(rank, group) if c.call_site.startswith(site)]
        assert len(found) == 1, f"rank {rank}: expected one call from {tag}, got {found}"
        return found[0]

    def pids(self) -> dict[int, int]:
        out = {}
        for rank, pid in re.findall(r"PID (\d+) (\d+)", self.output):
            out[int(rank)] = int(pid)
        return out


def _start_coordinator(data_dir: Path) -> tuple[Coordinator, list[r.RankIdentity]]:
    c = Coordinator(CoordinatorOptions(host="127.0.0.1", port=0, data_dir=str(data_dir)))
    c.options.stuck_after = 3.0
    registrations: list[r.RankIdentity] = []
    lock = threading.Lock()
    original = c.register_rank

    def counting(identity: r.RankIdentity, via: str = "direct") -> tuple[int, float]:  # every registration, again too
        with lock:
            registrations.append(identity)
        return original(identity, via)

    c.register_rank = counting  # type: ignore[method-assign]
    c.start()
    return c, registrations


def _launch(directory: Path, body: str, name: str, env: dict[str, str]) -> tuple[Job, Path]:
    script = directory / f"{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    full_env.update(env)
    log = directory / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", str(script)],
            cwd=directory,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    return Job(proc, log), script


def run_job(
    directory: Path,
    body: str,
    name: str,
    *,
    coordinator: Coordinator | None,
    registrations: list[r.RankIdentity] | None = None,
    env: dict[str, str] | None = None,
    attach_env: bool = True,
) -> Ran:
    directory.mkdir(parents=True, exist_ok=True)
    full_env = dict(env or {})
    if coordinator is not None and attach_env:
        full_env[config.ENV_ADDR] = coordinator.addr
    job, script = _launch(directory, body, name, full_env)
    rc = job.wait(JOB_TIMEOUT)
    return Ran(coordinator, script, rc, job.output(), registrations if registrations is not None else [], job.proc.pid)


def _ended(ran: Ran, n: int = NPROC) -> bool:
    return len(ran.ranks) == n and all(st.end is not None for st in ran.ranks.values())


@pytest.fixture(scope="module")
def coordinators() -> Iterator[Callable[[Path], tuple[Coordinator, list[r.RankIdentity]]]]:
    started: list[Coordinator] = []

    def make(data_dir: Path) -> tuple[Coordinator, list[r.RankIdentity]]:
        c, regs = _start_coordinator(data_dir)
        started.append(c)
        return c, regs

    yield make
    for c in started:
        c.stop(grace=0.2)


def _module_job(tmp_path_factory: pytest.TempPathFactory, coordinators: Any, body: str, name: str) -> Ran:
    directory = tmp_path_factory.mktemp(name)
    c, regs = coordinators(directory / "data")
    ran = run_job(directory, body, name, coordinator=c, registrations=regs)
    assert ran.rc == 0, ran.output[-4000:]
    wait_for(lambda: _ended(ran), 15, what=f"both ranks of {name} to report their end")
    return ran


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory, coordinators: Any) -> Ran:
    ran = _module_job(tmp_path_factory, coordinators, COLLECTIVES, "collectives")
    assert ran.rc == 0, ran.output[-4000:]
    return ran


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory, coordinators: Any) -> Ran:
    ran = _module_job(tmp_path_factory, coordinators, DDP, "ddp")
    assert ran.rc == 0, ran.output[-4000:]
    return ran


# ---- every API ------------------------------------------------------------------------------------

F32, F64, I64, I32 = "float32", "float64", "int64", "int32"


def _m(*shapes_dtypes: tuple[tuple[int, ...], str]) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple(shapes_dtypes)


#: tag -> (op, reduce op, root, {rank: (inputs, outputs)}) as (shape, dtype) pairs.
EXPECTED: dict[str, tuple[str, str | None, int | None, dict[int, tuple[Any, Any]]]] = {
    "all_reduce": ("all_reduce", "max", None, {0: (_m(((3, 4), F32)), ()), 1: (_m(((3, 4), F32)), ())}),
    "reduce": ("reduce", "sum", 1, {0: (_m(((5,), F64)), ()), 1: (_m(((5,), F64)), ())}),
    "broadcast": ("broadcast", None, 1, {0: (_m(((2, 3), I64)), ()), 1: (_m(((2, 3), I64)), ())}),
    "all_gather": ("all_gather", None, None, {rk: (_m(((6,), F32)), _m(((6,), F32), ((6,), F32))) for rk in (0, 1)}),
    "all_gather_into_tensor": (
        "all_gather_into_tensor",
        None,
        None,
        {rk: (_m(((7,), F32)), _m(((14,), F32))) for rk in (0, 1)},
    ),
    # the gather list exists only on the root; the scatter list only on the source
    "gather": ("gather", None, 0, {0: (_m(((8,), F32)), _m(((8,), F32), ((8,), F32))), 1: (_m(((8,), F32)), ())}),
    "scatter": ("scatter", None, 1, {0: ((), _m(((9,), F32))), 1: (_m(((9,), F32), ((9,), F32)), _m(((9,), F32)))}),
    "reduce_scatter": (
        "reduce_scatter",
        "min",
        None,
        {rk: (_m(((10,), F32), ((10,), F32)), _m(((10,), F32))) for rk in (0, 1)},
    ),
    "reduce_scatter_tensor": (
        "reduce_scatter_tensor",
        "product",
        None,
        {rk: (_m(((22,), F32)), _m(((11,), F32))) for rk in (0, 1)},
    ),
    "all_to_all": (
        "all_to_all",
        None,
        None,
        {rk: (_m(((3,), F32), ((3,), F32)), _m(((3,), F32), ((3,), F32))) for rk in (0, 1)},
    ),
    "all_to_all_single": (
        "all_to_all_single",
        None,
        None,
        {0: (_m(((4,), F32)), _m(((3,), F32))), 1: (_m(((4,), F32)), _m(((5,), F32)))},
    ),
    "barrier": ("barrier", None, None, {0: ((), ()), 1: ((), ())}),
    "monitored_barrier": ("monitored_barrier", None, None, {0: ((), ()), 1: ((), ())}),
    "all_reduce_coalesced": (
        "all_reduce_coalesced",
        "sum",
        None,
        {rk: (_m(((2,), F32), ((3,), F32)), ()) for rk in (0, 1)},
    ),
    "all_gather_coalesced": (
        "all_gather_coalesced",
        None,
        None,
        {rk: (_m(((2,), F32), ((3,), F32)), _m(((2,), F32), ((3,), F32), ((2,), F32), ((3,), F32))) for rk in (0, 1)},
    ),
    "async_all_reduce": ("all_reduce", "sum", None, {rk: (_m(((15,), F32)), ()) for rk in (0, 1)}),
    "after_p2p": ("all_reduce", "sum", None, {rk: (_m(((1,), F32)), ()) for rk in (0, 1)}),
    "broadcast_object_list": ("broadcast_object_list", None, 1, {rk: (_m(((2,), "object")), ()) for rk in (0, 1)}),
    "all_gather_object": (
        "all_gather_object",
        None,
        None,
        {rk: (_m(((), "object")), _m(((2,), "object"))) for rk in (0, 1)},
    ),
    "gather_object": (
        "gather_object",
        None,
        0,
        {0: (_m(((), "object")), _m(((2,), "object"))), 1: (_m(((), "object")), ())},
    ),
    "scatter_object_list": (
        "scatter_object_list",
        None,
        1,
        {0: ((), _m(((1,), "object"))), 1: (_m(((2,), "object")), _m(((1,), "object")))},
    ),
    "final": ("all_reduce", "sum", None, {rk: (_m(((18,), F32)), ()) for rk in (0, 1)}),
}


def _shapes(metas: tuple[r.TensorMeta, ...]) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple((m.shape, m.dtype) for m in metas)


@pytest.mark.parametrize("tag", sorted(EXPECTED))
def test_collective_captured_with_op_shapes_dtypes_root_and_reduce_op(collectives: Ran, tag: str) -> None:
    op, reduce_op, root, per_rank = EXPECTED[tag]
    seqs = set()
    for rank in range(NPROC):
        call = collectives.at(rank, tag)
        assert call.op == op
        assert call.kind is r.OpKind.COLLECTIVE
        assert call.source == "python"
        assert call.reduce_op == reduce_op
        assert call.root == root
        assert call.peer is None
        inputs, outputs = per_rank[rank]
        assert _shapes(call.inputs) == inputs, f"rank {rank} inputs"
        assert _shapes(call.outputs) == outputs, f"rank {rank} outputs"
        assert call.done and call.error is None
        assert call.group == "0"
        seqs.add(call.seq)
    assert len(seqs) == 1, f"{tag}: seq differs across ranks: {seqs}"


def test_all_to_all_single_records_split_sizes(collectives: Ran) -> None:
    zero = collectives.at(0, "all_to_all_single").extra
    one = collectives.at(1, "all_to_all_single").extra
    assert (zero["input_split_sizes"], zero["output_split_sizes"], zero["group_rank"]) == ("1,3", "1,2", "0")
    assert (one["input_split_sizes"], one["output_split_sizes"], one["group_rank"]) == ("2,2", "3,2", "1")


def test_collective_seqs_align_across_ranks_and_follow_torch_numbering(collectives: Ran) -> None:
    per_rank = []
    for rank in range(NPROC):
        calls = [c for c in collectives.calls(rank) if c.kind is r.OpKind.COLLECTIVE]
        per_rank.append([(c.op, c.seq, c.seq_count) for c in calls])
        # torch numbers a group's collectives from 1; object collectives and gloo's list
        # reduce_scatter / monitored_barrier issue several, and the next call starts after them
        assert calls[0].seq == 1
        for before, after in itertools.pairwise(calls):
            assert after.seq == before.seq + before.seq_count, (before, after)
        # every collective came from Python: Flight Recorder must not report any of them again
        assert all(c.source == "python" for c in collectives.calls(rank))
    assert per_rank[0] == per_rank[1]
    objects = {op: n for op, _, n in per_rank[0] if op.endswith(("_object", "_object_list"))}
    assert all(n >= 2 for n in objects.values()), objects


P2P = {
    # tag: (rank, op, peer, pair seq, shapes)
    "send": (0, "send", 1, 1, ((12,), F32)),
    "recv": (1, "recv", 0, 1, ((12,), F32)),
    "isend": (0, "isend", 1, 2, ((13,), I32)),
    "irecv": (1, "irecv", 0, 2, ((13,), I32)),
    "send_object_list": (0, "send_object_list", 1, 3, ((3,), "object")),
    "recv_object_list": (1, "recv_object_list", 0, 3, ((3,), "object")),
}


@pytest.mark.parametrize("tag", sorted(P2P))
def test_point_to_point_captured_with_peer_and_pair_seq(collectives: Ran, tag: str) -> None:
    rank, op, peer, seq, meta = P2P[tag]
    call = collectives.at(rank, tag)
    assert (call.op, call.kind, call.peer, call.root, call.seq) == (op, r.OpKind.P2P, peer, None, seq)
    assert _shapes(call.inputs + call.outputs) == (meta,)
    assert call.async_op is op.startswith("i")
    assert call.done and call.error is None


def test_batch_isend_irecv_captured_with_its_ops(collectives: Ran) -> None:
    for rank in range(NPROC):
        call = collectives.at(rank, "batch_isend_irecv")
        assert call.op == "batch_isend_irecv" and call.kind is r.OpKind.P2P
        assert _shapes(call.inputs) == (((14,), F32), ((14,), F32))
        assert call.extra["p2p_ops"] == f"isend:{1 - rank},irecv:{1 - rank}"
        assert call.done and call.error is None
        # the isend/irecv it issues internally are not recorded a second time
        assert [c.op for c in collectives.calls(rank)].count("isend") == (1 if rank == 0 else 0)


def test_async_ops_record_completion(collectives: Ran) -> None:
    for rank in range(NPROC):
        call = collectives.at(rank, "async_all_reduce")
        assert call.async_op
        assert call.exit_time is not None
        assert call.exit_time >= call.enter_time
        assert not collectives.ranks[rank].open_calls


def test_new_group_subgroups_have_their_members(collectives: Ran) -> None:
    groups = collectives.coordinator.job.groups  # type: ignore[union-attr]
    assert groups["0"].ranks == (0, 1)
    assert groups["1"].ranks == (0, 1)
    assert groups["2"].ranks == (1,)
    for rank in range(NPROC):
        sub = collectives.at(rank, "sub_all_reduce", group="1")
        assert (sub.op, sub.seq, _shapes(sub.inputs)) == ("all_reduce", 1, (((16,), F32),))
    solo = collectives.at(1, "solo_broadcast", group="2")
    assert solo.root == 1  # group_src=0 of a group made of global rank 1
    assert "2" not in collectives.ranks[0].history


def test_call_site_names_the_users_file_line_and_function(collectives: Ran) -> None:
    for rank in range(NPROC):
        assert collectives.at(rank, "all_reduce").call_site == collectives.site("all_reduce") + " in user_collectives"
        assert collectives.at(rank, "after_p2p").call_site == collectives.site("after_p2p") + " in <module>"
        # wrapped by torch's @deprecated (typing_extensions) and still the user's line
        coalesced = collectives.at(rank, "all_reduce_coalesced")
        assert coalesced.call_site == collectives.site("all_reduce_coalesced") + " in user_collectives"
        for call in collectives.calls(rank):
            assert call.call_site.startswith("collectives.py:"), call


def test_clean_exit_reported_and_only_the_ranks_register(collectives: Ran) -> None:
    assert sorted(collectives.ranks) == [0, 1]
    assert len(collectives.registrations) == NPROC  # not torchrun's launcher, no re-registration
    pids = collectives.pids()
    for rank, state in collectives.ranks.items():
        assert state.identity.pid == pids[rank]
        assert state.identity.pid != collectives.launcher_pid
        assert state.identity.world_size == NPROC
        assert state.end is not None and state.end.kind is r.EndKind.CLEAN_EXIT
        assert state.end.exit_code == 0
        assert state.dropped == 0


# ---- DDP, Flight Recorder, steps, forked DataLoader workers ------------------------------------


def test_ddp_bucket_all_reduces_arrive_through_flight_recorder(ddp: Ran) -> None:
    per_rank = []
    for rank in range(NPROC):
        calls = ddp.calls(rank)
        from_fr = [c for c in calls if c.source == "flight_recorder"]
        buckets = [c for c in from_fr if c.op == "all_reduce"]
        assert len(buckets) >= 8, calls  # one bucket per training step (a tiny model is one bucket)
        # read from outside the rank, by the agent, through the rank's worker server
        assert ddp.ranks[rank].via == "agent"
        assert all(c.call_id == entry_call_id(c.group, c.seq) for c in from_fr)
        for c in buckets:
            assert _shapes(c.inputs) == (((161,), F32),)  # 8*16+16 + 16*1+1 parameters
            assert c.call_site.startswith("issued from C++")
            assert c.done
        # Python- and C++-issued collectives share one numbering: no gap, no duplicate
        seqs = sorted(c.seq for c in calls)
        assert seqs == list(range(1, len(seqs) + 1)), seqs
        before, after = ddp.at(rank, "before_ddp"), ddp.at(rank, "after_ddp")
        assert before.seq == 1
        assert after.seq == max(c.seq for c in from_fr) + 1
        per_rank.append(sorted((c.seq, c.op, c.source) for c in calls))
    assert per_rank[0] == per_rank[1]


def test_optimizer_step_hook_advances_step(ddp: Ran) -> None:
    assert ddp.output.count(" STEPS 8") == NPROC
    for rank in range(NPROC):
        assert ddp.ranks[rank].step == 8
        assert ddp.at(rank, "after_ddp").step == 8
        assert ddp.at(rank, "before_ddp").step == 0


def test_forked_dataloader_workers_neither_hang_nor_register(ddp: Ran) -> None:
    assert len(ddp.registrations) == NPROC, ddp.registrations
    pids = ddp.pids()
    assert {rank: st.identity.pid for rank, st in ddp.ranks.items()} == pids
    assert "Traceback" not in ddp.output
    # no warning from the hook either (torch's worker server, which the hook starts for the agent
    # to read Flight Recorder, logs the socket it listens on: that line is torch's own)
    ours = [line for line in ddp.output.lower().splitlines() if "workerserver.cpp" not in line]
    assert not [line for line in ours if "hangwatch" in line], ours
    for state in ddp.ranks.values():
        assert state.end is not None and state.end.kind is r.EndKind.CLEAN_EXIT


# ---- the end of a rank, and the ways a job must run unharmed -------------------------------------


def test_uncaught_exception_and_clean_exit_reported_as_end(tmp_path: Path, coordinators: Any) -> None:
    c, regs = coordinators(tmp_path / "data")
    ran = run_job(tmp_path, ENDS, "ends", coordinator=c, registrations=regs)
    assert ran.rc != 0
    wait_for(lambda: _ended(ran), 15, what="both ends")
    clean, failed = ran.ranks[0].end, ran.ranks[1].end
    assert clean is not None and clean.kind is r.EndKind.CLEAN_EXIT and clean.exit_code == 0
    assert failed is not None and failed.kind is r.EndKind.EXCEPTION
    assert failed.detail == "RuntimeError: boom from rank 1"
    assert failed.call_site == ran.site("raise") + " in fail_here"
    assert failed.exit_code == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_disable_env_registers_nothing_and_unreachable_coordinator_is_harmless(
    tmp_path: Path, coordinators: Any
) -> None:
    c, regs = coordinators(tmp_path / "data")
    disabled, _ = _launch(tmp_path, SMALL, "disabled", {config.ENV_ADDR: c.addr, config.ENV_DISABLE: "1"})
    down, _ = _launch(tmp_path, SMALL, "down", {config.ENV_ADDR: f"127.0.0.1:{_closed_port()}"})
    assert disabled.wait(JOB_TIMEOUT) == 0, disabled.output()[-4000:]
    assert down.wait(JOB_TIMEOUT) == 0, down.output()[-4000:]
    for job in (disabled, down):
        out = job.output()
        assert out.count("FINISHED") == NPROC
        assert "Traceback" not in out, out[-4000:]
        # at most the hook's one-line "unreachable" warning per rank; nothing else from it
        noise = [line for line in out.splitlines() if "hangwatch" in line and "unreachable" not in line]
        assert noise == [], noise
    assert "hangwatch" not in disabled.output()
    assert regs == [] and not c.job.ranks


def test_explicit_attach_without_env_var(tmp_path: Path, coordinators: Any) -> None:
    c, regs = coordinators(tmp_path / "data")
    ran = run_job(
        tmp_path,
        ATTACH,
        "attach",
        coordinator=c,
        registrations=regs,
        env={"TEST_COORDINATOR": c.addr},
        attach_env=False,
    )
    assert ran.rc == 0, ran.output[-4000:]
    assert ran.output.count("ATTACHED=True") == NPROC
    wait_for(lambda: _ended(ran), 15, what="both ranks attached by attach()")
    assert len(regs) == NPROC
    for rank in range(NPROC):
        call = ran.at(rank, "attached_all_reduce")
        assert (call.op, call.seq, _shapes(call.inputs)) == ("all_reduce", 1, (((5,), F32),))
